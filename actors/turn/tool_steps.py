"""A turn loop's tool batches: each call announced, approvals waited for, the batch run
under the ledger (:class:`~actors.turn.deps.ToolBatches`), results appended and published, a
failed call kept as the turn's last error; and a batch answered without running it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from actors.turn.loop_state import LoopState
from actors.turn.tools import ToolSpec
from bus.errors import RecordTooLarge, StaleOwner, UnstorableRecord
from bus.events import LIVE_TEXT_LIMIT, ToolCalled, ToolReturned
from bus.messages import Message, ToolCall, ToolResult
from bus.phase import TurnPhase
from store.records import Approval, Settle, TurnError

log = logging.getLogger(__name__)
P = TurnPhase


_T = TypeVar("_T")

#: Tool result statuses kept as the turn's last error.
TOOL_FAILURES = frozenset({"error", "timeout", "outcome_unknown"})


class ToolSteps(LoopState):
    """The tool side of a turn loop."""

    async def _run_batch(self, calls: Sequence[ToolCall]) -> tuple[Settle, ...]:
        """Run the batch the last message (the model's reply) asks for; the outcomes it left
        for the checkpoint after it to carry. The reply is durable before any of its calls is
        dispatched or its approval asked: journaled with the batch's claim, or on its own first
        when an approval question comes before it."""
        await self._note_step()
        batch = self._counters.tool_batches
        keys = self.deps.tools.keys_for(self.turn_id, batch, calls)
        journal = self._journal_of(batch)
        needs_approval = any(
            call.name in self.deps.registry and self.deps.registry.get(call.name).requires_approval
            for call in calls
        )
        if journal is not None and needs_approval:
            await self._journaled(self.deps.tools.journal(self.turn_id, self.epoch, journal))
            journal = None
        if self.deps.events is not None:
            now = self._now_ms()
            for key, call in zip(keys, calls, strict=True):
                args = call.arguments_json()[:LIVE_TEXT_LIMIT]
                spec = (
                    self.deps.registry.get(call.name) if call.name in self.deps.registry else None
                )
                self._emit(
                    ToolCalled(
                        self.turn_id,
                        self.epoch,
                        call.id,
                        call.name,
                        args,
                        now,
                        key,
                        spec is not None and spec.idempotent,
                    )
                )
        denied: dict[int, str] = {}
        decisions: dict[int, Approval] = {}
        for i, (key, call) in enumerate(zip(keys, calls, strict=True)):
            spec = self.deps.registry.get(call.name) if call.name in self.deps.registry else None
            if spec is not None and spec.requires_approval:
                decisions[i] = decided = await self._await_approval(key, call, spec)
                if decided.state != "approve":
                    denied[i] = decided.note()
        # The outcomes of the calls that end the batch ride on the checkpoint after it (when
        # there is one): one round trip less per tool round.
        run = await self._journaled(
            self.deps.tools.run_batch(
                self.turn_id,
                self.epoch,
                batch,
                calls,
                denied,
                keys=keys,
                defer=self.settings.checkpoint_mid_turn,
                reply=journal,
            )
        )
        for i, res in enumerate(run.results):
            self._append(
                Message(role="tool", tool_result=res),
                "tool",
                approval=decisions.get(i),
                call_key=keys[i],
            )
            self._returned(res)
            if res.status in TOOL_FAILURES:
                self._counters = self._counters.model_copy(
                    update={
                        "last_error": TurnError(
                            source="tool",
                            kind=res.status,
                            tool=res.name,
                            message=res.output[:500],
                            at_ms=self._now_ms(),
                        )
                    }
                )
        self._counters = self._counters.model_copy(update={"tool_batches": batch + 1})
        return run.settles

    async def _journaled(self, write: Awaitable[_T]) -> _T:
        """A write that journals the reply: a fenced owner unwinds; a reply that cannot be
        journaled (over the record cap, a value no encoder takes) ends the turn on its last
        checkpoint before any of its calls ran, as its next checkpoint could not be stored
        either."""
        try:
            return await write
        except StaleOwner as exc:
            raise self._fenced(exc) from exc
        except (RecordTooLarge, UnstorableRecord) as exc:
            raise self._too_large(exc) from exc

    def _returned(self, res: ToolResult) -> None:
        self._emit(
            ToolReturned(
                self.turn_id,
                self.epoch,
                res.call_id,
                res.name,
                res.status,
                res.output[:LIVE_TEXT_LIMIT],
                self._now_ms(),
            )
        )

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
                    self.turn_id,
                    self.epoch,
                    call.id,
                    call.name,
                    call.arguments_json()[:LIVE_TEXT_LIMIT],
                    self._now_ms(),
                )
            )
            self._returned(res)
