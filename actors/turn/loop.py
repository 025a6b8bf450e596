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

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from actors.turn.compaction import compact, size_chars
from actors.turn.llm import LLMClient, LLMReply, LLMRequest
from actors.turn.loopdetect import LoopThresholds, LoopVerdict, detect_loop
from actors.turn.poison import step_name
from actors.turn.recovery import MAX_RETRIES, Decision, Situation, decide_recovery, nudge_text
from actors.turn.tools import ToolRegistry, ToolSpec
from bus.errors import (
    AwaitingAdmission,
    ContextLengthError,
    HardIdleTimeout,
    LLMError,
    RateLimitedLLMError,
    RecordTooLarge,
    RetryableLLMError,
    StaleOwner,
    StoreError,
    UnstorableRecord,
)
from bus.events import (
    LIVE_TEXT_LIMIT,
    LiveEvent,
    Recovering,
    Restarted,
    TextDelta,
    ToolCalled,
    ToolReturned,
)
from bus.messages import Message, Source, ToolCall, ToolResult, Usage
from bus.outcomes import Action, Outcome, Problem, SaveReason
from bus.phase import Listener, PhaseTracker, TurnPhase
from store.records import Approval, CheckpointRecord, InboxItem, MessageMeta, SaveAck, TurnError

log = logging.getLogger(__name__)
P = TurnPhase


class Checkpointer(Protocol):
    async def save(self, record: CheckpointRecord) -> SaveAck: ...


class InboxReader(Protocol):
    async def read_from(self, turn_id: str, offset: int) -> list[InboxItem]: ...


class ApprovalDesk(Protocol):
    async def request(
        self, turn_id: str, call_key: str, *, tool: str = "", args: str = ""
    ) -> None: ...
    async def decide(
        self, turn_id: str, call_key: str, approve: bool, *, by: str = "", reason: str = ""
    ) -> bool: ...
    async def decision(self, turn_id: str, call_key: str) -> Approval | None: ...


class ToolBatches(Protocol):
    def keys_for(self, turn_id: str, batch: int, calls: Sequence[ToolCall]) -> list[str]: ...
    async def run_batch(
        self,
        turn_id: str,
        epoch: int,
        batch: int,
        calls: Sequence[ToolCall],
        denied: Mapping[int, str] | None = ...,
    ) -> list[ToolResult]:
        """Run a batch under the ledger; :class:`StaleOwner` when ``epoch`` is fenced."""
        ...


class ProbationHooks(Protocol):
    """What a probation run (a turn isolated by the poison-turn policy) reports."""

    async def step(self, step: str) -> None:
        """Durably note the step about to begin (``phase@position``), before it begins: if the
        process dies inside it, the next isolation host reads where."""
        ...

    @property
    def releases(self) -> bool:
        """Still on probation: the run stops (``released``) after its next checkpoint."""
        ...


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Knobs of the loop; defaults are the production values of DESIGN §3-4."""

    strict: bool = False
    """Illegal phase transitions raise (tests) instead of being logged and counted."""
    checkpoint_min_interval_s: float = 2.0
    """Minimum seconds between mid-turn saves (0 in tests); never delays the final save."""
    checkpoint_mid_turn: bool = True
    """False skips every mid-turn save (only the final one is written): what ``phaseline
    bench`` compares against to price durability. Never off in production."""
    approval_timeout_s: float = 300.0
    """Cap on ``awaiting_approval``; the call is denied past it."""
    approval_poll_s: float = 0.2
    """How often a pending approval is re-read from Redis."""
    backoff_scale: float = 1.0
    """Multiplier of the 1 s / 2 s / 4 s retry backoff and of a rate-limit backoff the endpoint
    did not name (tests shrink it); a wait the endpoint asked for is kept as asked."""
    rate_limit_max_wait_s: float = 600.0
    """Cap on the seconds one model call waits on the endpoint's rate limit; past it the turn
    aborts ``rate_limited``."""
    loop_thresholds: LoopThresholds = field(default_factory=LoopThresholds)
    """When the loop detector suspects and stops."""
    max_tool_rounds: int | None = None
    """Tool rounds a turn may run; past it the turn wraps up in ``force_stop`` (the agent's
    limit)."""
    compact_at_chars: int | None = None
    """Compact before a model call once the transcript holds this many characters."""
    max_tokens_per_turn: int | None = None
    """The agent's token budget per turn; past it the turn wraps up (``budget_exhausted``)."""
    max_tokens_per_session: int | None = None
    """The agent's token budget per session (this turn's and its earlier turns' tokens); past
    it the turn wraps up the same way."""
    max_reply_bytes: int = 1 << 20
    """Cap on one model reply (its text and tool calls' arguments, UTF-8 bytes): a larger one
    is not kept; the model is told its size and the cap (a nudge), and asked again."""


