"""The state a turn loop keeps, and how it is saved: the canonical transcript (baseline plus
the turn's own messages and their meta), the counters, the dirty flag and the fenced
checkpoint at each durable boundary (DESIGN §3). :class:`~actors.turn.loop.TurnLoop` walks
the phases on top of it; the internal signals below unwind that walk."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from actors.turn.deps import ProbationHooks, TurnDeps
from actors.turn.llm import LLMReply
from actors.turn.loopdetect import CallHistory
from actors.turn.poison import step_name
from actors.turn.run_result import RunStop, TurnOutcome
from actors.turn.settings import LoopSettings
from bus.errors import RecordTooLarge, StaleOwner, StoreError, UnstorableRecord
from bus.events import Checkpointed, LiveEvent
from bus.messages import Message, Source, Usage
from bus.outcomes import Outcome, SaveReason
from bus.phase import PhaseTracker, TurnPhase
from store.records import (
    CLAIM_COUNTERS,
    Approval,
    CheckpointRecord,
    MessageMeta,
    ReplyJournal,
    Settle,
)

log = logging.getLogger(__name__)
P = TurnPhase


class CancelNow(Exception):
    """An operator's cancel ends the turn now (raised out of a model call or its retries)."""


class Fenced(Exception):
    """Internal: a save was refused by fencing; unwinds the loop without further effects."""


