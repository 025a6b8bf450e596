"""The checkpoint store: atomic, fenced saves of whole turn records.

A save is one server-side script (``store/lua/checkpoint_save.lua``) that reads the stored
``epoch`` and ``seq``, refuses an older epoch (a zombie owner) or a seq that is not newer (a
replayed or racing save) with :class:`StaleOwner`, and otherwise writes the bodies the record
adds (content-addressed, :mod:`store.write.transcript`), drops the ones it stopped naming, rewrites
every field of the record hash, and does the ``XADD`` of the checkpoint event and the
in-progress index update. Redis runs a script to the end before any other command, so the check
and the writes are one atomic step, exactly what DESIGN's ``WATCH`` + ``MULTI/EXEC`` gives, in
one round trip instead of three and with no retry when another writer races
(docs/CLUSTER.md says why the script, with the measurement).

``[checkpoint] atomic = "multi_exec"`` makes the same saves with ``WATCH`` and ``MULTI/EXEC``
per shard instead (:mod:`store.write.transaction`); the two answer alike.

A load is one script too (``checkpoint_load.lua``): the record and every body it names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from bus.errors import (
    AlreadySaved,
    NotDurable,
    RecordError,
    RecordNotFound,
    RecordTooLarge,
    StaleOwner,
    StoreError,
    TurnExists,
)
from store.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    EncodedRecord,
    check_record_size,
    decode_record,
    pack_model,
    unpack_model,
)
from store.domain.retention import Retention
from store.keys import KeyLayout
from store.lua import lua_script
from store.records import CheckpointRecord, SaveAck, Settle, TurnSpec
from store.redis.batcher import ScriptCalls
from store.redis.connection import StoreClient
from store.redis.durability import Durability, DurabilityWait
from store.redis.failures import reading, translated
from store.redis.nodes import slot_of
from store.redis.replies import raw as raw_bytes
from store.redis.replies import text
from store.redis.transport import transport_of
from store.write.save_script import REPLAYED, SAVE_LUA, SaveCall, save_answer
from store.write.transaction import AtomicSave, ShardBatch
from store.write.transcript import KnownBodies

log = logging.getLogger(__name__)

_LOAD_LUA = lua_script("checkpoint_load.lua")


@dataclass(frozen=True, slots=True)
class _Write:
    record: EncodedRecord
    spec: tuple[str, bytes] | None = None
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
        client: StoreClient,
        keys: KeyLayout,
        *,
        events_maxlen: int = 100_000,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        durability: Durability = Durability(),
        atomic: AtomicSave = AtomicSave.SCRIPT,
        retention: Retention = Retention(),
    ) -> None:
        self.client = client
        self.transport = transport_of(client)
        self.retention = retention
        self.atomic = atomic
        self.keys = keys
        self.events_maxlen = events_maxlen
        self.max_record_bytes = max_record_bytes
        self.durability = durability
        self.waiter = DurabilityWait(client, durability)
        self._save_script = client.register_script(SAVE_LUA)
        self._load_script = client.register_script(_LOAD_LUA)
        self._starts = ScriptCalls(client)  # a burst of starting turns shares pipelines
        self.known = KnownBodies()
        """What this store's own saves (of :class:`CheckpointRecord`) left in Redis, so the
        next save of a turn sends only new bodies. Saves handed in encoded carry their own."""

    async def submit(self, spec: TurnSpec, record: CheckpointRecord) -> SaveAck:
        """Create one turn (see :meth:`submit_many`); raises :class:`TurnExists`."""
        (result,) = await self.submit_many([(spec, record)])
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_many(
        self, turns: Sequence[tuple[TurnSpec, CheckpointRecord]]
    ) -> list[SaveAck | StoreError]:
        """Create turns: spec and first record in one atomic step each; refuse duplicates."""
        writes = [
            _Write(EncodedRecord.of(rec), spec=(self.keys.spec(spec.turn_id), pack_model(spec)))
            for spec, rec in turns
        ]
        return await self._commit(writes)

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        """Fenced, atomic save of the whole record (see module docstring), journaling
        ``settles`` with it. A save found already stored (a client's resend of a request
        whose reply was lost) is acked."""
        (result,) = await self.save_many([record], settles=[settles])
        return acked(record, result)

    async def save_many(
        self,
        records: Sequence[CheckpointRecord | EncodedRecord],
        *,
        settles: Sequence[Sequence[Settle]] | None = None,
    ) -> list[SaveAck | StoreError]:
        """Group commit: every save of the batch in one pipeline (one round trip), applied
        in order, each atomic and fenced on its own. Each record gets its own answer, in
        order: an ack, :class:`StaleOwner` (:class:`AlreadySaved` for a replay of a save
        that already landed), or another :class:`StoreError`. A refused record never holds
        back the others. ``settles``: per record of this process's own (not encoded ones,
        which carry theirs), the tool outcomes journaled with it."""
        writes = [
            _Write(r if isinstance(r, EncodedRecord) else EncodedRecord.of(r, self.known))
            for r in records
        ]
        for i, carried in enumerate(settles or ()):
            if carried:
                writes[i] = _Write(dataclasses.replace(writes[i].record, settles=tuple(carried)))
        answers = await self._commit(writes)
        for r, w, a in zip(records, writes, answers, strict=True):
            if not isinstance(r, EncodedRecord):
                self.known.settle(
                    w.record.turn_id, w.record.seq, landed=landed(a), in_progress=r.in_progress
                )
        return answers

    async def _commit(self, writes: Sequence[_Write]) -> list[SaveAck | StoreError]:
        answers: list[SaveAck | StoreError | None] = [None] * len(writes)
        sent: list[int] = []
        for i, w in enumerate(writes):
            try:
                check_record_size(w.record.turn_id, w.record.nbytes, self.max_record_bytes)
                sent.append(i)
            except RecordTooLarge as exc:
                answers[i] = exc
        if sent:
            try:
                wait = await self.waiter.command()
                if self.atomic is AtomicSave.SCRIPT:
                    replies = await self._pipelined(writes, sent, wait)
                else:
                    replies = await self._transactions(writes, sent, wait)
            except StoreError as exc:
                replies = [exc] * len(sent)
            for i, reply in zip(sent, replies, strict=True):
                answers[i] = (
                    reply if isinstance(reply, StoreError) else self.answer(writes[i].record, reply)
                )
        return [a if a is not None else StoreError("not answered") for a in answers]

    async def _pipelined(
        self, writes: Sequence[_Write], sent: list[int], wait: tuple[str | int, ...] | None
    ) -> list[object]:
        """Every save's script by ``EVALSHA`` (redis-py's pipeline would first ask ``SCRIPT
        EXISTS``, one more round trip per batch), the saves of each slot in one round trip to
        its node with that node's durability wait after them (a ``WAIT`` covers the writes of
        its connection only), the slots at once; on one server, one round trip for all. A
        save that ran nothing (``NOSCRIPT``, a moved slot) goes again by the transport's
        rules (:mod:`store.redis.transport`)."""

        async def on_node(group: list[int]) -> list[object]:
            with translated(f"save {len(group)} records"):
                commands = []
                for i in group:
                    keys, args = self._save_call(writes[i].record, writes[i].spec).script_args()
                    commands.append(("EVALSHA", self._save_script.sha, len(keys), *keys, *args))
                out = await self.transport.send(
                    self.keys.turn(writes[group[0]].record.turn_id), commands, wait=wait
                )
            replies = out.replies
            if wait:
                replies = [
                    self._unless_durable([writes[i]], [reply], waited)[0]
                    for i, reply, waited in zip(group, replies, out.waits, strict=True)
                ]
            return replies

        return await _per_group(
            sent, lambda i: slot_of(self.client, self.keys.turn(writes[i].record.turn_id)), on_node
        )

    async def _transactions(
        self, writes: Sequence[_Write], sent: list[int], wait: tuple[str | int, ...] | None
    ) -> list[object]:
        """One WATCH/MULTI/EXEC per shard (:mod:`store.write.transaction`), the shards at once."""

        async def commit(group: list[int]) -> list[object]:
            batch = ShardBatch(
                [self._save_call(writes[i].record, writes[i].spec) for i in group], wait
            )
            replies, wait_reply = await batch.commit(self.transport)
            if wait and wait_reply is not None:
                replies = self._unless_durable([writes[i] for i in group], replies, wait_reply)
            return replies

        return await _per_group(
            sent, lambda i: self.keys.shard_of(writes[i].record.turn_id), commit
        )

    def _unless_durable(
        self, writes: Sequence[_Write], replies: list[object], wait_reply: object
    ) -> list[object]:
        """Saves that landed but whose durability wait fell short become NotDurable."""
        problem = self.waiter.shortfall(wait_reply)
        if not problem:
            return replies
        return [
            NotDurable(f"save of {w.record.turn_id}: {problem}")
            if isinstance(r, list) and r and text(r[0]) == "ok"
            else r
            for w, r in zip(writes, replies, strict=True)
        ]

    def queue_save(
        self,
        pipe: aioredis.client.Pipeline | aioredis.cluster.ClusterPipeline,
        record: EncodedRecord,
        *,
        spec: tuple[str, bytes] | None = None,
    ) -> None:
        """Queue one fenced save (and, for a submission, its spec) on ``pipe``: an ``EVAL`` of
        the script's text, which needs no ``SCRIPT LOAD`` beforehand on whichever node the
        pipeline reaches (opening a session's turn is rare; the text is 3 KB)."""
        keys, args = self._save_call(record, spec).script_args()
        pipe.eval(SAVE_LUA, len(keys), *keys, *args)

    def _save_call(self, record: EncodedRecord, spec: tuple[str, bytes] | None) -> SaveCall:
        return SaveCall.of(
            self.keys, record, spec, events_maxlen=self.events_maxlen, retention=self.retention
        )

    def answer(self, record: EncodedRecord, reply: object) -> SaveAck | StoreError:
        """Turn the script's reply for one save into an ack or the typed refusal."""
        return save_answer(record, self.keys.turn(record.turn_id), reply)

    async def load(self, turn_id: str) -> CheckpointRecord:
        """The stored record; a record that fails to decode is quarantined and reported."""
        key = self.keys.turn(turn_id)
        try:
            with reading(key, f"load {turn_id}"):
                reply = await self._load_script(keys=[key, self.keys.bodies(turn_id)])
            if not reply:
                raise RecordNotFound(f"no record for turn {turn_id}")
            return self._decoded(turn_id, key, reply)
        except RecordError as exc:
            await self.quarantine(turn_id, str(exc))
            raise

    async def load_start(self, turn_id: str) -> tuple[CheckpointRecord, TurnSpec | None, int]:
        """What starting a turn reads, in one round trip: its record (as :meth:`load`), its
        spec (as :meth:`load_spec`; None if there is none) and its inbox's length."""
        key = self.keys.turn(turn_id)
        keys = [key, self.keys.bodies(turn_id), self.keys.spec(turn_id), self.keys.inbox(turn_id)]
        try:
            with reading(key, f"load {turn_id} to start it"):
                reply = await self._starts.call(self._load_script, keys)
            if not reply:
                raise RecordNotFound(f"no record for turn {turn_id}")
            if not isinstance(reply, list) or len(reply) != 4 or not isinstance(reply[3], int):
                raise RecordError(key, f"load script answered {reply!r:.80}")
            record = self._decoded(turn_id, key, reply[:2])
        except RecordError as exc:
            await self.quarantine(turn_id, str(exc))
            raise
        spec = None if reply[2] is None else self._spec(turn_id, reply[2])
        return record, spec, reply[3]

    def _decoded(self, turn_id: str, key: str, reply: object) -> CheckpointRecord:
        record = decode_record(key, *_pairs(key, reply))
        if record.turn_id != turn_id:
            raise RecordError(key, f"holds turn {record.turn_id!r}, not {turn_id!r}")
        return record

    async def load_spec(self, turn_id: str) -> TurnSpec:
        key = self.keys.spec(turn_id)
        with reading(key, f"load spec {turn_id}"):
            raw = await self.client.get(key)
        return self._spec(turn_id, raw)

    def _spec(self, turn_id: str, raw: object) -> TurnSpec:
        key = self.keys.spec(turn_id)
        if raw is None:
            raise RecordNotFound(f"no spec for turn {turn_id}")
        if not isinstance(raw, bytes | str):
            raise RecordError(key, f"spec read as {type(raw).__name__}")
        spec = unpack_model(TurnSpec, raw_bytes(raw), key=key)
        if spec.turn_id != turn_id:
            raise RecordError(key, f"spec of turn {spec.turn_id!r}, not {turn_id!r}")
        return spec

    async def list_turns(
        self, *, since_ms: int = 0, before_ms: int | None = None, limit: int = 100
    ) -> list[tuple[str, int]]:
        """The newest turns submitted in ``[since_ms, before_ms)`` (the turns index, not a
        scan of the keyspace), newest first, with their submission time (unix ms): at most
        ``limit`` from each shard, merged. Page by passing the oldest time seen as
        ``before_ms``."""
        top = "+inf" if before_ms is None else f"({before_ms}"
        with translated("list turns"):
            async with self.client.pipeline(transaction=False) as pipe:
                for shard in self.keys.all_shards():
                    pipe.zrevrangebyscore(
                        self.keys.turns(shard), top, since_ms, start=0, num=limit, withscores=True
                    )
                shards = await pipe.execute()
        found = [(text(t), int(score)) for rows in shards for t, score in rows]
        return sorted(found, key=lambda x: (-x[1], x[0]))[:limit]

    async def iter_turns(
        self, *, since_ms: int = 0, until_ms: int | None = None, page: int = 500
    ) -> AsyncIterator[tuple[str, int]]:
        """Every turn in the index submitted in ``[since_ms, until_ms]``, with its submission
        time, shard by shard (no order across shards), ``page`` at a time: every one once,
        also when many share a millisecond (a run submits its turns at one)."""
        top: int | str = "+inf" if until_ms is None else until_ms
        for shard in self.keys.all_shards():
            offset = 0
            while True:
                with translated("list turns"):
                    rows = await self.client.zrangebyscore(
                        self.keys.turns(shard),
                        since_ms,
                        top,
                        start=offset,
                        num=page,
                        withscores=True,
                    )
                for tid, score in cast(list[tuple[bytes, float]], rows):  # withscores: pairs
                    yield text(tid), int(score)
                if len(rows) < page:
                    break
                offset += page

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
        """Move a bad record aside (same slot) and out of the in-progress index. Its bodies
        stay where they are: the record moved aside still names them."""
        key, dest = self.keys.turn(turn_id), self.keys.quarantined(turn_id)
        log.error("quarantining %s: %s", key, reason)
        with translated(f"quarantine {turn_id}"):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(
                    self.keys.quarantine_of(turn_id), turn_id, f"{int(time.time())}: {reason}"
                )
                pipe.srem(self.keys.in_progress_of(turn_id), turn_id)
                pipe.execute_command("RENAME", key, dest)  # redis-py blocks .rename on a cluster
                await pipe.execute(raise_on_error=False)

    async def quarantined(self) -> dict[str, str]:
        """Quarantined turn ids and the reason each was moved aside."""
        out: dict[str, str] = {}
        with translated("list quarantine"):
            for shard in self.keys.all_shards():
                for k, v in (await self.client.hgetall(self.keys.quarantine(shard))).items():
                    out[text(k)] = text(v)
        return out


async def _per_group(
    sent: list[int],
    group_of: Callable[[int], int],
    run: Callable[[list[int]], Awaitable[list[object]]],
) -> list[object]:
    """Run each group of ``sent`` (by ``group_of``: a shard, a slot) at once; the replies in
    the order of ``sent``."""
    groups: dict[int, list[int]] = {}
    for i in sent:
        groups.setdefault(group_of(i), []).append(i)
    results = await asyncio.gather(*(run(g) for g in groups.values()))
    out: dict[int, object] = {}
    for group, replies in zip(groups.values(), results, strict=True):
        out.update(zip(group, replies, strict=True))
    return [out[i] for i in sent]


def acked(record: CheckpointRecord, answer: SaveAck | Exception) -> SaveAck:
    """A save's answer as its ack (a replay of a save that landed is one), else raised."""
    if isinstance(answer, AlreadySaved):
        return SaveAck(record.turn_id, record.epoch, record.seq, REPLAYED)
    if isinstance(answer, Exception):
        raise answer
    return answer


def landed(answer: SaveAck | StoreError) -> bool | None:
    """Whether a save is in Redis: True (acked, or found already stored), False (refused by
    its fence or never sent), None (it may or may not have landed)."""
    if isinstance(answer, SaveAck | AlreadySaved):
        return True
    if isinstance(answer, StaleOwner | RecordTooLarge | TurnExists | RecordError):
        return False
    return None


def _pairs(key: str, reply: object) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """The load script's ``{record, bodies}`` as two mappings (RecordError if malformed)."""
    if not isinstance(reply, list) or len(reply) != 2:
        raise RecordError(key, f"load script answered {reply!r:.80}")
    out: list[dict[bytes, bytes]] = []
    for flat in reply:
        if not isinstance(flat, list) or len(flat) % 2:
            raise RecordError(key, "load script answered an odd list")
        out.append({raw_bytes(flat[i]): raw_bytes(flat[i + 1]) for i in range(0, len(flat), 2)})
    return out[0], out[1]
