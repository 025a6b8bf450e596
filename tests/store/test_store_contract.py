"""The checkpoint store contract, run on fakeredis and on a real redis-server alike."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from bus.errors import (
    AlreadySaved,
    RecordError,
    RecordNotFound,
    RecordTooLarge,
    StaleOwner,
    StoreError,
    TurnExists,
    UnknownSchema,
)
from bus.messages import Message, ToolCall, ToolResult, Usage
from bus.outcomes import Outcome, SaveReason
from bus.phase import TurnPhase
from store.codec import EncodedRecord, pack_model
from store.domain.inbox import Inbox
from store.domain.ledger import ToolLedger
from store.domain.retention import Retention, TurnPurger
from store.domain.usage import FencedWrite, agent_usage, fenced_writes
from store.keys import KeyLayout
from store.records import (
    SCHEMA_VERSION,
    CheckpointRecord,
    Counters,
    LedgerEntry,
    MessageMeta,
    SaveAck,
    Settle,
    TurnSpec,
)
from store.redis.connection import connect
from store.write import transaction
from store.write.checkpoint import RedisCheckpointStore
from store.write.group_commit import GroupCommit
from store.write.save_script import REPLAYED, SaveCall
from store.write.transaction import AtomicSave
from store.write.transcript import CHUNK, KnownBodies, Plan, Transcript
from tests.support.records import record


@pytest.fixture(params=list(AtomicSave))
def atomic(request: pytest.FixtureRequest) -> AtomicSave:
    """Every contract test runs on both atomic paths (and, by ``any_client``, on both
    servers)."""
    return AtomicSave(request.param)


@pytest.fixture
def store(any_client: aioredis.Redis, keys: KeyLayout, atomic: AtomicSave) -> RedisCheckpointStore:
    return RedisCheckpointStore(any_client, keys, atomic=atomic)


async def events(client: aioredis.Redis, keys: KeyLayout, turn_id: str) -> list[dict[bytes, bytes]]:
    return [f for _, f in await client.xrange(keys.events_of(turn_id))]


async def test_save_then_load_round_trips_every_field(store: RedisCheckpointStore) -> None:
    rec = record(n_turn_messages=3)
    ack = await store.save(rec)
    assert (ack.turn_id, ack.epoch, ack.seq) == ("t1", 1, 1)
    assert await store.load("t1") == rec


async def test_every_field_is_written_on_every_save(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await store.save(record())
    raw = await any_client.hgetall(keys.turn("t1"))
    assert sorted(k.decode() for k in raw) == sorted(
        ["schema", "turn_id", "session_id", "agent", "epoch", "seq", "phase", "in_progress",
         "reason", "chunks", "tail", "length", "baseline", "counters", "updated_at"]
    )  # fmt: skip


async def test_save_publishes_event_and_maintains_in_progress_index(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await store.save(record("a", seq=1))
    await store.save(record("b", seq=1))
    assert await store.list_in_progress() == ["a", "b"]
    await store.save(record("a", seq=2, in_progress=False, reason="final"))
    assert await store.list_in_progress() == ["b"]
    evs = await events(any_client, keys, "a")
    assert [(e[b"seq"], e[b"reason"], e[b"in_progress"]) for e in evs] == [
        (b"1", b"tool_batch", b"1"), (b"2", b"final", b"0")
    ]  # fmt: skip


async def test_stale_epoch_is_refused_and_counted(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await store.save(record(epoch=2, seq=5))
    with pytest.raises(StaleOwner, match="epoch 1 is stale"):
        await store.save(record(epoch=1, seq=9, n_turn_messages=4))
    assert (await store.load("t1")).epoch == 2
    # Redis counts the refusal itself (a writer that died with it unread is counted too); a
    # seq that is not newer, the same owner's own resend, is no fenced write.
    with pytest.raises(StaleOwner, match="not newer"):
        await store.save(record(epoch=2, seq=4))
    assert (await fenced_writes(any_client, keys))[FencedWrite.SAVE] == 1


async def test_seq_not_newer_is_refused_and_a_replay_is_an_ack(
    store: RedisCheckpointStore,
) -> None:
    await store.save(record(seq=5, n_turn_messages=2))
    with pytest.raises(StaleOwner, match="not newer"):
        await store.save(record(seq=4, n_turn_messages=1))
    # the same record again: a client's resend of a save that landed, not a zombie
    (replay,) = await store.save_many([record(seq=5, n_turn_messages=2)])
    assert isinstance(replay, AlreadySaved) and not isinstance(replay, StaleOwner)
    ack = await store.save(record(seq=5, n_turn_messages=2))
    assert (ack.seq, ack.event_id) == (5, REPLAYED)
    stored = await store.load("t1")
    assert stored.seq == 5 and len(stored.messages) == 4


async def test_a_rivals_different_record_at_the_stored_epoch_and_seq_is_stale(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """Two resumers that read the same record claim the same (epoch, seq) at once: the second
    is fenced, not told its claim landed. Were it acked, both would own the epoch, and the
    loser's next delta would name bodies only its own records had (a missing body, found by a
    chaos test, quarantined the turn)."""
    r = record("cc", n_turn_messages=6)
    await store.save(r)
    a = RedisCheckpointStore(any_client, keys, atomic=store.atomic)
    b = RedisCheckpointStore(any_client, keys, atomic=store.atomic)
    claim = r.model_copy(update={"epoch": 2, "seq": 2, "reason": SaveReason.RESUME})
    won = claim.model_copy(update={"updated_at": 2000})
    await a.save(won)
    with pytest.raises(StaleOwner, match="not newer") as refused:
        await b.save(claim.model_copy(update={"updated_at": 2001}))
    assert not isinstance(refused.value, AlreadySaved)
    assert len(b.known) == 0  # the loser knows nothing of the turn's bodies
    # The winner goes on with deltas; the stored turn stays whole.
    after = grown(won, 2, seq=3)
    await a.save(after)
    assert await store.load("cc") == after
    assert await bodies_of(any_client, keys, "cc") == set(
        Transcript.of(after.messages, after.meta).bodies
    )


async def test_group_commit_answers_each_record_and_isolates_refusals(
    store: RedisCheckpointStore,
) -> None:
    await store.save(record("stale", epoch=3, seq=1))
    batch = [record(f"t{i}", seq=1, n_turn_messages=i) for i in range(20)]
    batch.insert(7, record("stale", epoch=2, seq=9))
    batch.append(record("t3", seq=2, n_turn_messages=9))  # same turn twice: applied in order
    results = await store.save_many(batch)
    assert isinstance(results[7], StaleOwner)
    assert all(isinstance(r, SaveAck) for i, r in enumerate(results) if i != 7)
    assert (await store.load("stale")).epoch == 3
    assert (await store.load("t3")).seq == 2 and len((await store.load("t3")).messages) == 11
    assert len(await store.list_in_progress()) == 21


async def test_submit_many_refuses_only_the_duplicates(store: RedisCheckpointStore) -> None:
    def spec(t: str) -> TurnSpec:
        return TurnSpec(turn_id=t, session_id="s", scenario={"name": "x"}, created_at=1)

    await store.submit(spec("b"), record("b", seq=0))
    results = await store.submit_many([(spec(t), record(t, seq=0)) for t in ("a", "b", "c")])
    assert [type(r).__name__ for r in results] == ["SaveAck", "TurnExists", "SaveAck"]
    assert (await store.load_spec("c")).turn_id == "c"


async def test_newer_epoch_takes_over_with_a_newer_seq(store: RedisCheckpointStore) -> None:
    await store.save(record(epoch=1, seq=3))
    await store.save(record(epoch=2, seq=4))
    with pytest.raises(StaleOwner):  # the old owner, even with a higher seq
        await store.save(record(epoch=1, seq=10))
    assert (await store.load("t1")).epoch == 2


async def test_a_save_interrupted_before_it_is_sent_leaves_the_previous_record_whole(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    class DiesBeforeSending(RedisCheckpointStore):
        def _save_call(self, rec: EncodedRecord, spec: tuple[str, bytes] | None) -> SaveCall:
            super()._save_call(rec, spec)
            raise ConnectionError("process died before the save was sent")

    good = RedisCheckpointStore(any_client, keys)
    before = record(seq=1, n_turn_messages=2)
    await good.save(before)
    n_events = len(await events(any_client, keys, "t1"))
    with pytest.raises(StoreError, match="died before the save was sent"):
        await DiesBeforeSending(any_client, keys).save(record(seq=2, n_turn_messages=7))
    assert await good.load("t1") == before
    assert len(await events(any_client, keys, "t1")) == n_events
    await good.save(record(seq=2, n_turn_messages=3))  # the store is still usable
    assert len((await good.load("t1")).messages) == 5


async def test_submit_creates_spec_and_record_once(store: RedisCheckpointStore) -> None:
    spec = TurnSpec(turn_id="t1", session_id="s1", scenario={"name": "x"}, created_at=1)
    await store.submit(spec, record(seq=0))
    assert await store.load_spec("t1") == spec
    with pytest.raises(TurnExists):
        await store.submit(spec, record(seq=0))


async def test_load_of_missing_turn(store: RedisCheckpointStore) -> None:
    with pytest.raises(RecordNotFound):
        await store.load("nope")


@pytest.mark.parametrize(
    ("corrupt", "error", "message"),
    [
        ({"tail": b"\xc1not digests"}, RecordError, "not a whole number"),
        ({"schema": b"99"}, UnknownSchema, "unknown schema 99"),
        ({"length": b"9"}, RecordError, "its length says 9"),
        ({"tail": b"\x00" * 48}, RecordError, "is missing"),  # 3 digests, as many as before
        ({"phase": b"sleeping"}, RecordError, "undecodable"),
        ({"reason": b"because"}, RecordError, "undecodable"),
        ({"counters": msgpack.packb({"outcome": "fenced"})}, RecordError, "undecodable"),
        ({"epoch": b"one"}, RecordError, "undecodable"),
        ({"extra": b"1"}, RecordError, "unexpected fields"),
    ],
)
async def test_a_bad_record_is_quarantined_while_others_load(
    store: RedisCheckpointStore,
    any_client: aioredis.Redis,
    keys: KeyLayout,
    corrupt: dict[str, bytes],
    error: type[RecordError],
    message: str,
) -> None:
    await store.save(record("good", n_turn_messages=1))
    await store.save(record("bad", n_turn_messages=1))
    await any_client.hset(keys.turn("bad"), mapping=corrupt)  # type: ignore[arg-type]
    scan = await store.load_in_progress()
    assert [r.turn_id for r in scan.records] == ["good"]
    (err,) = scan.errors
    assert isinstance(err, error) and message in str(err)
    assert err.key == keys.turn("bad")
    assert not await any_client.exists(keys.turn("bad"))
    assert await any_client.exists(keys.quarantined("bad"))
    assert message in (await store.quarantined())["bad"]
    assert await store.list_in_progress() == ["good"]


async def test_a_record_written_before_outcomes_were_typed_reads_the_same(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """Records of this schema once stored a running turn's outcome as an empty string."""
    await store.save(record("old", n_turn_messages=1))
    legacy = {"outcome": "", "resume_attempts": 1}
    await any_client.hset(keys.turn("old"), "counters", msgpack.packb(legacy))
    loaded = await store.load("old")
    assert loaded.counters.outcome is None and loaded.counters.resume_attempts == 1
    ended = {"outcome": "aborted:hard_idle_timeout"}
    await any_client.hset(keys.turn("old"), "counters", msgpack.packb(ended))
    outcome = (await store.load("old")).counters.outcome
    assert outcome is Outcome.ABORTED_HARD_IDLE_TIMEOUT and outcome.aborted