class TooLarge(Exception):
    """Internal: the next checkpoint cannot be stored (over the size cap, or a value no
    encoder takes); unwinds to end on the last one with ``outcome``."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome


class Released(Exception):
    """Internal: a probation run saved its first checkpoint; unwinds with nothing in flight."""


class LoopState:
    """A turn's state in its loop; every save rebuilds the whole record from it."""

    def __init__(
        self,
        record: CheckpointRecord,
        deps: TurnDeps,
        settings: LoopSettings = LoopSettings(),
        *,
        clock: Callable[[], float] = time.time,
        resume_from: SaveReason | None = None,
        probation: ProbationHooks | None = None,
        inbox_len: int | None = None,
        journal: ReplyJournal | None = None,
        lost_reply: str = "",
    ) -> None:
        """``resume_from`` is the reason of the checkpoint a resumed turn restarts from;
        ``probation`` makes this a probation run: it notes each step before it begins and
        stops (:attr:`RunStop.RELEASED`) right after its first mid-turn checkpoint;
        ``inbox_len``: the inbox's length as the caller just read it (None: not read);
        ``journal``: a reply journaled after ``record`` (the resume continues from it, without
        asking the model); ``lost_reply``: what a journaled reply refused on resume asked
        for, told to the model before it is asked again."""
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
        self._rewritten = False
        """The transcript changed other than by appending since the last save (a compaction
        that was not saved): a reply can then not be journaled as what followed that save."""
        self._journal = journal
        self._lost_reply = lost_reply
        self._last_save: float | None = None
        self._inbox_len = inbox_len
        """The inbox's length as the last save (or the start) saw it, until a model call
        makes it stale (None: read the inbox at the next boundary)."""
        self._calls = CallHistory()
        """The turn's tool calls and results, read once each for the loop detector."""
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

    @property
    def messages(self) -> tuple[Message, ...]:
        return (*self._baseline, *self._turn)

    @property
    def saved(self) -> CheckpointRecord:
        """The last record this loop knows stored (its final one once the turn ended)."""
        return self._saved

    def interrupted(self) -> TurnOutcome:
        """Outcome of a loop cut short by a store failure (its turn stays resumable)."""
        return self._outcome(RunStop.INTERRUPTED)

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the turn is cancelled meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._cancel.wait(), seconds)

    def _fenced(self, exc: StaleOwner) -> Fenced:
        """What unwinds this incarnation when a newer owner refused its save or dispatch."""
        log.warning("turn %s: %s; stopping this incarnation", self.turn_id, exc)
        return Fenced()

    def _too_large(self, exc: RecordTooLarge | UnstorableRecord) -> TooLarge:
        """What unwinds the loop when its next write cannot be stored: the turn ends on its
        last checkpoint (nothing since then can be kept)."""
        log.error("turn %s: %s; ending it on its last checkpoint", self.turn_id, exc)
        big = isinstance(exc, RecordTooLarge)
        return TooLarge(Outcome.ABORTED_RECORD_TOO_LARGE if big else Outcome.ABORTED_UNSTORABLE)

    def _outcome(self, outcome: Outcome | RunStop) -> TurnOutcome:
        return TurnOutcome(
            self.turn_id,
            outcome,
            self.epoch,
            self.saves,
            self.failed_saves,
            len(self.messages),
            self._counters.last_error,
            seq=self._saved.seq,
        )

    async def _note_step(self) -> None:
        if self._probation is None:
            return
        try:
            await self._probation.step(step_name(self.tracker.phase.value, len(self.messages)))
        except StaleOwner as exc:
            raise self._fenced(exc) from exc

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
        call_key: str | None = None,
    ) -> None:
        self._turn.append(message)
        self._meta.append(
            MessageMeta(
                source=source,
                message_id=message_id or new_id(),
                at_ms=self._now_ms() if at_ms is None else at_ms,
                system_injected=injected,
                usage=usage,
                approval=approval,
                call_key=call_key,
            )
        )
        self._dirty = True

    def _adopt_journal(self, journal: ReplyJournal) -> None:
        """Take in what a journaled reply says followed the checkpoint this loop starts from:
        its messages, and its counters but for those the resume's claim just wrote."""
        self._turn.extend(journal.messages)
        self._meta.extend(journal.meta)
        claimed = {f: getattr(self._counters, f) for f in CLAIM_COUNTERS}
        adopted = journal.counters.replies_adopted + 1
        self._counters = journal.counters.model_copy(update={**claimed, "replies_adopted": adopted})
        self._dirty = True

    def _journal_of(self, batch: int) -> ReplyJournal | None:
        """The journal of the reply just appended (the last message): everything since the
        last save, so a resume from that save continues exactly here. None when this loop
        saves no mid-turn checkpoint (nothing mid-turn is durable). A compaction is saved at
        once (its debounce waived), so the transcript grew only by appending since the last
        save, unless that save failed: then no call may run (:class:`StoreError`, the turn
        is interrupted on its last checkpoint, before any side effect)."""
        if not self.settings.checkpoint_mid_turn:
            return None
        if self._rewritten:
            raise StoreError(f"turn {self.turn_id}: its compaction is not saved")
        saved = self._saved
        start = len(saved.messages) - len(self._baseline)
        return ReplyJournal(
            epoch=self.epoch,
            batch=batch,
            base_len=len(saved.messages),
            base_last_id=saved.meta[-1].message_id if saved.meta else "",
            messages=tuple(self._turn[start:]),
            meta=tuple(self._meta[start:]),
            counters=self._counters,
        )

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

    async def _checkpoint(
        self,
        reason: SaveReason,
        *,
        settles: tuple[Settle, ...] = (),
        final: bool = False,
        force: bool = False,
    ) -> None:
        """Save at a durable boundary (debounced unless ``final`` or ``force``), carrying
        ``settles`` (the outcomes the batch before it left); a boundary that saves nothing
        hands them to the checkpointer alone."""
        checkpoints = self.deps.checkpoints
        if not self._dirty or not (final or self.settings.checkpoint_mid_turn):
            await checkpoints.settle(self.turn_id, settles)
            return
        now = self._clock()
        interval = self.settings.checkpoint_min_interval_s
        last = self._last_save
        if not (final or force) and last is not None and now - last < interval:
            await checkpoints.settle(self.turn_id, settles)
            return  # debounced: stays dirty, the next site saves it
        record = self.snapshot(reason, in_progress=not final)
        try:
            ack = await checkpoints.save(record, settles)
        except StaleOwner as exc:
            raise self._fenced(exc) from exc
        except (RecordTooLarge, UnstorableRecord) as exc:
            raise self._too_large(exc) from exc
        except StoreError as exc:
            self.failed_saves += 1
            if final:
                raise
            log.warning(
                "turn %s: %s save failed, retried at next site: %s", self.turn_id, reason, exc
            )
            return
        self._inbox_len = ack.inbox_len
        self._dirty = False
        self._rewritten = False
        self._last_save = now
        self._saved = record
        self.saves += 1
        self._emit(
            Checkpointed(
                self.turn_id,
                self.epoch,
                record.seq,
                reason,
                len(record.messages),
                record.updated_at,
            )
        )
        if final:
            self._emit(record.finished_event())
        if self._probation is not None and self._probation.releases and not final:
            raise Released()

    def _emit(self, event: LiveEvent) -> None:
        if self.deps.events is not None:
            self.deps.events(event)


def new_id() -> str:
    """A random id (32 hex digits, as ``uuid4().hex``, at a quarter of its cost: a turn
    makes one per message and per tool call)."""
    return secrets.token_hex(16)
