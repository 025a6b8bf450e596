"""The checkpoint store contract, run on fakeredis and on a real redis-server alike."""

from __future__ import annotations

import asyncio
import gc

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
from store.checkpoint import REPLAYED, RedisCheckpointStore
from store.codec import EncodedRecord, encode_record
from store.connection import connect
from store.keys import KeyLayout
from store.records import Message, Outcome, SaveAck, TurnSpec
from tests.records_helpers import record


@pytest.fixture
def store(any_client: aioredis.Redis, keys: KeyLayout) -> RedisCheckpointStore:
    return RedisCheckpointStore(any_client, keys)


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
        ["schema", "turn_id", "session_id", "epoch", "seq", "phase", "in_progress", "reason",
         "messages", "meta", "baseline", "counters", "updated_at"]
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


async def test_stale_epoch_is_refused(store: RedisCheckpointStore) -> None:
    await store.save(record(epoch=2, seq=5))
    with pytest.raises(StaleOwner, match="epoch 1 is stale"):
        await store.save(record(epoch=1, seq=9, n_turn_messages=4))
    assert (await store.load("t1")).epoch == 2


async def test_seq_not_newer_is_refused_and_a_replay_is_an_ack(
    store: RedisCheckpointStore,
) -> None:
    await store.save(record(seq=5, n_turn_messages=2))
    with pytest.raises(StaleOwner, match="not newer"):
        await store.save(record(seq=4, n_turn_messages=1))
    # the same epoch and seq again: a client's resend of a save that landed, not a zombie
    (replay,) = await store.save_many([record(seq=5, n_turn_messages=1)])
    assert isinstance(replay, AlreadySaved) and not isinstance(replay, StaleOwner)
    ack = await store.save(record(seq=5, n_turn_messages=1))
    assert (ack.seq, ack.event_id) == (5, REPLAYED)
    stored = await store.load("t1")
    assert stored.seq == 5 and len(stored.messages) == 4


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
        async def queue_save(
            self,
            pipe: aioredis.client.Pipeline,
            rec: EncodedRecord,
            *,
            spec: tuple[str, bytes] | None = None,
        ) -> None:
            await super().queue_save(pipe, rec, spec=spec)
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
        ({"messages": b"\xc1not msgpack"}, RecordError, "undecodable"),
        ({"schema": b"99"}, UnknownSchema, "unknown schema 99"),
        ({"meta": msgpack.packb([])}, RecordError, "meta has 0 entries"),
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
        for k in (keys.turn("x"), keys.spec("x"), keys.tools("x"), keys.events_of("x"),
                  keys.in_progress_of("x"), keys.inbox("x"), keys.quarantined("x"))
    }  # fmt: skip
    assert len(tags) == 1 and tags.pop().startswith(f"{keys.namespace}:{{s")


async def test_many_concurrent_commits_on_a_small_pool_all_finish(
    redis_url: str, keys: KeyLayout
) -> None:
    # A commit once held two connections at once (WATCH + reader): 50 of them on a pool of 4
    # each took one and waited forever for the second. A commit must never need two.
    client = connect(redis_url, max_connections=4)
    try:
        store = RedisCheckpointStore(client, keys)
        saves = [store.save(record(f"p{i}", seq=1)) for i in range(50)]
        acks = await asyncio.wait_for(asyncio.gather(*saves), 30)
        assert {a.turn_id for a in acks} == {f"p{i}" for i in range(50)}
    finally:
        await client.aclose()


def test_wire_form_rejects_a_bad_hash_and_keeps_a_good_one() -> None:
    good = EncodedRecord.of(record("w1", seq=2))
    again = EncodedRecord.from_wire(good.to_wire())
    assert (again.turn_id, again.epoch, again.seq, again.in_progress) == ("w1", 1, 2, True)
    assert again.fields == good.fields
    for bad in (
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({**good.fields, "extra": 1}),
        msgpack.packb({**good.fields, "epoch": "1"}),
        msgpack.packb({**good.fields, "phase": "dancing"}),
        msgpack.packb({**good.fields, "reason": "whim"}),
        msgpack.packb({**good.fields, "schema": 99}),
        msgpack.packb({**good.fields, "in_progress": 2}),
    ):
        with pytest.raises(ValueError):
            EncodedRecord.from_wire(bad)


