"""The checkpoint store: atomic, fenced saves of whole turn records.

A save is one ``MULTI/EXEC`` under ``WATCH`` of the record: ``HSET`` of every field, ``XADD`` of
the checkpoint event, and the in-progress index update, all or nothing. Before ``MULTI`` the
stored ``epoch`` and ``seq`` are compared with the writer's: an older epoch (a zombie owner) or a
seq that is not newer (a replayed or racing save) is refused with :class:`StaleOwner`. If another
writer touches the record between ``WATCH`` and ``EXEC`` the transaction aborts and the check is
redone, so the refusal is decided on what is really stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from bus.errors import (
    AlreadySaved,
    RecordError,
    RecordNotFound,
    StaleOwner,
    StoreError,
    TurnExists,
)
from store.codec import EncodedRecord, decode_record, pack_model, unpack_model
from store.connection import raw as raw_bytes
from store.connection import text, translated
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnSpec

log = logging.getLogger(__name__)


_COMMIT_SLOTS: weakref.WeakKeyDictionary[aioredis.Redis, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _commit_slots(client: aioredis.Redis) -> asyncio.Semaphore:
    """How many shard commits may run at once on ``client``'s pool: half of it.

    A commit holds two pooled connections at once (the WATCHed one and a pipelined reader).
    Unbounded, enough concurrent commits each take one and wait forever for a second: 500
    resume claims at once froze the RecoveryActor that way (``phaseline bench``).
    """
    slots = _COMMIT_SLOTS.get(client)
    if slots is None:
        size = getattr(client.connection_pool, "max_connections", None) or 64
        slots = _COMMIT_SLOTS[client] = asyncio.Semaphore(max(1, min(size, 2**16) // 2))
    return slots


@dataclass(frozen=True, slots=True)
class SaveAck:
    """Proof that a record is durable in Redis."""

    turn_id: str
    """The turn saved."""
    epoch: int
    """Epoch written."""
    seq: int
    """Checkpoint number written."""
    event_id: str
    """Id of the checkpoint event in the shard's events stream."""


@dataclass(frozen=True, slots=True)
class _Write:
    record: EncodedRecord
    extra: tuple[str, bytes] | None = None
    """For a submission: the spec key and value, written with the record if neither exists."""


@dataclass(frozen=True, slots=True)
class InProgressScan:
    """Result of loading every in-progress record: the good ones and why the others failed."""

    records: tuple[CheckpointRecord, ...]
    """Records that decoded, in turn-id order."""
    errors: tuple[RecordError, ...]
    """Records that did not; each has been quarantined."""