async def test_missing_field_is_quarantined(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await store.save(record())
    await any_client.hdel(keys.turn("t1"), "counters")
    with pytest.raises(RecordError, match="missing fields"):
        await store.load("t1")
    assert "t1" in await store.quarantined()


async def test_keys_of_a_turn_share_one_hash_tag(keys: KeyLayout) -> None:
    tags = {
        k.split("}")[0]
        for k in (keys.turn("x"), keys.bodies("x"), keys.spec("x"), keys.tools("x"),
                  keys.events_of("x"),
                  keys.in_progress_of("x"), keys.inbox("x"), keys.quarantined("x"))
    }  # fmt: skip
    assert len(tags) == 1 and tags.pop().startswith(f"{keys.namespace}:{{s")


async def test_many_concurrent_commits_on_a_small_pool_all_finish(
    redis_url: str, keys: KeyLayout, atomic: AtomicSave
) -> None:
    # A commit once held two connections at once (WATCH + reader): 50 of them on a pool of 4
    # each took one and waited forever for the second. A commit must never need two.
    client = connect(redis_url, max_connections=4)
    try:
        store = RedisCheckpointStore(client, keys, atomic=atomic)
        saves = [store.save(record(f"p{i}", seq=1)) for i in range(50)]
        acks = await asyncio.wait_for(asyncio.gather(*saves), 30)
        assert {a.turn_id for a in acks} == {f"p{i}" for i in range(50)}
    finally:
        await client.aclose()


def test_wire_form_rejects_a_bad_hash_and_keeps_a_good_one() -> None:
    good = EncodedRecord.of(record("w1", seq=2))
    again = EncodedRecord.from_wire(good.to_wire())
    assert (again.turn_id, again.epoch, again.seq, again.in_progress) == ("w1", 1, 2, True)
    assert (again.fields, again.puts, again.replace) == (good.fields, good.puts, True)
    parts = msgpack.unpackb(good.to_wire())
    (address, body), *_ = good.puts.items()

    def wire(**change: object) -> bytes:
        return msgpack.packb({**parts, **change}, use_bin_type=True)

    def fields(**change: object) -> bytes:
        return wire(fields={**good.fields, **change})

    for bad in (
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb(good.fields),  # a bare hash is not a save
        fields(extra=1),
        fields(epoch="1"),
        fields(phase="dancing"),
        fields(reason="whim"),
        fields(schema=99),
        fields(schema=1),
        fields(in_progress=2),
        fields(tail=b"\x01" * 15),
        wire(puts={address: body + b"x"}),  # a body under another's digest
        wire(puts=[body]),
        wire(drops=[b"short"]),
        wire(replace=1),
        wire(nbytes=-1),
    ):
        with pytest.raises(ValueError):
            EncodedRecord.from_wire(bad)
    # A host cannot slip a save past the size cap by under-reporting it.
    assert EncodedRecord.from_wire(wire(nbytes=0)).nbytes >= len(body)


@pytest.mark.parametrize("extra", [0, 29, 30, 31, 62, 1000])
async def test_memoised_bodies_are_the_plain_msgpack_of_each_entry(
    store: RedisCheckpointStore, extra: int
) -> None:
    base = record("m1", seq=2)  # 2 messages; 31/32/33 and 64 cross chunk boundaries
    msgs = base.messages + tuple(Message(role="user", text=f"m{i}") for i in range(extra))
    meta = base.meta + tuple(base.meta[-1].model_copy(update={"message_id": f"x{i}"})
                             for i in range(extra))  # fmt: skip
    r = base.model_copy(update={"messages": msgs, "meta": meta})
    first, second = Transcript.of(msgs, meta), Transcript.of(msgs, meta)  # second: the memo
    assert first == second
    plain = msgpack.packb(
        [msgs[-1].model_dump(mode="json", exclude_defaults=True),
         meta[-1].model_dump(mode="json", exclude_defaults=True)]
    )  # fmt: skip
    assert plain in first.bodies.values()
    assert first.length == len(msgs) and len(first.chunks) == 16 * (len(msgs) // CHUNK)
    # a shorter list (compaction) reuses memoised entries and reads back exactly
    short = r.model_copy(update={"seq": 3, "messages": msgs[:1], "meta": meta[:1], "baseline": 1})
    await store.save(r)
    await store.save(short)
    assert await store.load("m1") == short


def test_body_memo_forgets_collected_messages() -> None:
    from store.write.transcript import _ENTRIES  # the memo is private; its size is the point

    before = len(_ENTRIES)
    r = record("gone", seq=1).model_copy(
        update={"messages": tuple(Message(role="user", text=str(i)) for i in range(50)),
                "meta": tuple(record("gone").meta[0] for _ in range(50))}
    )  # fmt: skip
    Transcript.of(r.messages, r.meta)
    assert len(_ENTRIES) >= before + 50
    del r
    gc.collect()
    assert len(_ENTRIES) <= before


async def test_unreadable_stored_fence_is_a_record_error(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await any_client.hset(keys.turn("t1"), mapping={"epoch": "one", "seq": "1"})
    with pytest.raises(RecordError, match="unreadable"):
        await store.save(record(seq=2))
    assert await any_client.hget(keys.turn("t1"), "epoch") == b"one"  # nothing written


async def test_a_redis_error_on_one_save_fails_only_that_save(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await any_client.set(keys.turn("broken"), b"not a hash")
    results = await store.save_many([record("ok1"), record("broken"), record("ok2")])
    assert isinstance(results[1], StoreError) and "broken" in str(results[1])
    assert isinstance(results[0], SaveAck) and isinstance(results[2], SaveAck)
    assert await store.list_in_progress() == ["ok1", "ok2"]


async def test_a_key_of_the_wrong_type_is_quarantined_while_others_load(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """a string where a turn's hash belongs used to stop every resume."""
    await store.save(record("good", n_turn_messages=1))
    await any_client.set(keys.turn("str"), b"not a hash")
    await any_client.sadd(keys.in_progress_of("str"), "str")
    scan = await store.load_in_progress()
    assert [r.turn_id for r in scan.records] == ["good"]
    (err,) = scan.errors
    assert isinstance(err, RecordError) and "wrong Redis type" in str(err)
    assert "wrong Redis type" in (await store.quarantined())["str"]
    assert await store.list_in_progress() == ["good"]
    await any_client.hset(keys.spec("good"), "a", "b")  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="wrong Redis type"):
        await store.load_spec("good")


async def test_a_record_under_another_turns_key_is_quarantined(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """inspect returned it, resume left the real turn in progress."""
    # in the same shard as "other": on a cluster COPY stays within one slot
    mine = next(
        f"mine{i}" for i in range(99) if keys.shard_of(f"mine{i}") == keys.shard_of("other")
    )
    await store.save(record("other", n_turn_messages=1))
    await any_client.copy(keys.turn("other"), keys.turn(mine))
    await any_client.copy(keys.bodies("other"), keys.bodies(mine))
    await any_client.sadd(keys.in_progress_of(mine), mine)
    with pytest.raises(RecordError, match=f"holds turn 'other', not '{mine}'"):
        await store.load(mine)
    assert mine in await store.quarantined()
    assert (await store.load("other")).turn_id == "other"


@pytest.mark.parametrize("field", ["seq", "epoch"])
async def test_a_fence_past_what_the_save_script_compares_exactly_is_quarantined(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout, field: str
) -> None:
    """a seq past 2^63 made its turn 'fenced' on every resume forever."""
    await store.save(record())
    await any_client.hset(keys.turn("t1"), field, str(2**63))
    with pytest.raises(RecordError, match="less than or equal to 9007199254740991"):
        await store.load("t1")
    assert "t1" in await store.quarantined()


async def test_a_record_over_the_size_cap_is_refused_before_it_is_sent(
    any_client: aioredis.Redis, keys: KeyLayout, atomic: AtomicSave
) -> None:
    """past proto-max-bulk-len the connection reset and the save retried."""
    small = RedisCheckpointStore(any_client, keys, max_record_bytes=4096, atomic=atomic)
    await small.save(record("t1", n_turn_messages=1))
    big = record("t1", seq=2).model_copy(
        update={"messages": (*record().messages[:1], Message(role="user", text="x" * 5000))}
    )
    (answer,) = await small.save_many([big])
    assert isinstance(answer, RecordTooLarge) and "over the 4,096-byte cap" in str(answer)
    assert (await small.load("t1")).seq == 1  # the last checkpoint is intact


async def bodies_of(client: aioredis.Redis, keys: KeyLayout, turn_id: str) -> set[bytes]:
    return set(await client.hkeys(keys.bodies(turn_id)))


def grown(base: CheckpointRecord, n: int, *, seq: int) -> CheckpointRecord:
    """``base`` with ``n`` more messages (the same objects for the ones it had)."""
    msgs = base.messages + tuple(
        Message(role="assistant", text=f"later {len(base.messages) + i}") for i in range(n)
    )
    meta = base.meta + tuple(
        MessageMeta(source="llm", message_id=f"later{len(base.meta) + i}", at_ms=i)
        for i in range(n)
    )
    return base.model_copy(update={"seq": seq, "messages": msgs, "meta": meta})


async def test_a_turn_stores_each_body_once_and_exactly_what_its_record_names(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    r = record("ca", n_turn_messages=8)
    await store.save(r)
    for seq in range(2, 40):  # 2 messages per save, across several chunks
        r = grown(r, 2, seq=seq)
        await store.save(r)
        assert await bodies_of(any_client, keys, "ca") == set(
            Transcript.of(r.messages, r.meta).bodies
        )
    assert len(r.messages) == 86 and await store.load("ca") == r
    # Compaction is a new, shorter list: what it cut is dropped in the same save.
    summary = Message(role="assistant", text="summary of the first 80")
    short = r.model_copy(
        update={
            "seq": 40,
            "messages": (*r.messages[:2], summary, *r.messages[-3:]),
            "meta": (*r.meta[:2], MessageMeta(source="system", message_id="sum", at_ms=9),
                     *r.meta[-3:]),
            "reason": SaveReason.COMPACTION,
        }
    )  # fmt: skip
    await store.save(short)
    assert await bodies_of(any_client, keys, "ca") == set(
        Transcript.of(short.messages, short.meta).bodies
    )
    assert await store.load("ca") == short


async def test_a_save_sends_only_the_bodies_the_store_lacks(store: RedisCheckpointStore) -> None:
    r = record("cb", n_turn_messages=100)
    await store.save(r)
    nxt = grown(r, 2, seq=2)
    enc = EncodedRecord.of(nxt, store.known)
    assert not enc.replace and len(enc.puts) == 2 and enc.drops == ()
    assert enc.sent_bytes < EncodedRecord.of(nxt).sent_bytes / 10
    (ack,) = await store.save_many([enc])
    assert isinstance(ack, SaveAck) and await store.load("cb") == nxt


async def test_a_refused_save_writes_and_drops_nothing(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """A zombie that knows the turn (it saved it) sends a delta that would drop bodies the new
    owner's record still names: the fence refuses it before any body is touched."""
    zombie = RedisCheckpointStore(any_client, keys, atomic=store.atomic)
    r = record("cz", n_turn_messages=40)
    await zombie.save(r)
    owner = r.model_copy(update={"epoch": 2, "seq": 2, "reason": SaveReason.RESUME})
    await store.save(grown(owner, 2, seq=3))
    before = await any_client.hgetall(keys.bodies("cz"))
    compacted = r.model_copy(update={"seq": 5, "messages": r.messages[:3], "meta": r.meta[:3]})
    late = EncodedRecord.of(compacted, zombie.known)
    assert len(late.drops) > 30 and not late.replace  # what it would have dropped
    with pytest.raises(StaleOwner):
        await zombie.save(compacted)
    assert await any_client.hgetall(keys.bodies("cz")) == before
    assert (await store.load("cz")).messages == grown(owner, 2, seq=3).messages


async def test_a_writer_that_does_not_know_the_turn_replaces_its_bodies(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """A new epoch, a lost answer or a restarted writer: the save sends every body and
    sweeps whatever else the hash held (here, a crashed writer's leftovers)."""
    r = record("cr", n_turn_messages=3)
    await store.save(r)
    await any_client.hset(keys.bodies("cr"), b"\x01" * 16, b"left behind")
    fresh = RedisCheckpointStore(any_client, keys, atomic=store.atomic)
    claim = r.model_copy(update={"epoch": 2, "seq": 2, "reason": SaveReason.RESUME})
    assert EncodedRecord.of(claim, fresh.known).replace
    await fresh.save(claim)
    assert await bodies_of(any_client, keys, "cr") == set(Transcript.of(r.messages, r.meta).bodies)
    assert await store.load("cr") == claim


def test_known_bodies_forget_a_turn_whose_save_may_or_may_not_have_landed() -> None:
    known = KnownBodies()
    r = record("ck", n_turn_messages=4)
    t = Transcript.of(r.messages, r.meta)
    assert known.plan("ck", 1, 1, t).replace
    known.settle("ck", 1, landed=True, in_progress=True)
    assert known.plan("ck", 1, 2, t) == Plan({}, (), replace=False)
    known.settle("ck", 2, landed=None, in_progress=True)  # no answer
    assert known.plan("ck", 1, 3, t).replace
    known.settle("ck", 3, landed=True, in_progress=True)
    assert not known.plan("ck", 1, 4, t).replace
    known.settle("ck", 4, landed=False, in_progress=True)  # refused: fenced
    assert known.plan("ck", 1, 5, t).replace
    known.settle("ck", 5, landed=True, in_progress=False)  # final: nothing follows
    assert len(known) == 0
    assert known.plan("ck", 2, 6, t).replace  # a new epoch always replaces
    small = KnownBodies(max_turns=2)
    for turn in ("a", "b", "c"):
        small.plan(turn, 1, 1, t)
        small.settle(turn, 1, landed=True, in_progress=True)
    assert len(small) == 2 and small.plan("a", 1, 2, t).replace


SCHEMA1 = Path(__file__).parents[1] / "support" / "data" / "schema1-record.msgpack"


def schema1_expected() -> CheckpointRecord:
    """What ``tests/support/data/schema1-record.msgpack`` (written by the schema-1 build) holds."""
    call = ToolCall(id="c1", name="add", args={"a": 2, "b": 2})
    return CheckpointRecord(
        schema_version=1,
        turn_id="legacy-1",
        session_id="legacy",
        epoch=2,
        seq=3,
        phase=TurnPhase.EXECUTING_TOOLS,
        in_progress=True,
        reason=SaveReason.TOOL_BATCH,
        messages=(
            Message(role="system", text="You are terse."),
            Message(role="user", text="What is 2+2? Use the tool."),
            Message(role="assistant", tool_calls=(call,)),
            Message(role="tool", tool_result=ToolResult(call_id="c1", name="add", status="ok",
                                                        output="4")),
        ),
        meta=(
            MessageMeta(source="prompt", message_id="legacy-sys", at_ms=1700000000000),
            MessageMeta(source="prompt", message_id="legacy-user", at_ms=1700000000001),
            MessageMeta(source="llm", message_id="legacy-a1", at_ms=1700000000500,
                        usage=Usage(prompt_tokens=21, completion_tokens=7)),
            MessageMeta(source="tool", message_id="legacy-t1", at_ms=1700000000600),
        ),
        baseline=2,
        counters=Counters(tool_batches=1, resume_attempts=1),
        updated_at=1700000000700,
    )  # fmt: skip


async def test_a_schema_1_record_is_read_and_its_next_save_migrates_it(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stored = msgpack.unpackb(SCHEMA1.read_bytes(), raw=True)
    await any_client.hset(keys.turn("legacy-1"), mapping=stored)
    await any_client.sadd(keys.in_progress_of("legacy-1"), "legacy-1")
    old = schema1_expected()
    assert await store.load("legacy-1") == old
    assert (await store.load_in_progress()).records == (old,)
    claim = old.model_copy(update={"epoch": 3, "seq": 4, "reason": SaveReason.RESUME})
    await store.save(claim)
    raw = await any_client.hgetall(keys.turn("legacy-1"))
    assert raw[b"schema"] == str(SCHEMA_VERSION).encode()
    assert b"messages" not in raw and b"meta" not in raw
    again = await store.load("legacy-1")
    assert again.schema_version == SCHEMA_VERSION
    assert again == claim.model_copy(update={"schema_version": SCHEMA_VERSION})
    # A schema-1 writer's late save is fenced like any other.
    with pytest.raises(StaleOwner):
        await store.save(old.model_copy(update={"seq": 9}))


async def test_a_lost_watch_race_retries_only_the_shard_that_lost(
    any_client: aioredis.Redis, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """multi_exec: a rival touches a watched record between the fence read and EXEC; that
    shard's saves are read and tried again, the other shard's transaction is not."""
    store = RedisCheckpointStore(any_client, keys, atomic=AtomicSave.MULTI_EXEC)
    a = next(f"w{i}" for i in range(99) if keys.shard_of(f"w{i}") == 0)
    b = next(f"w{i}" for i in range(99) if keys.shard_of(f"w{i}") == 1)
    await store.save_many([record(a), record(b)])
    watched: list[str] = []
    real = transaction.roundtrip

    async def racing(conn: Any, commands: list[tuple[Any, ...]]) -> list[object]:
        if commands[0][0] == "WATCH":
            watched.append(commands[0][1].split(":turn:")[1])
        if (
            commands[0][0] == "MULTI"
            and watched.count(a) == 1
            and any(c[0] == "HSET" and c[1] == keys.turn(a) for c in commands)
        ):
            await any_client.hset(keys.turn(a), "updated_at", 7)  # the rival's write
        return await real(conn, commands)

    monkeypatch.setattr(transaction, "roundtrip", racing)
    answers = await store.save_many([record(a, seq=2, n_turn_messages=1), record(b, seq=2)])
    assert all(isinstance(x, SaveAck) for x in answers), answers
    assert sorted(watched) == sorted([a, a, b])  # a read twice, b once
    assert (await store.load(a)).seq == 2 and len((await store.load(a)).messages) == 3


async def test_a_server_that_lost_its_scripts_still_saves(
    store: RedisCheckpointStore, any_client: aioredis.Redis
) -> None:
    """A restart or failover empties the script cache: NOSCRIPT saves are sent again."""
    await store.save(record("ns", seq=1))
    await any_client.script_flush()
    answers = await store.save_many([record("ns", seq=2), record("ns2", seq=1)])
    assert all(isinstance(a, SaveAck) for a in answers), answers
    assert (await store.load("ns")).seq == 2


async def test_a_schema_2_record_without_an_agent_is_read(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    rec = record(n_turn_messages=2).model_copy(update={"agent": "pkg.mod:agent"})
    await store.save(rec)
    await any_client.hdel(keys.turn("t1"), "agent")
    await any_client.hset(keys.turn("t1"), "schema", 2)
    got = await store.load("t1")
    assert (got.schema_version, got.agent) == (2, "")
    assert got.messages == rec.messages


def _finished(
    rec: CheckpointRecord, seq: int, outcome: Outcome, **counters: Any
) -> CheckpointRecord:
    c = rec.counters.model_copy(update={"outcome": outcome, **counters})
    return rec.model_copy(
        update={"seq": seq, "in_progress": False, "reason": SaveReason.FINAL, "counters": c}
    )


async def test_a_final_save_adds_the_turns_tokens_to_its_agent_once(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    used = Usage(prompt_tokens=100, completion_tokens=20, cached_tokens=64)
    for turn in ("a1", "a2"):
        rec = record(turn).model_copy(update={"agent": "pkg.mod:agent"})
        await store.save(rec)
        await store.save(rec.model_copy(update={"seq": 2, "counters": Counters(tokens=used)}))
        final = _finished(rec, 3, Outcome.ANSWERED, tokens=used, unmetered_calls=1,
                          resume_attempts=2)  # fmt: skip
        await store.save(final)
        assert (await store.save(final)).event_id == REPLAYED  # a resend adds nothing
        with pytest.raises(StaleOwner):  # nor does a zombie's late final save
            await store.save(final.model_copy(update={"seq": 3, "updated_at": 5}))
    other = record("b1").model_copy(update={"agent": "other:agent"})
    await store.save(other)
    await store.save(_finished(other, 2, Outcome.ANSWERED, tokens=Usage(prompt_tokens=7)))
    (a, b) = await agent_usage(any_client, keys)
    assert (a.agent, a.turns, a.unmetered_calls, a.lost_incarnations) == ("other:agent", 1, 0, 0)
    assert a.tokens == Usage(prompt_tokens=7)
    assert (b.agent, b.turns, b.unmetered_calls, b.lost_incarnations) == ("pkg.mod:agent", 2, 2, 4)
    assert b.tokens == Usage(prompt_tokens=200, completion_tokens=40, cached_tokens=128)


async def test_a_suspended_turn_is_added_when_it_finishes_not_when_it_parks(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    rec = record("p1").model_copy(update={"agent": "pkg.mod:agent"})
    await store.save(rec)
    used = Usage(prompt_tokens=10)
    parked = _finished(rec, 2, Outcome.SUSPENDED_POISON, tokens=used)
    await store.save(parked.model_copy(update={"reason": SaveReason.SUSPENDED}))
    assert await agent_usage(any_client, keys) == []
    back = rec.model_copy(update={"epoch": 2, "seq": 3, "counters": Counters(tokens=used)})
    await store.save(back)
    await store.save(_finished(back, 4, Outcome.ANSWERED, tokens=used))
    (a,) = await agent_usage(any_client, keys)
    assert (a.turns, a.tokens) == (1, used)


async def test_submitted_turns_are_listed_newest_first_from_the_index(
    store: RedisCheckpointStore,
) -> None:
    for i, at in enumerate((1000, 3000, 2000, 4000)):
        rec = record(f"ix{i}").model_copy(update={"updated_at": at, "seq": 0})
        spec = TurnSpec(turn_id=f"ix{i}", session_id="s1", agent="a.b:c",
                        input={"message": "hi"}, created_at=at)  # fmt: skip
        await store.submit(spec, rec)
    await store.save(record("ix0").model_copy(update={"seq": 1, "updated_at": 9000}))
    listed = await store.list_turns()
    assert listed == [("ix3", 4000), ("ix1", 3000), ("ix2", 2000), ("ix0", 1000)]  # by submission
    assert await store.list_turns(limit=2) == listed[:2]
    assert await store.list_turns(before_ms=3000, limit=2) == listed[2:]
    assert await store.list_turns(since_ms=2000) == listed[:3]


async def test_a_final_save_sets_the_retention_on_every_key_of_the_turn(
    any_client: aioredis.Redis, keys: KeyLayout, atomic: AtomicSave
) -> None:
    store = RedisCheckpointStore(any_client, keys, atomic=atomic,
                                 retention=Retention(finished_ttl_s=600))  # fmt: skip
    now = int(time.time() * 1000)
    for tid, at in (("old", 1000), ("r1", now)):  # "old": submitted long before the ttl
        spec = TurnSpec(turn_id=tid, session_id="s1", agent="a.b:c", input={"message": "hi"},
                        created_at=at)  # fmt: skip
        await store.submit(spec, record(tid).model_copy(update={"seq": 0, "updated_at": at}))
    for key in (keys.tools("r1"), keys.effects("r1"), keys.approval("r1")):
        await any_client.hset(key, "k", "v")
    await any_client.rpush(keys.inbox("r1"), b"x")
    turn_keys = [keys.turn("r1"), keys.bodies("r1"), keys.spec("r1"), keys.tools("r1"),
                 keys.effects("r1"), keys.inbox("r1"), keys.approval("r1")]  # fmt: skip
    await store.save(record("r1", seq=1))
    assert [await any_client.pttl(k) for k in turn_keys] == [-1] * 7  # running: kept
    parked = record("r1", seq=2, in_progress=False).model_copy(
        update={"counters": Counters(outcome=Outcome.SUSPENDED_POISON)}
    )
    await store.save(parked)
    assert await any_client.pttl(keys.turn("r1")) == -1  # suspended is not finished
    final = record("r1", epoch=2, seq=3, in_progress=False).model_copy(
        update={"counters": Counters(outcome=Outcome.ANSWERED)}
    )
    await store.save(final)
    ttls = [await any_client.pttl(k) for k in turn_keys]
    assert all(0 < t <= 600_000 for t in ttls), ttls
    assert await any_client.zrange(keys.turns_of("r1"), 0, -1) == [b"r1"]  # "old" trimmed


async def test_purge_removes_a_finished_turn_whole_and_never_a_running_one(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    spec = TurnSpec(turn_id="p1", session_id="s1", agent="a.b:c", input={"message": "hi"},
                    created_at=1)  # fmt: skip
    await store.submit(spec, record("p1").model_copy(update={"seq": 0}))
    await any_client.hset(keys.tools("p1"), "k", "v")
    purger = TurnPurger(any_client, keys)
    assert not await purger.purge("p1")  # in progress
    assert not await purger.purge("nope")
    await store.save(record("p1", seq=1, in_progress=False))
    assert await purger.purge("p1")
    for key in (keys.turn("p1"), keys.bodies("p1"), keys.spec("p1"), keys.tools("p1")):
        assert not await any_client.exists(key)
    assert await store.list_turns() == []


async def test_a_save_journals_the_outcomes_it_carries_even_when_it_is_fenced(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await store.save(record("t1", epoch=2, seq=1))
    entries = {k: LedgerEntry(state="dispatched", name="echo", epoch=2, writer=k) for k in "abc"}
    dispatched = {k: pack_model(e) for k, e in entries.items()}
    await any_client.hset(keys.tools("t1"), mapping=dispatched)  # type: ignore[arg-type]

    def settle(k: str) -> Settle:
        done = LedgerEntry(state="committed", name="echo", writer=f"{k}-done")
        return Settle(k, dispatched[k], pack_model(done))

    # A successor settled c meanwhile: the late outcome leaves its decision as it is.
    successor = pack_model(LedgerEntry(state="outcome_unknown", name="echo", epoch=3))
    await any_client.hset(keys.tools("t1"), "c", successor)
    await store.save(record("t1", epoch=2, seq=2), [settle("a"), settle("c")])
    ledger = ToolLedger(any_client, keys)
    states = {k: e.state for k, e in (await ledger.entries("t1")).items()}
    assert states == {"a": "committed", "b": "dispatched", "c": "outcome_unknown"}
    # A save its fence refuses journals its outcomes all the same (they are true whoever owns
    # the turn), and writes nothing else.
    with pytest.raises(StaleOwner):
        await store.save(record("t1", epoch=1, seq=9), [settle("b")])
    assert (await ledger.entries("t1"))["b"].state == "committed"
    assert (await store.load("t1")).seq == 2
    # Sent again (a lost reply): a no-op.
    await store.save(record("t1", epoch=2, seq=3), [settle("a"), settle("b")])
    assert {k: e.state for k, e in (await ledger.entries("t1")).items()} == {
        "a": "committed", "b": "committed", "c": "outcome_unknown"
    }  # fmt: skip


async def test_a_save_answers_how_long_the_turns_inbox_is(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    assert (await store.save(record("t1", seq=1))).inbox_len == 0
    inbox = Inbox(any_client, keys)
    await inbox.push("t1", "one")
    await inbox.push("t1", "two")
    assert (await store.save(record("t1", seq=2))).inbox_len == 2


async def test_concurrent_saves_share_batches_and_each_gets_its_own_answer(
    store: RedisCheckpointStore,
) -> None:
    group = GroupCommit(store)
    await store.save(record("taken", epoch=5, seq=1))
    answers = await asyncio.gather(
        *(group.save(record(f"g{i}", seq=1)) for i in range(50)),
        group.save(record("taken", epoch=1, seq=2)),
        return_exceptions=True,
    )
    assert all(isinstance(a, SaveAck) for a in answers[:50])
    assert isinstance(answers[50], StaleOwner)  # refused alone; the others landed
    assert group.batches < 10  # not one round trip and one durability wait per save
    assert (await store.load("g49")).seq == 1


async def test_a_turn_about_to_start_is_read_in_one_step(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    spec = TurnSpec(turn_id="t1", session_id="s1", scenario={"name": "x"}, created_at=1)
    rec = record(seq=0, n_turn_messages=2)
    await store.submit(spec, rec)
    await Inbox(any_client, keys).push("t1", "early")
    assert await store.load_start("t1") == (rec, spec, 1)
    await store.save(record("nospec", seq=1))
    assert (await store.load_start("nospec"))[1] is None
    with pytest.raises(RecordNotFound, match="no record"):
        await store.load_start("nope")
