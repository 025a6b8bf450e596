"""The turn loop: one agent turn as an explicit walk through the phases. No Ray in here.

The loop owns the canonical transcript of its turn (pre-turn baseline + the turn's own messages)
and checkpoints it only at the durable boundaries of DESIGN §3:

1. after a tool batch completes (leaving ``executing_tools``),
2. after a reactive compaction (leaving ``compacting``),
3. before entering ``force_stop``,

plus the final save at ``done``. Work that changes durable state sets a dirty flag; it is
cleared only after a save succeeded (peek-then-take), so a failed or debounced save is retried
at the next site. Every save rebuilds the whole transcript, never a diff. Each save is awaited
before the next side effect, and a :class:`~bus.errors.StaleOwner` refusal stops the loop at
once: a newer owner is driving the turn.
"""

from __future__ import annotations

import logging
import random

from actors.turn.compaction import compact, size_chars
from actors.turn.llm import LLMReply
from actors.turn.loop_state import CancelNow, Fenced, Released, TooLarge, new_id
from actors.turn.loopdetect import LoopVerdict, detect_loop
from actors.turn.model_steps import ModelSteps, problem_of, reply_bytes
from actors.turn.recovery import MAX_RETRIES, Decision, Situation, decide_recovery, nudge_text
from actors.turn.run_result import RunStop, TurnOutcome
from actors.turn.tool_steps import ToolSteps
from bus.errors import AwaitingAdmission, LLMError, RateLimitedLLMError, StoreError
from bus.events import LIVE_TEXT_LIMIT, Recovering, Restarted
from bus.messages import Message
from bus.outcomes import Action, Outcome, Problem, SaveReason
from bus.phase import TurnPhase
from store.records import ReplyJournal

log = logging.getLogger(__name__)
P = TurnPhase


