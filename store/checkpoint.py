"""The checkpoint store: atomic, fenced saves of whole turn records.

A save is one ``MULTI/EXEC`` under ``WATCH`` of the record: ``HSET`` of every field, ``XADD`` of
the checkpoint event, and the in-progress index update, all or nothing. Before ``MULTI`` the
stored ``epoch`` and ``seq`` are compared with the writer's: an older epoch (a zombie owner) or a
seq that is not newer (a replayed or racing save) is refused with :class:`StaleOwner`. If another
writer touches the record between ``WATCH`` and ``EXEC`` the transaction aborts and the check is
redone, so the refusal is decided on what is really stored.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from bus.errors import RecordError, RecordNotFound, StaleOwner, StoreError, TurnExists
from store.codec import decode_record, encode_record, pack_model, unpack_model
from store.connection import raw as raw_bytes
from store.connection import text, translated
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnSpec

log = logging.getLogger(__name__)


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
        """Create a turn: its spec and first record in one transaction; refuse a duplicate id."""
        spec_key = self.keys.spec(spec.turn_id)
        return await self._write(record, extra_watch=spec_key, spec=(spec_key, pack_model(spec)))

    async def save(self, record: CheckpointRecord) -> SaveAck:
        """Fenced, atomic save of the whole record (see module docstring)."""
        return await self._write(record)

    async def _write(
        self,
        record: CheckpointRecord,
        *,
        extra_watch: str | None = None,
        spec: tuple[str, bytes] | None = None,
    ) -> SaveAck:
        key = self.keys.turn(record.turn_id)
        watch = [key] if extra_watch is None else [key, extra_watch]
        with translated(f"save {record.turn_id}"):
            for _ in range(self.watch_retries):
                async with self.client.pipeline(transaction=True) as pipe:
                    try:
                        await pipe.watch(*watch)
                        if spec is not None and await pipe.exists(*watch):
                            raise TurnExists(f"turn {record.turn_id} already exists")
                        stored = await pipe.hmget(key, "epoch", "seq")
                        self._check_fence(key, record, [_opt_bytes(v) for v in stored])
                        pipe.multi()  # type: ignore[no-untyped-call]
                        self.queue_save(pipe, record)
                        if spec is not None:
                            pipe.set(spec[0], spec[1])
                        results = await pipe.execute()
                    except redis.WatchError:
                        continue
                event_id = results[1]
                return SaveAck(
                    record.turn_id,
                    record.epoch,
                    record.seq,
                    event_id.decode() if isinstance(event_id, bytes) else str(event_id),
                )
        raise StoreError(f"save {record.turn_id}: record kept changing under WATCH")

    @staticmethod
    def _check_fence(key: str, record: CheckpointRecord, stored: list[bytes | None]) -> None:
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
        if record.seq <= seq:
            raise StaleOwner(
                f"turn {record.turn_id}: seq {record.seq} is not newer than stored {seq}"
            )

    def queue_save(self, pipe: aioredis.client.Pipeline, record: CheckpointRecord) -> None:
        """Queue the three writes of one save on a pipeline already in MULTI."""
        turn_id = record.turn_id
        pipe.hset(self.keys.turn(turn_id), mapping=encode_record(record))  # type: ignore[arg-type]
        pipe.xadd(
            self.keys.events_of(turn_id),
            {
                "turn_id": turn_id,
                "epoch": record.epoch,
                "seq": record.seq,
                "phase": record.phase.value,
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


def _opt_bytes(value: bytes | str | None) -> bytes | None:
    return None if value is None else raw_bytes(value)
