"""Cancelling a turn: a durable request that whichever incarnation owns the turn honours.

The request is an entry in the turn's inbox (``store.domain.inbox``), so it survives the host: the
incarnation running the turn ends it at its next boundary, and one that resumes after a crash
reads it before its first model call. The owner's host is also told at once
(``TurnEngine.cancel``, reached through the deployment), which cancels an in-flight model call
and ends any wait; tools in flight finish (or time out) and are journaled first, so the ledger
stays exact. A suspended turn has no incarnation: cancelling it writes its final record here.
"""

from __future__ import annotations

import contextlib
import time
from enum import StrEnum

from actors.engine.submission import queued_turn
from bus.errors import RecordNotFound, TurnNotRunning
from bus.outcomes import Outcome, SaveReason
from store.domain.inbox import Inbox
from store.domain.sessions import Sessions
from store.records import CheckpointRecord, QueuedTurn, TurnSpec
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["Cancelled", "queue_behind", "request_cancel"]

#: Why a turn cancelled by ``--if-busy interrupt`` ended.
INTERRUPTED = "interrupted by a new message"


class Cancelled(StrEnum):
    """What a cancel did."""

    REQUESTED = "requested"
    """The turn runs: it ends ``cancelled`` at its next boundary."""
    ENDED = "ended"
    """The turn was suspended: its final record, ``cancelled``, is written."""


async def request_cancel(
    store: RedisCheckpointStore, inbox: Inbox, turn_id: str, reason: str, *, by: str = ""
) -> Cancelled:
    """Cancel one turn; :class:`TurnNotRunning` if it already ended or does not exist."""
    try:
        await inbox.push(turn_id, reason, cancel=True, by=by)
        return Cancelled.REQUESTED
    except TurnNotRunning:
        try:
            record = await store.load(turn_id)
        except RecordNotFound:
            raise TurnNotRunning(f"there is no turn {turn_id}", turn_id) from None
        outcome = record.counters.outcome
        if record.in_progress:
            raise  # the inbox's answer raced a resume: say what it said
        if outcome is None or not outcome.suspended:
            raise TurnNotRunning(
                f"turn {turn_id} is not in progress: it ended ({outcome}), so there is nothing "
                "to cancel",
                turn_id,
            ) from None
    why = reason or "cancelled"
    counters = record.counters.model_copy(
        update={"outcome": Outcome.CANCELLED, "cancel_reason": why + (f" (by {by})" if by else "")}
    )
    await store.save(  # fenced like any save: a resume racing this one wins or loses whole
        record.model_copy(
            update={
                "epoch": record.epoch + 1,
                "seq": record.seq + 1,
                "reason": SaveReason.FINAL,
                "counters": counters,
                "updated_at": int(time.time() * 1000),
            }
        )
    )
    return Cancelled.ENDED


async def queue_behind(
    sessions: Sessions,
    inbox: Inbox,
    session: str,
    running: str,
    queued: QueuedTurn,
    *,
    interrupt: bool,
) -> tuple[int, tuple[TurnSpec, CheckpointRecord] | None]:
    """A message for a busy session (``IfBusy.QUEUE``, or ``INTERRUPT``: the running turn
    cancelled first, durably): queued behind ``running``; returns its place, and the turn it
    opened if the session was already free again (the running turn ended meanwhile)."""
    if interrupt:
        with contextlib.suppress(TurnNotRunning):  # it ended meanwhile: nothing to cancel
            await request_cancel(sessions.store, inbox, running, INTERRUPTED, by=queued.by)
    place = await sessions.enqueue(session, queued)
    return place, await sessions.open_queued(session, queued_turn(session))