@dataclass(frozen=True, slots=True)
class TurnDeps:
    """What a loop talks to; every member is an interface, so tests and engines swap them."""

    llm: LLMClient
    """The model."""
    tools: ToolBatches
    """Runs a tool batch under the ledger."""
    registry: ToolRegistry
    """Tool specs (approval flags)."""
    checkpoints: Checkpointer
    """Durable saves (the store, or a CheckpointActor client)."""
    inbox: InboxReader
    """Injected user messages."""
    approvals: ApprovalDesk
    """Approval decisions."""
    listener: Listener | None = None
    """Receives every phase transition (bus publisher, watchdog, progress display)."""
    events: Callable[[LiveEvent], None] | None = None
    """Receives what a watcher of the turn sees besides transitions: streamed text, tool calls
    and results, the restart marker, the final answer (advisory; must not block)."""


class RunStop(StrEnum):
    """Why a run returned without an outcome of its own. Reports count these beside the
    :class:`~store.records.Outcome` values."""

    FENCED = "fenced"
    """A newer owner refused this incarnation's save or dispatch."""
    RELEASED = "released"
    """A probation run reached its first checkpoint; its slot resumes it."""
    INTERRUPTED = "interrupted"
    """Redis failed under the run; the turn is resumable from its last checkpoint."""
    ISOLATE = "isolate"
    """Not run (set by the engine): the poison-turn policy queued it for the isolation host."""
    UNUSABLE = "unusable"
    """Not run (set by the engine): its record or spec could not be read (quarantined)."""
    FINISHED = "finished"
    """Not run (set by the engine): the turn had ended already."""

    @property
    def leaves_in_progress(self) -> bool:
        """The turn's record may still be in progress after this run: someone must end it."""
        return self is not RunStop.FINISHED


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """How a run of a turn ended, as seen by the loop (or engine) that ran it."""

    turn_id: str
    """The turn."""
    outcome: Outcome | RunStop
    """How the turn ended (an :class:`Outcome`, stored in its final record), or why this run
    stopped without ending it (a :class:`RunStop`)."""
    epoch: int
    """Epoch that ran it."""
    saves: int
    """Checkpoints this loop wrote."""
    failed_saves: int
    """Saves that failed and were retried at a later site."""
    messages: int
    """Transcript length at the end."""
    error: TurnError | None = None
    """The turn's last model or tool error (the record's ``Counters.last_error``)."""

    @property
    def leaves_in_progress(self) -> bool:
        """The run may have left the turn's record in progress (someone must still end it)."""
        return isinstance(self.outcome, RunStop) and self.outcome.leaves_in_progress


class _CancelNow(Exception):
    """An operator's cancel ends the turn now (raised out of a model call or its retries)."""


class _Fenced(Exception):
    """Internal: a save was refused by fencing; unwinds the loop without further effects."""


