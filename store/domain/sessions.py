"""Sessions: conversations of turns, one turn in progress at a time.

A session ``S`` is one hash (``KeyLayout.session``: ``turns`` = how many it has opened,
``latest`` = the id of its newest turn). Its turns are named ``S/1``, ``S/2`` ... and share the
session's shard, so the session hash, its latest turn's record and the next turn's keys are in
one Redis Cluster slot and :meth:`Sessions.open` is one transaction:

``WATCH`` the session hash and the latest turn's record, read both, refuse with
:class:`~bus.errors.SessionBusy` if that turn is still in progress or suspended, build the new
turn from the latest turn's final record, then ``MULTI`` (bump the session, create the turn
with the fenced submission script, the durability wait) ``EXEC``. A rival open or a late write
to the latest record between the read and the ``EXEC`` makes it retry from the read, so two
clients can never open two turns on one baseline.

A message for a busy session may wait instead (:class:`IfBusy`): :meth:`Sessions.enqueue` puts
it on the session's queue (``KeyLayout.session_queue``, and the session in the advisory index
``KeyLayout.queued_sessions``); whoever sees the session free (the host that ended its turn, a
host's periodic adopt, ``phaseline resume``) calls :meth:`Sessions.open_queued`, which opens the
queue's head and pops it in the same transaction, so each queued turn opens once, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any

import redis

from bus.errors import ConfigError, RecordError, SessionBusy, StoreError, TurnExists
from store.codec import EncodedRecord, check_record_size, pack_model, unpack_model
from store.keys import check_turn_id, session_turn_id
from store.records import CheckpointRecord, QueuedTurn, SaveAck, TurnSpec
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import raw as raw_bytes
from store.redis.replies import text, text_fields
from store.write.checkpoint import RedisCheckpointStore


class IfBusy(StrEnum):
    """What a new message to a session does while the session's turn still runs."""

    REJECT = "reject"
    """Refused (:class:`~bus.errors.SessionBusy`): send the running turn a message instead."""
    QUEUE = "queue"
    """Queued durably: it opens the session's next turn when this one ends, in order."""
    INTERRUPT = "interrupt"
    """The running turn is cancelled at its next boundary, then the message opens the next
    turn from its final transcript."""


#: How often an open is retried when a rival changed the session under it.
OPEN_ATTEMPTS = 20

#: Builds the next turn of a session: (the latest turn's final record or None, the new turn's
#: id) -> its spec and first record.
Builder = Callable[[CheckpointRecord | None, str], tuple[TurnSpec, CheckpointRecord]]