class RedisCheckpointStore:
    """Checkpoint records in Redis, keyed by :class:`~store.keys.KeyLayout`."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: KeyLayout,
        *,
        events_maxlen: int = 100_000,
        watch_retries: int = 16,
    ) -> None:
        self.client = client
        self.keys = keys
        self.events_maxlen = events_maxlen
        self.watch_retries = watch_retries

    async def submit(self, spec: TurnSpec, record: CheckpointRecord) -> SaveAck:
        """Create one turn (see :meth:`submit_many`); raises :class:`TurnExists`."""
        (result,) = await self.submit_many([(spec, record)])
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_many(
        self, turns: Sequence[tuple[TurnSpec, CheckpointRecord]]
    ) -> list[SaveAck | StoreError]:
        """Create turns: spec and first record in one transaction per shard; refuse duplicates."""
        writes = [
            _Write(EncodedRecord.of(rec), extra=(self.keys.spec(spec.turn_id), pack_model(spec)))
            for spec, rec in turns
        ]
        return await self._commit(writes)

    async def save(self, record: CheckpointRecord) -> SaveAck:
        """Fenced, atomic save of the whole record (see module docstring)."""
        (result,) = await self.save_many([record])
        if isinstance(result, Exception):
            raise result
        return result

    async def save_many(
        self, records: Sequence[CheckpointRecord | EncodedRecord]
    ) -> list[SaveAck | StoreError]:
        """Group commit: the records of one shard go in one WATCH + MULTI/EXEC, shards run
        concurrently. Each record gets its own answer, in order: an ack, :class:`StaleOwner`
        (:class:`AlreadySaved` for a replay of a save that already landed), or another
        :class:`StoreError`. A refused record never holds back the others."""
        return await self._commit([_Write(_encoded(r)) for r in records])

    async def _commit(self, writes: Sequence[_Write]) -> list[SaveAck | StoreError]:
        results: list[SaveAck | StoreError | None] = [None] * len(writes)
        # One round per occurrence of a turn, so two saves of one turn never share a MULTI.
        rounds: list[dict[int, list[int]]] = []
        seen: dict[str, int] = defaultdict(int)
        for i, w in enumerate(writes):
            n = seen[w.record.turn_id]
            seen[w.record.turn_id] += 1
            if n == len(rounds):
                rounds.append(defaultdict(list))
            rounds[n][self.keys.shard_of(w.record.turn_id)].append(i)
        slots = _commit_slots(self.client)
        for by_shard in rounds:
            await asyncio.gather(
                *(self._commit_shard(writes, idx, results, slots) for idx in by_shard.values())
            )
        return [r if r is not None else StoreError("not written") for r in results]

    async def _commit_shard(
        self,
        writes: Sequence[_Write],
        idx: list[int],
        results: list[SaveAck | StoreError | None],
        slots: asyncio.Semaphore,
    ) -> None:
        async with slots:
            await self._commit_shard_now(writes, idx, results)

    async def _commit_shard_now(
        self,
        writes: Sequence[_Write],
        idx: list[int],
        results: list[SaveAck | StoreError | None],
    ) -> None:
        keys = [self.keys.turn(writes[i].record.turn_id) for i in idx]
        extras = [writes[i].extra for i in idx]
        watched = keys + [e[0] for e in extras if e is not None]
        try:
            with translated(f"save {len(idx)} records"):
                for _ in range(self.watch_retries):
                    async with self.client.pipeline(transaction=True) as pipe:
                        try:
                            await pipe.watch(*watched)
                            async with self.client.pipeline(transaction=False) as reader:
                                for key, extra in zip(keys, extras, strict=True):
                                    reader.hmget(key, "epoch", "seq")
                                    if extra is not None:
                                        reader.exists(key, extra[0])
                                stored = await reader.execute()
                            live = self._admit(writes, idx, keys, stored, results)
                            if not live:
                                await pipe.reset()  # type: ignore[no-untyped-call]
                                return
                            pipe.multi()  # type: ignore[no-untyped-call]
                            for i in live:
                                self.queue_save(pipe, writes[i].record)
                                extra = writes[i].extra
                                if extra is not None:
                                    pipe.set(extra[0], extra[1])
                            replies = await pipe.execute()
                        except redis.WatchError:
                            continue
                    per = [4 if writes[i].extra is not None else 3 for i in live]
                    pos = 0
                    for i, n in zip(live, per, strict=True):
                        rec = writes[i].record
                        results[i] = SaveAck(
                            rec.turn_id, rec.epoch, rec.seq, text(replies[pos + 1])
                        )
                        pos += n
                    return
            raise StoreError("records kept changing under WATCH")
        except StoreError as exc:
            for i in idx:
                if results[i] is None:
                    results[i] = exc

    def _admit(
        self,
        writes: Sequence[_Write],
        idx: list[int],
        keys: list[str],
        stored: list[object],
        results: list[SaveAck | StoreError | None],
    ) -> list[int]:
        """Indices that pass the fence (or the must-not-exist check); the rest get an error."""
        live: list[int] = []
        pos = 0
        for i, key in zip(idx, keys, strict=True):
            w = writes[i]
            fence = stored[pos]
            pos += 1
            try:
                if w.extra is not None:
                    pos += 1
                    if stored[pos - 1]:
                        raise TurnExists(f"turn {w.record.turn_id} already exists")
                self._check_fence(key, w.record, [_opt_bytes(v) for v in fence])  # type: ignore[attr-defined]
            except StoreError as exc:
                results[i] = exc
                continue
            results[i] = None
            live.append(i)
        return live

    @staticmethod
    def _check_fence(key: str, record: EncodedRecord, stored: list[bytes | None]) -> None:
        epoch_raw, seq_raw = stored
        if epoch_raw is None and seq_raw is None:
            return
        try:
            epoch, seq = int(epoch_raw or b""), int(seq_raw or b"")
        except ValueError as exc:
            raise RecordError(key, f"stored epoch/seq unreadable: {stored!r}") from exc
        if epoch > record.epoch:
            raise StaleOwner(
                f"turn {record.turn_id}: epoch {record.epoch} is stale, owner is epoch {epoch}"
            )
        if (epoch, seq) == (record.epoch, record.seq):
            raise AlreadySaved(f"turn {record.turn_id}: epoch {epoch} seq {seq} already stored")
        if record.seq <= seq:
            raise StaleOwner(
                f"turn {record.turn_id}: seq {record.seq} is not newer than stored {seq}"
            )

    def queue_save(
        self, pipe: aioredis.client.Pipeline, record: CheckpointRecord | EncodedRecord
    ) -> None:
        """Queue the three writes of one save on a pipeline already in MULTI."""
        record = _encoded(record)
        turn_id = record.turn_id
        pipe.hset(self.keys.turn(turn_id), mapping=record.fields)  # type: ignore[arg-type]
        pipe.xadd(
            self.keys.events_of(turn_id),
            {
                "turn_id": turn_id,
                "epoch": record.epoch,
                "seq": record.seq,
                "phase": record.phase,
                "reason": record.reason,
                "in_progress": int(record.in_progress),
            },
            maxlen=self.events_maxlen,
            approximate=True,
        )
        index = self.keys.in_progress_of(turn_id)
        if record.in_progress:
            pipe.sadd(index, turn_id)
        else:
            pipe.srem(index, turn_id)

    async def load(self, turn_id: str) -> CheckpointRecord:
        """The stored record; a record that fails to decode is quarantined and reported."""
        key = self.keys.turn(turn_id)
        with translated(f"load {turn_id}"):
            raw = await self.client.hgetall(key)
        if not raw:
            raise RecordNotFound(f"no record for turn {turn_id}")
        try:
            return decode_record(key, {raw_bytes(k): raw_bytes(v) for k, v in raw.items()})
        except RecordError as exc:
            await self.quarantine(turn_id, str(exc))
            raise

    async def load_spec(self, turn_id: str) -> TurnSpec:
        key = self.keys.spec(turn_id)
        with translated(f"load spec {turn_id}"):
            raw = await self.client.get(key)
        if raw is None:
            raise RecordNotFound(f"no spec for turn {turn_id}")
        return unpack_model(TurnSpec, raw_bytes(raw), key=key)

    async def list_in_progress(self) -> list[str]:
        """Ids of every turn whose latest record has ``in_progress = 1``, sorted."""
        ids: list[str] = []
        with translated("list in-progress turns"):
            for shard in self.keys.all_shards():
                ids.extend(
                    text(m) for m in await self.client.smembers(self.keys.in_progress(shard))
                )
        return sorted(ids)

    async def load_in_progress(self) -> InProgressScan:
        """Every in-progress record; bad ones are quarantined and listed, the rest load."""
        good: list[CheckpointRecord] = []
        bad: list[RecordError] = []
        for turn_id in await self.list_in_progress():
            try:
                good.append(await self.load(turn_id))
            except RecordError as exc:
                bad.append(exc)
            except RecordNotFound:
                # Index entry without a record (deleted by hand): drop the dangling entry.
                with translated("clean in-progress index"):
                    await self.client.srem(self.keys.in_progress_of(turn_id), turn_id)
        return InProgressScan(tuple(good), tuple(bad))

    async def quarantine(self, turn_id: str, reason: str) -> None:
        """Move a bad record aside (same slot) and out of the in-progress index."""
        key, dest = self.keys.turn(turn_id), self.keys.quarantined(turn_id)
        log.error("quarantining %s: %s", key, reason)
        with translated(f"quarantine {turn_id}"):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(
                    self.keys.quarantine_of(turn_id), turn_id, f"{int(time.time())}: {reason}"
                )
                pipe.srem(self.keys.in_progress_of(turn_id), turn_id)
                pipe.rename(key, dest)
                await pipe.execute(raise_on_error=False)

    async def quarantined(self) -> dict[str, str]:
        """Quarantined turn ids and the reason each was moved aside."""
        out: dict[str, str] = {}
        with translated("list quarantine"):
            for shard in self.keys.all_shards():
                for k, v in (await self.client.hgetall(self.keys.quarantine(shard))).items():
                    out[text(k)] = text(v)
        return out


def _encoded(record: CheckpointRecord | EncodedRecord) -> EncodedRecord:
    return record if isinstance(record, EncodedRecord) else EncodedRecord.of(record)


def _opt_bytes(value: bytes | str | None) -> bytes | None:
    return None if value is None else raw_bytes(value)