@pytest.mark.parametrize("extra", [0, 13, 14, 15, 70_000])
async def test_memoised_packing_is_the_plain_msgpack_of_the_transcript(
    store: RedisCheckpointStore, extra: int
) -> None:
    base = record("m1", seq=2)  # 2 messages; 15/16 and 65535/65536 cross array header sizes
    msgs = base.messages + tuple(Message(role="user", text=f"m{i}") for i in range(extra))
    meta = base.meta + tuple(base.meta[-1].model_copy(update={"message_id": f"x{i}"})
                             for i in range(extra))  # fmt: skip
    r = base.model_copy(update={"messages": msgs, "meta": meta})
    plain = msgpack.packb([m.model_dump(mode="json", exclude_defaults=True) for m in msgs])
    first, second = encode_record(r), encode_record(r)  # the second one from the memo
    assert first == second and first["messages"] == plain
    # a shorter list (compaction) reuses memoised entries and reads back exactly
    short = r.model_copy(update={"seq": 3, "messages": msgs[:1], "meta": meta[:1], "baseline": 1})
    await store.save(r)
    await store.save(short)
    assert await store.load("m1") == short


def test_packing_memo_forgets_collected_messages() -> None:
    from store.codec import _PACKED_MESSAGES  # the memo is private; its size is the point

    before = len(_PACKED_MESSAGES._packed)
    r = record("gone", seq=1).model_copy(
        update={"messages": tuple(Message(role="user", text=str(i)) for i in range(50)),
                "meta": tuple(record("gone").meta[0] for _ in range(50))}
    )  # fmt: skip
    encode_record(r)
    assert len(_PACKED_MESSAGES._packed) >= before + 50
    del r
    gc.collect()
    assert len(_PACKED_MESSAGES._packed) <= before


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
    """Issue 11 defect 2: a string where a turn's hash belongs used to stop every resume."""
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
    """Issue 11 defect 5: inspect returned it, resume left the real turn in progress."""
    await store.save(record("other", n_turn_messages=1))
    await any_client.copy(keys.turn("other"), keys.turn("mine"))
    await any_client.sadd(keys.in_progress_of("mine"), "mine")
    with pytest.raises(RecordError, match="holds turn 'other', not 'mine'"):
        await store.load("mine")
    assert "mine" in await store.quarantined()
    assert (await store.load("other")).turn_id == "other"


@pytest.mark.parametrize("field", ["seq", "epoch"])
async def test_a_fence_past_what_the_save_script_compares_exactly_is_quarantined(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout, field: str
) -> None:
    """Issue 11 defect 5: a seq past 2^63 made its turn 'fenced' on every resume forever."""
    await store.save(record())
    await any_client.hset(keys.turn("t1"), field, str(2**63))
    with pytest.raises(RecordError, match="less than or equal to 9007199254740991"):
        await store.load("t1")
    assert "t1" in await store.quarantined()


async def test_a_record_over_the_size_cap_is_refused_before_it_is_sent(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """Issue 11 defect 6: past proto-max-bulk-len the connection reset and the save retried."""
    small = RedisCheckpointStore(any_client, keys, max_record_bytes=4096)
    await small.save(record("t1", n_turn_messages=1))
    big = record("t1", seq=2).model_copy(
        update={"messages": (*record().messages[:1], Message(role="user", text="x" * 5000))}
    )
    (answer,) = await small.save_many([big])
    assert isinstance(answer, RecordTooLarge) and "over the 4,096-byte cap" in str(answer)
    assert (await small.load("t1")).seq == 1  # the last checkpoint is intact
