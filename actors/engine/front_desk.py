"""The front desk: every operator verb on turns, over one Redis client and one key layout.

The CLI, the web console and :class:`~actors.cluster.runtime.Runtime` each used to sequence
submit, cancel and reopen themselves; they drifted (a cancel told the hosts on one road and not
on another, a decision matched call keys one way here and another there). Now the verbs live
here, Ray-free, and work against Redis alone: a durable request is honoured by whichever
incarnation owns the turn (a deployment adopts a new turn, a cancel is read from the inbox at
the next boundary). ``Runtime`` extends the desk with "tell the hosts now" by overriding the
three hooks at the bottom (:meth:`FrontDesk._vet`, :meth:`FrontDesk._hand_over`,
:meth:`FrontDesk._tell_cancel`); nothing else differs between the doors.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import IO

from actors.engine.cancel import Cancelled, queue_behind, request_cancel
from actors.engine.resume import reopen
from actors.engine.settings.config import Settings
from actors.engine.submission import new_turns, session_turn
from bus.errors import (
    ConfigError,
    NotAwaitingApproval,
    RecordError,
    RecordNotFound,
    SessionBusy,
    StoreError,
    TurnExists,
)
from store.domain.approvals import Approvals
from store.domain.inbox import Inbox
from store.domain.ledger import ToolLedger
from store.domain.retention import TurnPurger
from store.domain.sessions import IfBusy, Sessions
from store.keys import KeyLayout, check_turn_id
from store.records import Approval, CheckpointRecord, InboxItem, QueuedTurn, TurnInput
from store.redis.connection import StoreClient
from store.views.archive import FinishedTurn
from store.views.summaries import Cursor, TurnFilter, TurnPage, TurnSummary, summaries, turn_page
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["FrontDesk", "SessionSubmit", "Waiting", "call_matches"]

#: The filter that admits every turn.
_EVERY = TurnFilter()
#: Index entries read per step when walking finished turns (export, purge).
_WALK = 500


@dataclass(frozen=True, slots=True)
class SessionSubmit:
    """What a message to a session became."""

    turn_id: str | None = None
    """The turn it opened (None: queued)."""
    queued_behind: str | None = None
    """The running turn it waits for, when queued."""
    place: int = 0
    """Its place in the session's queue (1: next), when queued."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """A tool call waiting for an operator's decision."""

    turn_id: str
    """Its turn."""
    call_key: str
    """Its ledger key (``<batch>.<index>.<digest>``)."""
    approval: Approval
    """The question: tool, arguments, when it was asked."""


def call_matches(key: str, given: str) -> bool:
    """Whether a person's ``given`` names the call ``key`` (``<batch>.<index>.<digest>``): a
    start of the whole key, or of its digest alone (what a person copies from a table)."""
    return bool(given) and (key.startswith(given) or key.split(".", 2)[-1].startswith(given))


class FrontDesk:
    """The operator's verbs on one namespace's turns (see the module's docstring)."""

    def __init__(
        self, client: StoreClient, settings: Settings, *, keys: KeyLayout | None = None
    ) -> None:
        self.client = client
        self.settings = settings
        self.keys = keys or settings.redis.key_layout()
        self.store = RedisCheckpointStore(
            client,
            self.keys,
            durability=settings.redis.durability_policy(),
            atomic=settings.checkpoint.atomic,
        )
        self.inbox = Inbox(client, self.keys)
        self.approvals = Approvals(client, self.keys)
        self.sessions = Sessions(self.store)
        self.ledger = ToolLedger(client, self.keys)

    # -- new turns ----------------------------------------------------------------------------

    async def submit(
        self,
        agent: str,
        turn_input: TurnInput | str,
        turn_ids: Iterable[str] = (),
        *,
        session: str | None = None,
    ) -> list[str]:
        """Create turns of ``agent`` (an import path) on ``turn_input``; returns the new ones.
        A bad agent or input is a :class:`ConfigError` here, before anything is written.

        With ``session``, one turn is opened in that session instead (its id is
        ``<session>/<n>``): it starts from the previous turn's final transcript, and is
        refused with :class:`SessionBusy` while that turn is still running.

        Idempotent without a session: a turn that already exists is left alone (and not
        returned), so a submission cut short by a Redis failure can simply be repeated. Any
        other failure raises after the turns that were created have been handed over."""
        if isinstance(turn_input, str):
            turn_input = TurnInput(message=turn_input)
        ids = list(turn_ids)
        if session is not None and ids:
            raise ConfigError("a session names its own turns: give turn_ids or session")
        await self._vet(agent, turn_input)
        if session is not None:
            spec, _ = await self.sessions.open(session, session_turn(agent, turn_input, session))
            await self._hand_over([spec.turn_id])
            return [spec.turn_id]
        turns = new_turns(agent, turn_input, ids)
        created: list[str] = []
        failure: StoreError | None = None
        for (spec, _), result in zip(turns, await self.store.submit_many(turns), strict=True):
            if isinstance(result, TurnExists):
                continue
            if isinstance(result, StoreError):
                failure = failure or result
                continue
            created.append(spec.turn_id)
        await self._hand_over(created)
        if failure is not None:
            raise failure
        return created

    async def submit_in_session(
        self,
        agent: str,
        turn_input: TurnInput | str,
        session: str,
        *,
        if_busy: IfBusy = IfBusy.REJECT,
        by: str = "",
    ) -> SessionSubmit:
        """Open the session's next turn; while its running turn has not ended, ``if_busy``
        says what happens: refused (:class:`SessionBusy`), queued behind it, or the running
        turn cancelled and the new one queued to open from its final transcript."""
        if isinstance(turn_input, str):
            turn_input = TurnInput(message=turn_input)
        try:
            (opened,) = await self.submit(agent, turn_input, session=session)
            return SessionSubmit(turn_id=opened)
        except SessionBusy as busy:
            if if_busy is IfBusy.REJECT:
                raise
            running = busy.turn_id
        queued = QueuedTurn(agent=agent, input=turn_input, at_ms=int(time.time() * 1000), by=by)
        interrupt = if_busy is IfBusy.INTERRUPT
        place, now_open = await queue_behind(
            self.sessions, self.inbox, session, running, queued, interrupt=interrupt
        )
        if interrupt:
            await self._tell_cancel(running)
        if now_open is not None:
            await self._hand_over([now_open[0].turn_id])
            return SessionSubmit(turn_id=now_open[0].turn_id)
        return SessionSubmit(queued_behind=running, place=place)

    # -- running turns ------------------------------------------------------------------------

    async def cancel(self, turn_id: str, reason: str = "", *, by: str = "") -> Cancelled:
        """Cancel a turn: durable (its owner, or the incarnation that resumes it, ends it
        ``cancelled`` at its next boundary; a deployment's host is also told now, which cancels
        an in-flight model call). A suspended turn ends at once. :class:`TurnNotRunning` for
        one that already ended."""
        check_turn_id(turn_id)
        done = await request_cancel(self.store, self.inbox, turn_id, reason, by=by)
        if done is Cancelled.REQUESTED:
            await self._tell_cancel(turn_id)
        return done

    async def inject(
        self, turn_id: str, text: str, *, by: str = "", message_id: str | None = None
    ) -> InboxItem:
        """Queue a user message; it enters the turn at its next boundary, exactly once.
        :class:`TurnNotRunning` for a turn that is not in progress."""
        check_turn_id(turn_id)
        if not text.strip():
            raise ConfigError("the message is empty")
        return await self.inbox.push(turn_id, text, message_id=message_id, by=by)

    async def reopen(self, turn_ids: Sequence[str]) -> list[CheckpointRecord]:
        """Put suspended turns back in progress (fenced like any claim; other records are
        returned as they are) and have a deployment pick them up."""
        records = [await reopen(self.store, check_turn_id(t)) for t in turn_ids]
        await self._hand_over([r.turn_id for r in records if r.in_progress], adopted=True)
        return records

    # -- approvals ----------------------------------------------------------------------------

    async def waiting(self, turn_id: str | None = None) -> list[Waiting]:
        """Calls waiting for a decision, of one turn or of every turn in progress."""
        ids = [check_turn_id(turn_id)] if turn_id else await self.store.list_in_progress()
        return [
            Waiting(t, key, a) for t in ids for key, a in (await self.approvals.pending(t)).items()
        ]

    async def decide(
        self, turn_id: str, call: str, approve: bool, *, by: str = "", reason: str = ""
    ) -> str:
        """Approve or deny the waiting call ``call`` names (its key, a unique start of it, or
        of its digest); returns its key. :class:`NotAwaitingApproval` if none or several wait
        under that name, or it was decided meanwhile. Who and why stay with the call's result."""
        check_turn_id(turn_id)
        asked = await self.approvals.all(turn_id)
        matches = [k for k, a in asked.items() if a.state == "pending" and call_matches(k, call)]
        if len(matches) != 1:
            decided = [f"{k} ({a.note()})" for k, a in asked.items() if call_matches(k, call)]
            if not matches and len(decided) == 1:
                raise NotAwaitingApproval(f"turn {turn_id}: call {decided[0]} was decided already")
            listed = ", ".join(k for k, a in asked.items() if a.state == "pending") or "none"
            what = f"{len(matches)} waiting calls match" if matches else "no call is waiting as"
            raise NotAwaitingApproval(f"turn {turn_id}: {what} {call!r} (waiting: {listed})")
        (key,) = matches
        if not await self.approvals.decide(turn_id, key, approve, by=by, reason=reason):
            raise NotAwaitingApproval(f"turn {turn_id}: call {key} was decided already")
        return key

    # -- the store's turns --------------------------------------------------------------------

    async def page(
        self,
        where: TurnFilter = _EVERY,
        *,
        after: Cursor | None = None,
        limit: int = 50,
        scan: int = 5000,
    ) -> TurnPage:
        """A page of the turns index, newest first (see :func:`store.views.summaries.turn_page`)."""
        return await turn_page(
            self.client, self.keys, where=where, after=after, limit=limit, scan=scan
        )

    async def finished(self, where: TurnFilter = _EVERY) -> AsyncIterator[TurnSummary]:
        """Every finished turn of the index that ``where`` admits (read by summary: a record
        is loaded only for the turns chosen)."""
        batch: list[tuple[str, int]] = []

        async def admitted() -> list[TurnSummary]:
            rows = await summaries(self.client, self.keys, batch)
            batch.clear()
            return [r for r in rows if r is not None and not r.in_progress and where.admits(r)]

        async for entry in self.store.iter_turns(since_ms=where.since_ms):
            batch.append(entry)
            if len(batch) == _WALK:
                for row in await admitted():
                    yield row
        for row in await admitted():
            yield row

    async def export(self, where: TurnFilter, sink: IO[str]) -> int:
        """Write each finished turn ``where`` admits to ``sink`` as a JSON line (record and
        ledger, :class:`~store.views.archive.FinishedTurn`); returns how many."""
        written = 0
        async for row in self.finished(where):
            try:
                record = await self.store.load(row.turn_id)
            except (RecordError, RecordNotFound):  # expired, purged or quarantined meanwhile
                continue
            if not record.in_progress:
                sink.write(FinishedTurn(record, await self.ledger.entries(row.turn_id)).json_line())
                written += 1
        return written

    async def purgeable(self, where: TurnFilter, *, older_than_ms: int | None) -> list[str]:
        """The finished turns a purge would remove: ``where`` admits them, their last save is
        older than ``older_than_ms`` (unix ms; None: any), and none is suspended unless
        ``where`` names its outcome (a suspended turn waits for ``phaseline resume``)."""
        return [
            row.turn_id
            async for row in self.finished(where)
            if (older_than_ms is None or row.updated_at_ms < older_than_ms)
            and (row.outcome is None or not row.outcome.suspended or where.outcome is not None)
        ]

    async def purge(self, turn_ids: Iterable[str]) -> int:
        """Remove finished turns (every key of each, :class:`~store.domain.retention.TurnPurger`);
        returns how many went (a turn in progress is never removed)."""
        purger = TurnPurger(self.client, self.keys)
        return sum([await purger.purge(t) for t in turn_ids])

    # -- what a deployment adds (``Runtime`` overrides these) ---------------------------------

    async def _vet(self, agent: str, turn_input: TurnInput) -> None:
        """Refuse (:class:`ConfigError`) a turn the deployment could not run. Here: nothing
        beyond what :func:`~actors.engine.submission.new_turns` checks in this process."""

    async def _hand_over(self, turn_ids: Sequence[str], *, adopted: bool = False) -> None:
        """New (or reopened, ``adopted``) turns are in Redis: a deployment picks them up at
        its next adopt. Here: nothing to tell."""

    async def _tell_cancel(self, turn_id: str) -> None:
        """A cancel is in the turn's inbox. Here: nothing to tell; its owner reads it."""