class TurnLoop(ToolSteps, ModelSteps):
    """Drives one turn from a record (fresh at ``submitted``, or claimed for a resume)."""

    # -- public -------------------------------------------------------------------------------

    def cancel_llm(self) -> bool:
        """Cancel the in-flight model call (the watchdog's hard timeout). False if none."""
        task = self._llm_task
        if task is None or task.done():
            return False
        self._hard_cancelled = True
        task.cancel()
        return True

    def request_cancel(self) -> None:
        """An operator's cancel (already durable in the turn's inbox): end the in-flight model
        call and any wait now; tools in flight finish first (their ledger stays exact)."""
        self._cancel.set()
        task = self._llm_task
        if task is not None and not task.done():
            task.cancel()

    async def run(self) -> TurnOutcome:
        t = self.tracker
        if self.epoch > 1:  # a new owner: what streamed after the last checkpoint is gone
            self._emit(
                Restarted(
                    self.turn_id,
                    self.epoch,
                    self._resume_from,
                    len(self.messages),
                    self._now_ms(),
                )
            )
        try:
            t.to(P.SETUP)
            if self._journal is not None:  # the reply is durable: its batch goes on, not asked
                return await self._continue_journaled(self._journal)
            if self._resume_from is SaveReason.FORCE_STOP:
                return await self._force_stop(checkpoint_first=False)
            t.to(P.AWAITING_LLM)
            self._tell_lost_reply()
            return await self._drive()
        except CancelNow:
            return await self._finish_cancelled()
        except Fenced:
            return self._outcome(RunStop.FENCED)
        except Released:
            return self._outcome(RunStop.RELEASED)
        except TooLarge as too_large:
            return await self._end_oversized(too_large.outcome)

    # -- the walk -----------------------------------------------------------------------------

    async def _continue_journaled(self, journal: ReplyJournal) -> TurnOutcome:
        """Resume from a reply journaled after the checkpoint: the model is not asked again;
        its batch runs under the same keys (a finished call reused, a non-idempotent one
        caught in flight reported ``outcome_unknown``, an idempotent one run again), then
        the turn goes on as after any batch."""
        log.info(
            "turn %s: continuing from the reply journaled at epoch %d (batch %d); the model is "
            "not asked again",
            self.turn_id,
            journal.epoch,
            journal.batch,
        )
        self._adopt_journal(journal)
        self.tracker.to(P.AWAITING_LLM)
        self.tracker.to(P.EXECUTING_TOOLS)
        settles = await self._run_batch(journal.reply.tool_calls)
        await self._checkpoint(SaveReason.TOOL_BATCH, settles=settles)
        self.tracker.to(P.AWAITING_LLM)
        return await self._drive()

    def _tell_lost_reply(self) -> None:
        """Tell the model, once, that replies of its own were lost with what they asked for
        (a journal refused on resume), before it is asked again: never a silent re-ask."""
        lost, self._lost_reply = self._lost_reply, ""
        if not lost:
            return
        log.warning("turn %s: a journaled reply was refused; telling the model", self.turn_id)
        self._counters = self._counters.model_copy(
            update={"replies_lost": self._counters.replies_lost + 1}
        )
        self.tracker.to(P.INJECTING_MESSAGE)
        self._append(Message(role="user", text=lost), "system", injected=True)
        self.tracker.restore()

    async def _drive(self) -> TurnOutcome:
        while True:
            await self._drain_inbox()
            if self._cancel.is_set():
                return await self._finish_cancelled()
            await self._compact_if_large()
            answer = await self._ask(tools_enabled=True)
            if isinstance(answer, TurnOutcome):
                return answer
            reply = answer.message
            self._append(reply, "llm", usage=answer.usage)
            if not reply.tool_calls:
                if answer.truncated:  # a text reply cut by the caller's cap: still the answer
                    log.info("turn %s: the answer was cut by max_tokens; kept", self.turn_id)
                    return await self._finish(Outcome.TRUNCATED)
                return await self._finish(Outcome.ANSWERED)
            spent = self._budget_spent()
            if spent:
                self._skip_batch(reply.tool_calls, spent)
                return await self._force_stop(checkpoint_first=True)
            limit = self.settings.max_tool_rounds
            if limit is not None and self._counters.tool_batches >= limit:
                self._skip_batch(reply.tool_calls, f"the agent's limit of {limit} tool rounds")
                return await self._force_stop(checkpoint_first=True)
            found = detect_loop(
                self._turn, reply.tool_calls, self.settings.loop_thresholds, self._calls
            )
            if found.verdict is not LoopVerdict.OK:
                self._skip_batch(reply.tool_calls, found.reason())
                decision = self._decide(Problem.LOOP, loop_stop=found.verdict is LoopVerdict.STOP)
                done = await self._apply(decision, Problem.LOOP, found.reason())
                if done is not None:
                    return done
                continue
            self.tracker.to(P.EXECUTING_TOOLS)
            settles = await self._run_batch(reply.tool_calls)
            await self._checkpoint(SaveReason.TOOL_BATCH, settles=settles)
            self.tracker.to(P.AWAITING_LLM)

    async def _ask(self, *, tools_enabled: bool) -> LLMReply | TurnOutcome:
        """One model call under the recovery policy, whichever call it is (the force stop's
        wrap-up too): retried, compacted or nudged as :func:`decide_recovery` says. Returns a
        usable reply, or the outcome when the policy ended the turn."""
        more_room = False
        while True:
            if self._cancel.is_set():
                raise CancelNow
            self._inbox_len = None  # stale once a model call runs (a compaction saved before)
            try:
                answer = await self._call_llm(tools_enabled=tools_enabled, more_room=more_room)
            except LLMError as exc:
                problem = problem_of(exc)
                if isinstance(exc, AwaitingAdmission):  # held back: no error of the turn
                    self._held_for_admission(exc.held_s)
                else:
                    self._note_error(problem, str(exc), exc)
                asked = exc.retry_after_s if isinstance(exc, RateLimitedLLMError) else None
                decision = self._decide(problem, retry_after_s=asked)
                done = await self._apply(decision, problem, str(exc), asked=asked is not None)
                if done is not None:
                    return done
                continue
            self._meter(answer.usage)  # a reply thrown away below was paid for all the same
            reply = answer.message
            if answer.truncated and reply.tool_calls:  # the calls' arguments may be cut
                why = "the reply's tool call was cut by the max_tokens cap"
                self._note_error(Problem.TRUNCATED, why)
                decision = self._decide(Problem.TRUNCATED)
                more_room = decision.more_room
                done = await self._apply(decision, Problem.TRUNCATED, why)
                if done is not None:
                    return done
                continue
            if not reply.text and not reply.tool_calls:
                done = await self._apply(
                    self._decide(Problem.EMPTY_REPLY), Problem.EMPTY_REPLY, "an empty reply"
                )
                if done is not None:
                    return done
                continue
            size, cap = reply_bytes(reply), self.settings.max_reply_bytes
            if size > cap:  # never kept: the record and its next saves stay within bounds
                why = f"it was {size:,} bytes, over the limit of {cap:,} bytes for one reply"
                self._note_error(Problem.OVERSIZED_REPLY, why)
                problem = Problem.OVERSIZED_REPLY
                done = await self._apply(self._decide(problem), problem, why)
                if done is not None:
                    return done
                continue
            self._counters = self._counters.model_copy(
                update={
                    "retry_attempts": 0,
                    "cut_retries": 0,
                    "rate_limit_waits": 0,
                    "rate_limit_waited_ms": 0,
                }
            )
            return answer

    def _decide(
        self, problem: Problem, *, loop_stop: bool = False, retry_after_s: float | None = None
    ) -> Decision:
        c = self._counters
        return decide_recovery(
            Situation(
                problem=problem,
                reactive_compacted=c.reactive_compacted,
                retry_attempts=c.retry_attempts,
                loop_stop=loop_stop,
                nudges=c.nudges,
                cut_retries=c.cut_retries,
                retry_after_s=retry_after_s,
                rate_limit_waits=c.rate_limit_waits,
                rate_limit_waited_s=c.rate_limit_waited_ms / 1000,
                rate_limit_max_wait_s=self.settings.rate_limit_max_wait_s,
                jitter=random.random(),
            )
        )

    async def _apply(
        self, decision: Decision, problem: Problem, detail: str, *, asked: bool = False
    ) -> TurnOutcome | None:
        """Carry out a recovery decision; returns the outcome when the turn ended. ``detail``
        (the error, the skipped call) goes to the log and to watchers; ``asked``: the endpoint
        named the wait itself (kept as asked, not scaled)."""
        action = decision.action
        if action is Action.WAIT:
            await self._wait_rate_limit(decision, problem, detail, asked=asked)
            return None
        if action is Action.RETRY:
            await self._retry(decision, problem, detail)
            return None
        if action is Action.COMPACT:
            return await self._compact_reactively(problem, detail)
        if action is Action.NUDGE:
            self._nudge(problem, detail)
            return None
        if action is Action.FORCE_STOP:
            log.info("turn %s: %s; stopping the turn: %s", self.turn_id, problem.value, detail)
            self._recovering(problem, action, detail)
            return await self._force_stop(checkpoint_first=True)
        log.warning("turn %s: aborted (%s): %s", self.turn_id, decision.cause.value, detail)
        self._recovering(problem, action, detail)
        return await self._finish(Outcome.aborted_by(decision.cause))

    def _held_for_admission(self, held_s: float) -> None:
        """Count the time a model worker already held the call for the cluster's limiter
        against the call's rate-limit cap, as if the loop had waited it here."""
        if held_s > 0:
            c = self._counters
            self._counters = c.model_copy(
                update={"rate_limit_waited_ms": c.rate_limit_waited_ms + int(held_s * 1000)}
            )

    async def _wait_rate_limit(
        self, decision: Decision, problem: Problem, detail: str, *, asked: bool
    ) -> None:
        """Wait in ``retrying_llm`` as long as the endpoint's rate limit asks (or a backoff),
        counted against the call's cap, no attempt spent."""
        c = self._counters
        wait = decision.backoff_s * (1.0 if asked else self.settings.backoff_scale)
        how = "as asked" if asked else "backing off"
        note = f"waiting {wait:.1f} s for the endpoint's rate limit ({how})"
        self._counters = c.model_copy(
            update={
                "rate_limit_waits": c.rate_limit_waits + 1,
                "rate_limit_waited_ms": c.rate_limit_waited_ms + int(wait * 1000),
            }
        )
        log.info("turn %s: %s: %s", self.turn_id, note, detail)
        self._recovering(problem, decision.action, f"{note}: {detail}")
        await self._in_retrying_llm(wait)

    async def _retry(self, decision: Decision, problem: Problem, detail: str) -> None:
        """Back off in ``retrying_llm`` (or ask again at once with more room for a cut call),
        one attempt spent."""
        c = self._counters
        wait = decision.backoff_s * self.settings.backoff_scale
        if decision.more_room:
            note = "asking again with twice the max_tokens"
            self._counters = c.model_copy(update={"cut_retries": c.cut_retries + 1})
        else:
            note = f"retry {c.retry_attempts + 1} of {MAX_RETRIES} in {wait:.1f} s"
            self._counters = c.model_copy(update={"retry_attempts": c.retry_attempts + 1})
        log.info("turn %s: %s (%s): %s", self.turn_id, problem.value, note, detail)
        self._recovering(problem, decision.action, f"{note}: {detail}")
        await self._in_retrying_llm(wait)

    async def _in_retrying_llm(self, wait: float) -> None:
        t = self.tracker
        back = t.phase  # awaiting_llm, or force_stop for the wrap-up call
        t.to(P.RETRYING_LLM)
        self._dirty = True
        await self._pause(wait)
        t.to(back)

    async def _compact_reactively(self, problem: Problem, detail: str) -> TurnOutcome | None:
        """Compact after the endpoint said the transcript does not fit, then checkpoint (a
        durable boundary); None to call again, the outcome if nothing could be dropped."""
        t = self.tracker
        back = t.phase
        log.info("turn %s: %s; compacting: %s", self.turn_id, problem.value, detail)
        self._recovering(problem, Action.COMPACT, detail)
        t.to(P.COMPACTING)
        shrunk = compact(self._turn, self._meta, at_ms=self._now_ms(), message_id=new_id())
        if shrunk is None:
            return await self._finish(Outcome.ABORTED_CONTEXT_LENGTH)
        self._turn, self._meta = shrunk
        self._rewritten = True
        self._counters = self._counters.model_copy(update={"reactive_compacted": True})
        self._dirty = True
        # a resume from a wrap-up's compaction wraps up again
        reason = SaveReason.FORCE_STOP if back is P.FORCE_STOP else SaveReason.COMPACTION
        await self._checkpoint(reason, force=True)  # a journaled reply extends a saved one
        t.to(back)
        return None

    def _nudge(self, problem: Problem, detail: str) -> None:
        """Tell the model what was wrong, as a system-injected user message."""
        text = nudge_text(problem, detail)
        log.info("turn %s: %s; nudging the model: %s", self.turn_id, problem.value, detail)
        self._recovering(problem, Action.NUDGE, f"{detail}; told the model: {text}")
        self.tracker.to(P.INJECTING_MESSAGE)
        self._append(Message(role="user", text=text), "system", injected=True)
        self._counters = self._counters.model_copy(update={"nudges": self._counters.nudges + 1})
        self.tracker.restore()

    def _recovering(self, problem: Problem, action: Action, detail: str) -> None:
        self._emit(
            Recovering(
                self.turn_id,
                self.epoch,
                problem,
                action,
                detail[:LIVE_TEXT_LIMIT],
                self._now_ms(),
            )
        )

    async def _force_stop(self, *, checkpoint_first: bool) -> TurnOutcome:
        if checkpoint_first:
            await self._checkpoint(SaveReason.FORCE_STOP)
        self.tracker.to(P.FORCE_STOP)
        self._tell_lost_reply()  # a wrap-up resumed after a refused journal
        spent = bool(self._budget_spent())  # why it stops
        answer = await self._ask(tools_enabled=False)
        if isinstance(answer, TurnOutcome):
            return answer
        self._append(answer.message, "llm", usage=answer.usage)
        return await self._finish(Outcome.BUDGET_EXHAUSTED if spent else Outcome.FORCE_STOPPED)

    def _budget_spent(self) -> str:
        """Which of the agent's token budgets the turn has reached ("" for none)."""
        used = self._counters.tokens.total
        per_turn = self.settings.max_tokens_per_turn
        per_session = self.settings.max_tokens_per_session
        if per_turn is not None and used >= per_turn:
            return f"the turn's budget of {per_turn:,} tokens"
        if per_session is not None and self._counters.session_prior.total + used >= per_session:
            return f"the session's budget of {per_session:,} tokens"
        return ""

    async def _finish_cancelled(self) -> TurnOutcome:
        if not self._cancel_reason:  # told by the host: the request's reason and its place
            self._inbox_len = None  # are in the inbox, which may have taken it after the last
            await self._drain_inbox()  # save answered its length: read it all the same
        reason = self._cancel_reason or "cancelled"
        log.info("turn %s cancelled: %s", self.turn_id, reason)
        self._counters = self._counters.model_copy(update={"cancel_reason": reason})
        return await self._finish(Outcome.CANCELLED)

    async def _finish(self, outcome: Outcome) -> TurnOutcome:
        self.tracker.to(P.DONE)
        self._counters = self._counters.model_copy(update={"outcome": outcome})
        self._dirty = True
        await self._checkpoint(SaveReason.FINAL, final=True)
        return self._outcome(outcome)

    async def _end_oversized(self, outcome: Outcome) -> TurnOutcome:
        """End the turn on its last stored checkpoint: the transcript grew past what a record
        may hold (or holds what cannot be encoded), so nothing since that checkpoint can be
        kept."""
        self._turn = list(self._saved.messages[self._saved.baseline :])
        self._meta = list(self._saved.meta[self._saved.baseline :])
        self._rewritten = True
        self._counters = self._saved.counters.model_copy(update={"outcome": outcome})
        if self.tracker.phase is not P.DONE:
            self.tracker.to(P.DONE)
        self._dirty = True
        try:
            await self._checkpoint(SaveReason.FINAL, final=True)
        except Fenced:
            return self._outcome(RunStop.FENCED)
        except TooLarge:  # even the last checkpoint is over the cap now (it was lowered)
            return self.interrupted()
        return self._outcome(outcome)

    # -- model, tools, inbox ------------------------------------------------------------------

    async def _compact_if_large(self) -> None:
        """The agent's proactive compaction: a checkpoint site like the reactive one."""
        limit = self.settings.compact_at_chars
        if limit is None or size_chars(self.messages) < limit:
            return
        shrunk = compact(self._turn, self._meta, at_ms=self._now_ms(), message_id=new_id())
        if shrunk is None:
            return  # nothing left to drop: the model gets the transcript as it is
        self.tracker.to(P.COMPACTING)
        self._turn, self._meta = shrunk
        self._rewritten = True
        self._dirty = True
        await self._checkpoint(SaveReason.COMPACTION, force=True)  # as the reactive one
        self.tracker.to(P.AWAITING_LLM)

    async def _drain_inbox(self) -> None:
        offset = self._counters.inbox_offset
        told, self._inbox_len = self._inbox_len, None
        if told is not None and told <= offset:
            return  # the save just before this boundary saw nothing new in the inbox
        try:
            items = await self.deps.inbox.read_from(self.turn_id, offset)
        except StoreError as exc:
            log.warning(
                "turn %s: inbox unreadable, will retry at next boundary: %s", self.turn_id, exc
            )
            return
        if not items:
            return
        cancel = next((i for i, item in enumerate(items) if item.cancel), None)
        if cancel is not None:  # the turn ends here: what came after it stays unread
            self._cancel_reason = items[cancel].text or "cancelled"
            if items[cancel].by:
                self._cancel_reason += f" (by {items[cancel].by})"
            self._cancel.set()
            items = items[:cancel]
            offset += 1  # the cancel entry itself is consumed
        self._counters = self._counters.model_copy(update={"inbox_offset": offset + len(items)})
        seen = {m.message_id for m in self._meta}
        fresh = []
        for item in items:  # a push resent by a client retry is the same message: once only
            if item.message_id not in seen:
                seen.add(item.message_id)
                fresh.append(item)
        if not fresh:
            return
        self.tracker.to(P.INJECTING_MESSAGE)
        for item in fresh:
            self._append(
                Message(role="user", text=item.text),
                "inbox",
                message_id=item.message_id,
                at_ms=item.at_ms,
            )
        self.tracker.restore()

    # -- durable state ------------------------------------------------------------------------
