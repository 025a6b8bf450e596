"""The bus contract, on the in-memory bus, fakeredis, a real redis-server and Redis Cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import fakeredis
import pytest

from bus.events import Status, StatusEvent, decode_event
from bus.phase import Transition, TurnPhase
from store.keys import KeyLayout
from store.redis.connection import StoreClient, connect
from store.views.streams import BufferedPublisher, Bus, LiveStreams, MemoryBus, RedisBus

P = TurnPhase


@pytest.fixture(params=["memory", "fakeredis", "real", "cluster"])
async def bus(
    request: pytest.FixtureRequest, redis_url: str, keys: KeyLayout
) -> AsyncIterator[Bus]:
    if request.param == "memory":
        yield MemoryBus(keys)
        return
    client: StoreClient
    if request.param == "cluster":
        client = connect(request.getfixturevalue("redis_cluster").url, cluster=True)
    else:
        client = fakeredis.FakeAsyncRedis() if request.param == "fakeredis" else connect(redis_url)
    yield RedisBus(client, keys, maxlen=1000, live=LiveStreams(maxlen=100, ttl_s=60))
    await client.aclose()


def moves(turn: str, n: int, epoch: int = 1) -> list[Transition]:
    return [
        Transition(turn, epoch, i + 1, P.AWAITING_LLM, P.EXECUTING_TOOLS, 1000 + i)
        for i in range(n)
    ]


async def test_a_group_sees_new_events_in_order_per_turn(bus: Bus) -> None:
    await bus.publish(moves("before", 2))  # published before the group exists: not seen
    await bus.ensure_group("watchdog")
    await bus.ensure_group("watchdog")  # idempotent
    sent = (
        moves("a", 3) + moves("b", 2) + [StatusEvent("a", 1, Status.IDLE_SOFT, "still waiting", 5)]
    )
    await bus.publish(sent)
    got = await bus.read("watchdog", "w1", block_ms=100)
    assert sorted(map(repr, (d.event for d in got))) == sorted(map(repr, sent))
    a = [d.event for d in got if d.event.turn_id == "a" and isinstance(d.event, Transition)]
    assert [e.seq for e in a] == [1, 2, 3]
    await bus.ack("watchdog", got)
    assert await bus.read("watchdog", "w1", block_ms=50) == []


async def test_groups_are_independent(bus: Bus) -> None:
    await bus.ensure_group("g1")
    await bus.ensure_group("g2")
    await bus.publish(moves("x", 2))
    assert len(await bus.read("g1", "c", block_ms=100)) == 2
    assert len(await bus.read("g2", "c", block_ms=100)) == 2


async def test_pending_entries_of_a_dead_consumer_are_reclaimed(bus: Bus) -> None:
    await bus.ensure_group("g")
    await bus.publish(moves("x", 3))
    taken = await bus.read("g", "dead", block_ms=100)
    assert len(taken) == 3  # never acked: the consumer died
    assert await bus.reclaim("g", "heir", min_idle_ms=60_000) == []  # not idle long enough
    again = await bus.reclaim("g", "heir", min_idle_ms=0)
    assert sorted(d.entry_id for d in again) == sorted(d.entry_id for d in taken)
    await bus.ack("g", again)
    assert await bus.reclaim("g", "heir2", min_idle_ms=0) == []


async def test_malformed_entries_go_to_dead_letters_and_others_flow(
    redis_url: str, keys: KeyLayout
) -> None:
    client = connect(redis_url)
    bus = RedisBus(client, keys)
    await bus.ensure_group("g")
    shard = keys.shard_of("x")
    await client.xadd(keys.bus(shard), {"kind": "transition", "turn_id": "x", "seq": "nope"})
    await client.xadd(keys.bus(shard), {"kind": "bogus"})
    await bus.publish(moves("x", 1))
    got = await bus.read("g", "c", block_ms=100)
    assert [d.event for d in got] == moves("x", 1)
    assert bus.dead_letters == 2
    assert await client.xlen(keys.deadletters(shard)) == 2
    pending = await client.xpending(keys.bus(shard), "g")
    assert pending["pending"] == 1  # only the good one, awaiting its ack
    await client.aclose()


async def test_streams_are_capped(redis_url: str, keys: KeyLayout) -> None:
    client = connect(redis_url)
    bus = RedisBus(client, KeyLayout(keys.namespace, shards=1), maxlen=100)
    for _ in range(10):
        await bus.publish(moves("x", 100))
    assert await client.xlen(KeyLayout(keys.namespace, shards=1).bus(0)) < 300
    await client.aclose()


@pytest.mark.parametrize("bus", ["fakeredis", "real", "cluster"], indirect=True)
async def test_every_event_reaches_its_turns_live_stream_in_order(bus: Bus) -> None:
    assert isinstance(bus, RedisBus)
    sent: list[Transition | StatusEvent] = [
        *moves("a", 3), StatusEvent("a", 1, Status.IDLE_SOFT, "still waiting", 5),
        *moves("b", 2),  # another shard's turn, very likely: several scripts in one flush
    ]  # fmt: skip
    await bus.publish(sent)
    for turn, want in (("a", 4), ("b", 2)):
        key = bus.keys.live(turn)
        got = [decode_event(f) for _, f in await bus.client.xrange(key)]
        assert [repr(e) for e in got] == [repr(e) for e in sent if e.turn_id == turn][:want]
        assert 0 < await bus.client.ttl(key) <= 60


@pytest.mark.parametrize("bus", ["real"], indirect=True)
async def test_events_stay_in_order_after_the_server_lost_its_scripts(bus: Bus) -> None:
    assert isinstance(bus, RedisBus)
    first, second = moves("o", 4)[:2], moves("o", 4)[2:]
    await bus.publish(first)
    await bus.client.script_flush()  # as a restarted server has no scripts
    await bus.publish(second)
    got = [decode_event(f) for _, f in await bus.client.xrange(bus.keys.live("o"))]
    assert [repr(e) for e in got] == [repr(e) for e in first + second]


async def test_a_publisher_never_lets_a_later_batch_overtake_an_earlier_one() -> None:
    class SlowFirst:
        """A bus whose first publish lands only when released (a new connection, say)."""

        def __init__(self) -> None:
            self.landed: list[Transition] = []
            self.first = True
            self.entered = asyncio.Event()
            self.release = asyncio.Event()

        async def publish(self, events: Sequence[Transition]) -> None:
            if self.first:
                self.first = False
                self.entered.set()
                await self.release.wait()
            self.landed.extend(events)

    bus = SlowFirst()
    publisher = BufferedPublisher(bus, interval_s=0.001)  # type: ignore[arg-type]
    early, late = moves("p", 4)[:2], moves("p", 4)[2:]
    for e in early:
        publisher.add(e)
    periodic = asyncio.ensure_future(publisher.flush())  # the period's flush, in flight
    await bus.entered.wait()
    for e in late:
        publisher.add(e)
    final = asyncio.ensure_future(publisher.flush())  # the end of a run flushes what is left
    # released only after the final flush's first step has run (callbacks run in order)
    asyncio.get_running_loop().call_soon(bus.release.set)
    await asyncio.gather(periodic, final)
    assert [e.seq for e in bus.landed] == [1, 2, 3, 4]