class _TooLarge(Exception):
    """Internal: the next checkpoint cannot be stored (over the size cap, or a value no
    encoder takes); unwinds to end on the last one with ``outcome``."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome


class _Released(Exception):
    """Internal: a probation run saved its first checkpoint; unwinds with nothing in flight."""


class TurnLoop:
    """Drives one turn from a record (fresh at ``submitted``, or claimed for a resume)."""

    def __init__(
        self,
        record: CheckpointRecord,
        deps: TurnDeps,
        settings: LoopSettings = LoopSettings(),
        *,
        clock: Callable[[], float] = time.time,
        resume_from: SaveReason | None = None,
        probation: ProbationHooks | None = None,
    ) -> None:
        """``resume_from`` is the reason of the checkpoint a resumed turn restarts from;
        ``probation`` makes this a probation run: it notes each step before it begins and
        stops (:attr:`RunStop.RELEASED`) right after its first mid-turn checkpoint."""
        self.turn_id = record.turn_id
        self.session_id = record.session_id
        self.epoch = record.epoch
        self.deps = deps
        self.settings = settings
        self._clock = clock
        self._baseline = record.messages[: record.baseline]
        self._baseline_meta = record.meta[: record.baseline]
        self._turn = list(record.messages[record.baseline :])
        self._meta = list(record.meta[record.baseline :])
        self._counters = record.counters
        self._resume_from = resume_from
        self._probation = probation
        self._seq = record.seq
        self._saved = record
        """The last record known stored: what an oversized checkpoint falls back to."""
        self._dirty = False
        self._last_save: float | None = None
        self.saves = 0
        self.failed_saves = 0
        self.tracker = PhaseTracker(
            self.turn_id,
            epoch=self.epoch,
            strict=settings.strict,
            clock=clock,
            listener=deps.listener,
        )
        self._llm_task: asyncio.Task[LLMReply] | None = None
        self._hard_cancelled = False
        self._cancel = asyncio.Event()
        """Set when an operator's cancel reached this incarnation (or its inbox entry was
        read): every wait ends and the turn ends at once, ``cancelled``."""
        self._cancel_reason = ""
        self.pending_approval: str | None = None

    # -- public -------------------------------------------------------------------------------

    @property
    def messages(self) -> tuple[Message, ...]:
        return (*self._baseline, *self._turn)

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
                    self.turn_id, self.epoch, self._resume_from, len(self.messages),
                    self._now_ms(),
                )
            )  # fmt: skip
        try:
            t.to(P.SETUP)
            if self._resume_from is SaveReason.FORCE_STOP:
                return await self._force_stop(checkpoint_first=False)
            t.to(P.AWAITING_LLM)
            return await self._drive()
        except _CancelNow:
            await self._drain_inbox()  # the request's reason, and its place in the inbox
            return await self._finish_cancelled()
        except _Fenced:
            return self._outcome(RunStop.FENCED)
        except _Released:
            return self._outcome(RunStop.RELEASED)
        except _TooLarge as too_large:
            return await self._end_oversized(too_large.outcome)

    @property
    def saved(self) -> CheckpointRecord:
        """The last record this loop knows stored (its final one once the turn ended)."""
        return self._saved

    def interrupted(self) -> TurnOutcome:
        """Outcome of a loop cut short by a store failure (its turn stays resumable)."""
        return self._outcome(RunStop.INTERRUPTED)

    # -- the walk -----------------------------------------------------------------------------

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
            found = detect_loop(self._turn, reply.tool_calls, self.settings.loop_thresholds)
            if found.verdict is not LoopVerdict.OK:
                self._skip_batch(reply.tool_calls, found.reason())
                decision = self._decide(Problem.LOOP, loop_stop=found.verdict is LoopVerdict.STOP)
                done = await self._apply(decision, Problem.LOOP, found.reason())
                if done is not None:
                    return done
                continue
            self.tracker.to(P.EXECUTING_TOOLS)
            await self._run_batch(reply.tool_calls)
            await self._checkpoint(SaveReason.TOOL_BATCH)
            self.tracker.to(P.AWAITING_LLM)

    async def _ask(self, *, tools_enabled: bool) -> LLMReply | TurnOutcome:
        """One model call under the recovery policy, whichever call it is (the force stop's
        wrap-up too): retried, compacted or nudged as :func:`decide_recovery` says. Returns a
        usable reply, or the outcome when the policy ended the turn."""
        more_room = False
        while True:
            if self._cancel.is_set():
                raise _CancelNow
            try:
                answer = await self._call_llm(tools_enabled=tools_enabled, more_room=more_room)
            except LLMError as exc:
                problem = _problem_of(exc)
                if not isinstance(exc, AwaitingAdmission):  # held back here: no error
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
                    "retry_attempts": 0, "cut_retries": 0,
                    "rate_limit_waits": 0, "rate_limit_waited_ms": 0,
                }
            )  # fmt: skip
            return answer

    def _meter(self, usage: Usage | None) -> None:
        """Count a reply's tokens (or that its endpoint reported none) as it arrives."""
        c = self._counters
        self._counters = c.model_copy(
            update={
                "tokens": c.tokens if usage is None else c.tokens.plus(usage),
                "unmetered_calls": c.unmetered_calls + (usage is None),
            }
        )

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

    def _note_error(self, problem: Problem, message: str, exc: LLMError | None = None) -> None:
        """Keep a model error in the record: what ``inspect``, ``watch`` and a run's summary
        show for a turn that did not answer."""
        self._counters = self._counters.model_copy(
            update={
                "last_error": TurnError(
                    source="model",
                    kind=problem.value,
                    message=message[:500],
                    status=None if exc is None else exc.status,
                    code=None if exc is None else exc.code,
                    request_id=None if exc is None else exc.request_id,
                    attempt=self._counters.retry_attempts,
                    at_ms=self._now_ms(),
                )
            }
        )
        self._dirty = True

    async def _apply(
        self, decision: Decision, problem: Problem, detail: str, *, asked: bool = False
    ) -> TurnOutcome | None:
        """Carry out a recovery decision; returns the outcome when the turn ended. ``detail``
        (the error, the skipped call) goes to the log and to watchers; ``asked``: the endpoint
        named the wait itself (kept as asked, not scaled)."""
        t = self.tracker
        c = self._counters
        back = t.phase  # awaiting_llm, or force_stop for the wrap-up call
        action = decision.action
        if action is Action.WAIT:
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
            self._recovering(problem, action, f"{note}: {detail}")
            t.to(P.RETRYING_LLM)
            self._dirty = True
            await self._pause(wait)
            t.to(back)
            return None
        if action is Action.RETRY:
            wait = decision.backoff_s * self.settings.backoff_scale
            if decision.more_room:
                note = "asking again with twice the max_tokens"
                self._counters = c.model_copy(update={"cut_retries": c.cut_retries + 1})
            else:
                note = f"retry {c.retry_attempts + 1} of {MAX_RETRIES} in {wait:.1f} s"
                self._counters = c.model_copy(update={"retry_attempts": c.retry_attempts + 1})
            log.info("turn %s: %s (%s): %s", self.turn_id, problem.value, note, detail)
            self._recovering(problem, action, f"{note}: {detail}")
            t.to(P.RETRYING_LLM)
            self._dirty = True
            await self._pause(wait)
            t.to(back)
            return None
        if action is Action.COMPACT:
            log.info("turn %s: %s; compacting: %s", self.turn_id, problem.value, detail)
            self._recovering(problem, action, detail)
            t.to(P.COMPACTING)
            shrunk = compact(self._turn, self._meta, at_ms=self._now_ms(), message_id=_new_id())
            if shrunk is None:
                return await self._finish(Outcome.ABORTED_CONTEXT_LENGTH)
            self._turn, self._meta = shrunk
            self._counters = c.model_copy(update={"reactive_compacted": True})
            self._dirty = True
            # a resume from a wrap-up's compaction wraps up again
            reason = SaveReason.FORCE_STOP if back is P.FORCE_STOP else SaveReason.COMPACTION
            await self._checkpoint(reason)
            t.to(back)
            return None
        if action is Action.NUDGE:
            text = nudge_text(problem, detail)
            log.info("turn %s: %s; nudging the model: %s", self.turn_id, problem.value, detail)
            self._recovering(problem, action, f"{detail}; told the model: {text}")
            t.to(P.INJECTING_MESSAGE)
            self._append(Message(role="user", text=text), "system", injected=True)
            self._counters = self._counters.model_copy(update={"nudges": c.nudges + 1})
            t.restore()
            return None
        if action is Action.FORCE_STOP:
            log.info("turn %s: %s; stopping the turn: %s", self.turn_id, problem.value, detail)
            self._recovering(problem, action, detail)
            return await self._force_stop(checkpoint_first=True)
        log.warning("turn %s: aborted (%s): %s", self.turn_id, decision.cause.value, detail)
        self._recovering(problem, action, detail)
        return await self._finish(Outcome.aborted_by(decision.cause))

    def _recovering(self, problem: Problem, action: Action, detail: str) -> None:
        self._emit(
            Recovering(
                self.turn_id, self.epoch, problem, action, detail[:LIVE_TEXT_LIMIT],
                self._now_ms(),
            )
        )  # fmt: skip

    async def _force_stop(self, *, checkpoint_first: bool) -> TurnOutcome:
        if checkpoint_first:
            await self._checkpoint(SaveReason.FORCE_STOP)
        self.tracker.to(P.FORCE_STOP)
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

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the turn is cancelled meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._cancel.wait(), seconds)

    async def _finish_cancelled(self) -> TurnOutcome:
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

    def _fenced(self, exc: StaleOwner) -> _Fenced:
        """What unwinds this incarnation when a newer owner refused its save or dispatch."""
        log.warning("turn %s: %s; stopping this incarnation", self.turn_id, exc)
        return _Fenced()

    async def _end_oversized(self, outcome: Outcome) -> TurnOutcome:
        """End the turn on its last stored checkpoint: the transcript grew past what a record
        may hold (or holds what cannot be encoded), so nothing since that checkpoint can be
        kept."""
        self._turn = list(self._saved.messages[self._saved.baseline :])
        self._meta = list(self._saved.meta[self._saved.baseline :])
        self._counters = self._saved.counters.model_copy(update={"outcome": outcome})
        if self.tracker.phase is not P.DONE:
            self.tracker.to(P.DONE)
        self._dirty = True
        try:
            await self._checkpoint(SaveReason.FINAL, final=True)
        except _Fenced:
            return self._outcome(RunStop.FENCED)
        except _TooLarge:  # even the last checkpoint is over the cap now (it was lowered)
            return self.interrupted()
        return self._outcome(outcome)

    def _outcome(self, outcome: Outcome | RunStop) -> TurnOutcome:
        return TurnOutcome(
            self.turn_id, outcome, self.epoch, self.saves, self.failed_saves, len(self.messages),
            self._counters.last_error,
        )  # fmt: skip

    # -- model, tools, inbox ------------------------------------------------------------------

    async def _note_step(self) -> None:
        if self._probation is None:
            return
        try:
            await self._probation.step(step_name(self.tracker.phase.value, len(self.messages)))
        except StaleOwner as exc:
            raise self._fenced(exc) from exc

    async def _compact_if_large(self) -> None:
        """The agent's proactive compaction: a checkpoint site like the reactive one."""
        limit = self.settings.compact_at_chars
        if limit is None or size_chars(self.messages) < limit:
            return
        shrunk = compact(self._turn, self._meta, at_ms=self._now_ms(), message_id=_new_id())
        if shrunk is None:
            return  # nothing left to drop: the model gets the transcript as it is
        self.tracker.to(P.COMPACTING)
        self._turn, self._meta = shrunk
        self._dirty = True
        await self._checkpoint(SaveReason.COMPACTION)
        self.tracker.to(P.AWAITING_LLM)

    async def _call_llm(self, *, tools_enabled: bool, more_room: bool = False) -> LLMReply:
        await self._note_step()
        streamed = False

        def on_text(piece: str) -> None:
            nonlocal streamed
            streamed = True
            self._emit(TextDelta(self.turn_id, self.epoch, piece, self._now_ms()))

        request = LLMRequest(
            turn_id=self.turn_id,
            messages=self.messages,
            tools_enabled=tools_enabled,
            attempt=self._counters.retry_attempts,
            tools=tuple(self.deps.registry),
            more_room=more_room,
            on_text=on_text if self.deps.events is not None else None,
        )
        self._hard_cancelled = False
        task = asyncio.ensure_future(self.deps.llm.complete(request))
        self._llm_task = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._llm_task = None
        if task.cancelled():
            if self._cancel.is_set():
                raise _CancelNow
            if self._hard_cancelled:
                raise HardIdleTimeout("model call cancelled by the watchdog's hard idle timeout")
            raise asyncio.CancelledError()
        reply = task.result()
        if not streamed and reply.message.text:  # a model that does not stream: all at once
            on_text(reply.message.text)
        return reply

    async def _run_batch(self, calls: Sequence[ToolCall]) -> None:
        await self._note_step()
        batch = self._counters.tool_batches
        keys = self.deps.tools.keys_for(self.turn_id, batch, calls)
        if self.deps.events is not None:
            now = self._now_ms()
            for call in calls:
                args = call.arguments_json()[:LIVE_TEXT_LIMIT]
                self._emit(ToolCalled(self.turn_id, self.epoch, call.id, call.name, args, now))
        denied: dict[int, str] = {}
        decisions: dict[int, Approval] = {}
        for i, (key, call) in enumerate(zip(keys, calls, strict=True)):
            spec = self.deps.registry.get(call.name) if call.name in self.deps.registry else None
            if spec is not None and spec.requires_approval:
                decisions[i] = decided = await self._await_approval(key, call, spec)
                if decided.state != "approve":
                    denied[i] = decided.note()
        try:
            results = await self.deps.tools.run_batch(
                self.turn_id, self.epoch, batch, calls, denied
            )
        except StaleOwner as exc:
            raise self._fenced(exc) from exc
        for i, res in enumerate(results):
            self._append(Message(role="tool", tool_result=res), "tool", approval=decisions.get(i))
            self._returned(res)
            if res.status in _TOOL_FAILURES:
                self._counters = self._counters.model_copy(
                    update={
                        "last_error": TurnError(
                            source="tool", kind=res.status, tool=res.name,
                            message=res.output[:500], at_ms=self._now_ms(),
                        )
                    }
                )  # fmt: skip
        self._counters = self._counters.model_copy(update={"tool_batches": batch + 1})

    def _returned(self, res: ToolResult) -> None:
        self._emit(
            ToolReturned(
                self.turn_id, self.epoch, res.call_id, res.name, res.status,
                res.output[:LIVE_TEXT_LIMIT], self._now_ms(),
            )
        )  # fmt: skip

    async def _await_approval(self, key: str, call: ToolCall, spec: ToolSpec) -> Approval:
        """Wait in the ``awaiting_approval`` transient for the call's decision; past its cap
        (the tool's ``approval_timeout_s``, else the loop's) the tool's ``on_timeout`` decides,
        recorded as decided by ``timeout``. A cancel of the turn denies it."""
        desk = self.deps.approvals
        decided = await desk.decision(self.turn_id, key)
        if decided is not None:
            return decided
        self.tracker.to(P.AWAITING_APPROVAL)
        self.pending_approval = key
        try:
            await desk.request(self.turn_id, key, tool=call.name, args=call.arguments_json())
            cap = spec.approval_timeout_s or self.settings.approval_timeout_s
            deadline = time.monotonic() + cap
            while (decided := await desk.decision(self.turn_id, key)) is None:
                if self._cancel.is_set():
                    decided = Approval(state="deny", by="cancel", reason="the turn was cancelled")
                    break
                if time.monotonic() >= deadline:
                    approve = spec.on_timeout == "approve"
                    why = f"no decision within {cap:g} s"
                    await desk.decide(self.turn_id, key, approve, by="timeout", reason=why)
                    # the first decision wins: a person's just before the cap stands
                    decided = await desk.decision(self.turn_id, key) or Approval(
                        state="approve" if approve else "deny", by="timeout", reason=why
                    )
                    break
                await self._pause(self.settings.approval_poll_s)  # polling Redis, with deadline
        finally:
            self.pending_approval = None
        self.tracker.restore()
        return decided

    def _skip_batch(self, calls: Sequence[ToolCall], why: str) -> None:
        """Answer a batch without running it, keeping the transcript well-formed; a watcher
        sees each call and why it was not run."""
        for call in calls:
            res = ToolResult(
                call_id=call.id, name=call.name, status="skipped", output=f"not run: {why}"
            )
            self._append(Message(role="tool", tool_result=res), "tool")
            self._emit(
                ToolCalled(
                    self.turn_id, self.epoch, call.id, call.name,
                    call.arguments_json()[:LIVE_TEXT_LIMIT], self._now_ms(),
                )
            )  # fmt: skip
            self._returned(res)

    async def _drain_inbox(self) -> None:
        offset = self._counters.inbox_offset
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

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _append(
        self,
        message: Message,
        source: Source,
        *,
        injected: bool = False,
        message_id: str | None = None,
        at_ms: int | None = None,
        usage: Usage | None = None,
        approval: Approval | None = None,
    ) -> None:
        self._turn.append(message)
        self._meta.append(
            MessageMeta(
                source=source,
                message_id=message_id or _new_id(),
                at_ms=self._now_ms() if at_ms is None else at_ms,
                system_injected=injected,
                usage=usage,
                approval=approval,
            )
        )
        self._dirty = True

    def snapshot(self, reason: SaveReason, *, in_progress: bool) -> CheckpointRecord:
        """The whole record, rebuilt from the canonical list on top of the baseline."""
        self._seq += 1
        return CheckpointRecord(
            turn_id=self.turn_id,
            session_id=self.session_id,
            agent=self._saved.agent,
            epoch=self.epoch,
            seq=self._seq,
            phase=self.tracker.phase,
            in_progress=in_progress,
            reason=reason,
            messages=(*self._baseline, *self._turn),
            meta=(*self._baseline_meta, *self._meta),
            baseline=len(self._baseline),
            counters=self._counters,
            updated_at=self._now_ms(),
        )

    async def _checkpoint(self, reason: SaveReason, *, final: bool = False) -> None:
        if not self._dirty or not (final or self.settings.checkpoint_mid_turn):
            return
        now = self._clock()
        interval = self.settings.checkpoint_min_interval_s
        if not final and self._last_save is not None and now - self._last_save < interval:
            return  # debounced: stays dirty, the next site saves it
        record = self.snapshot(reason, in_progress=not final)
        try:
            await self.deps.checkpoints.save(record)
        except StaleOwner as exc:
            raise self._fenced(exc) from exc
        except RecordTooLarge as exc:
            log.error("turn %s: %s; ending it on its last checkpoint", self.turn_id, exc)
            raise _TooLarge(Outcome.ABORTED_RECORD_TOO_LARGE) from exc
        except UnstorableRecord as exc:
            log.error("turn %s: %s; ending it on its last checkpoint", self.turn_id, exc)
            raise _TooLarge(Outcome.ABORTED_UNSTORABLE) from exc
        except StoreError as exc:
            self.failed_saves += 1
            if final:
                raise
            log.warning(
                "turn %s: %s save failed, retried at next site: %s", self.turn_id, reason, exc
            )
            return
        self._dirty = False
        self._last_save = now
        self._saved = record
        self.saves += 1
        if final:
            self._emit(record.finished_event())
        if self._probation is not None and self._probation.releases and not final:
            raise _Released()

    def _emit(self, event: LiveEvent) -> None:
        if self.deps.events is not None:
            self.deps.events(event)


def reply_bytes(reply: Message) -> int:
    """A model reply's size as the cap counts it: its text and its calls' arguments, UTF-8
    (a lone surrogate counted as the three bytes it would take)."""
    parts = [reply.text or "", *(c.arguments_json() for c in reply.tool_calls)]
    return sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)


#: Tool result statuses kept as the turn's last error.
_TOOL_FAILURES = frozenset({"error", "timeout", "outcome_unknown"})


def _new_id() -> str:
    return uuid.uuid4().hex


def _problem_of(exc: LLMError) -> Problem:
    if isinstance(exc, HardIdleTimeout):
        return Problem.HARD_IDLE_TIMEOUT
    if isinstance(exc, ContextLengthError):
        return Problem.CONTEXT_LENGTH
    if isinstance(exc, RateLimitedLLMError):
        return Problem.RATE_LIMITED
    if isinstance(exc, RetryableLLMError):
        return Problem.RETRYABLE
    return Problem.FATAL  # FatalLLMError and any other LLMError