class Sessions:
    """Opens turns in sessions on the checkpoint store's Redis."""

    def __init__(self, store: RedisCheckpointStore) -> None:
        self.store = store
        self.keys = store.keys
        self.client: StoreClient = store.client

    async def latest(self, session_id: str) -> str | None:
        """Id of the session's newest turn (None for a session that has none)."""
        with translated(f"read session {session_id}"):
            raw = await self.client.hget(self.keys.session(session_id), "latest")
        return None if raw is None else text(raw)

    async def open(self, session_id: str, build: Builder) -> tuple[TurnSpec, CheckpointRecord]:
        """Create the session's next turn from ``build``; returns its spec and record."""
        opened = await self._open(session_id, build=build)
        assert opened is not None  # not from the queue: an open opens or raises
        return opened

    async def enqueue(self, session_id: str, queued: QueuedTurn) -> int:
        """Queue a turn behind the session's running one; returns its place (1: next)."""
        with translated(f"queue a turn in session {session_id}"):
            place = await self.client.rpush(self.keys.session_queue(session_id), pack_model(queued))
            await self.client.sadd(self.keys.queued_sessions(), session_id)
        return int(place)

    async def queued_sessions(self) -> list[str]:
        """Sessions that may have queued turns (the advisory index)."""
        with translated("list sessions with queued turns"):
            found = await self.client.smembers(self.keys.queued_sessions())
        return sorted(text(s) for s in found)

    async def open_queued(
        self, session_id: str, builder: Callable[[QueuedTurn], Builder]
    ) -> tuple[TurnSpec, CheckpointRecord] | None:
        """Open the session's next queued turn if the session is free, taking it off the
        queue in the same transaction (so each opens once, in order). None when the queue is
        empty (the session then leaves the index) or the session's turn still runs."""
        try:
            opened = await self._open(session_id, queued=builder)
        except SessionBusy:
            return None
        if opened is None:
            with translated(f"read the queue of session {session_id}"):
                if not await self.client.llen(self.keys.session_queue(session_id)):
                    await self.client.srem(self.keys.queued_sessions(), session_id)
        return opened

    async def _open(
        self,
        session_id: str,
        *,
        build: Builder | None = None,
        queued: Callable[[QueuedTurn], Builder] | None = None,
    ) -> tuple[TurnSpec, CheckpointRecord] | None:
        """The open transaction: with ``build``, that turn; with ``queued``, the queue's head
        (built by it and popped in the same transaction; None if the queue is empty)."""
        key = self.keys.session(session_id)
        queue = self.keys.session_queue(session_id)
        for _ in range(OPEN_ATTEMPTS):
            with translated(f"open a turn in session {session_id}"):
                try:
                    async with self.client.pipeline(transaction=True) as pipe:
                        await pipe.watch(key, queue)
                        fields = text_fields(await pipe.hgetall(key))
                        n = _count(key, fields.get("turns", "0")) + 1
                        latest = fields.get("latest")
                        new = session_turn_id(session_id, n)
                        watched = [key, self.keys.turn(new), self.keys.spec(new), queue]
                        if latest is not None:
                            _check_latest(key, session_id, latest)
                            watched.append(self.keys.turn(latest))
                        await pipe.watch(*watched)
                        # (HLEN and STRLEN: redis-py's cluster pipeline mishandles a watched
                        # EXISTS) planted under the session's next name: refuse before the bump
                        if await pipe.hlen(watched[1]) or await pipe.strlen(watched[2]):
                            if text_fields(await pipe.hgetall(key)) != fields:
                                continue  # a rival opened it since the first read: again
                            raise TurnExists(
                                f"turn {new} already exists; session {session_id} "
                                "cannot open its next turn"
                            )
                        if queued is not None:
                            build = await _queue_head(pipe, queue, queued)
                            if build is None:
                                return None
                        assert build is not None
                        previous = None
                        if latest is not None:
                            previous = await self.store.load(latest)
                            _check_final(session_id, previous)
                        spec, record = build(previous, new)
                        encoded = EncodedRecord.of(record)
                        check_record_size(spec.turn_id, encoded.nbytes, self.store.max_record_bytes)
                        wait = await self.store.waiter.command()
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.hset(key, mapping={"turns": n, "latest": spec.turn_id})
                        pipe.persist(key)  # its last turn's end set a time to live: it goes on
                        if queued is not None:
                            pipe.lpop(queue)
                        self.store.queue_save(
                            pipe, encoded, spec=(self.keys.spec(spec.turn_id), pack_model(spec))
                        )
                        if wait:
                            pipe.execute_command(*wait)
                        replies = await pipe.execute()
                except redis.WatchError:
                    continue  # a rival opened a turn, the latest turn or the queue changed
            # the save's reply follows HSET, PERSIST (and LPOP)
            saved = replies[3 if queued is not None else 2]
            self._check_saved(encoded, saved, replies[-1], bool(wait))
            return spec, record
        raise StoreError(f"session {session_id}: {OPEN_ATTEMPTS} opens raced; try again")

    def _check_saved(
        self, encoded: EncodedRecord, reply: object, wait_reply: object, waited: bool
    ) -> None:
        """Raise what the save of an opened turn answered, or its durability shortfall."""
        answer = self.store.answer(encoded, reply)
        if not isinstance(answer, SaveAck):
            raise answer
        problem = self.store.waiter.shortfall(wait_reply) if waited else ""
        if problem:
            raise StoreError(f"turn {encoded.turn_id} opened but not durable: {problem}")


async def _queue_head(
    pipe: Any, queue: str, queued: Callable[[QueuedTurn], Builder]
) -> Builder | None:
    """The builder of the queue's head turn (read under the open's WATCH); None if empty."""
    head = await pipe.lindex(queue, 0)
    if head is None:
        return None
    return queued(unpack_model(QueuedTurn, raw_bytes(head), key=f"{queue}[0]"))


def _count(key: str, raw: str) -> int:
    if not raw.isdigit():
        raise RecordError(key, f"session turn count {raw!r} is not a count")
    return int(raw)


def _check_latest(key: str, session_id: str, latest: str) -> None:
    if not latest.startswith(f"{session_id}/"):
        raise RecordError(key, f"latest turn {latest!r} is not a turn of this session")
    try:
        check_turn_id(latest)
    except ConfigError as exc:
        raise RecordError(key, f"latest turn {latest!r}: {exc}") from None


def _check_final(session_id: str, latest: CheckpointRecord) -> None:
    """A session's next turn starts from a final record only."""
    if latest.in_progress:
        raise SessionBusy(
            f"session {session_id} has turn {latest.turn_id} in progress; send it a message "
            f"(phaseline inject {latest.turn_id} TEXT, Runtime.inject), cancel it (phaseline "
            f"cancel {latest.turn_id}) or wait for it to finish",
            latest.turn_id,
        )
    if latest.counters.outcome is not None and latest.counters.outcome.suspended:
        raise SessionBusy(
            f"session {session_id}: turn {latest.turn_id} is suspended; resume it "
            f"(phaseline resume {latest.turn_id}) before the session goes on",
            latest.turn_id,
        )
