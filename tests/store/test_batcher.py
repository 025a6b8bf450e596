"""The batcher behind every group commit: how many batches it keeps in flight, and how big."""

from __future__ import annotations

import asyncio

import pytest

from store.redis.batcher import Batcher


class GatedSend:
    """A ``send`` that holds each batch until the test releases it, and records what it saw."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.gate = asyncio.Event()
        self.arrived = asyncio.Condition()

    async def __call__(self, items: list[int]) -> list[str]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        async with self.arrived:
            self.batches.append(items)
            self.arrived.notify_all()
        await self.gate.wait()
        self.in_flight -= 1
        if -1 in items:
            raise RuntimeError("batch refused")
        return [f"ok {i}" for i in items]

    async def until_batches(self, n: int) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.batches) >= n), 10)


async def test_two_batches_in_flight_each_capped_and_every_caller_answered() -> None:
    send = GatedSend()
    batcher = Batcher(send, max_batch=3, max_in_flight=2)
    calls = [asyncio.ensure_future(batcher.submit(i)) for i in range(10)]
    await send.until_batches(2)
    # Two batches went out at once, each capped; the rest waits for a free slot.
    assert send.batches == [[0, 1, 2], [3, 4, 5]]
    send.gate.set()
    assert await asyncio.gather(*calls) == [f"ok {i}" for i in range(10)]
    assert sorted(i for b in send.batches for i in b) == list(range(10))
    assert all(len(b) <= 3 for b in send.batches)
    assert send.most_in_flight == 2
    assert batcher.batches == len(send.batches) == 4


async def test_a_second_batch_goes_out_beside_the_first_only_once_half_a_batch_waits() -> None:
    send = GatedSend()
    batcher = Batcher(send, max_batch=10, max_in_flight=2)
    calls = [asyncio.ensure_future(batcher.submit(0))]
    await send.until_batches(1)
    calls += [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 5)]
    # An event set behind the four submits: they are queued (and a flusher one of them started
    # has run) before the fifth is submitted.
    queued = asyncio.Event()
    asyncio.get_running_loop().call_soon(queued.set)
    await queued.wait()
    calls.append(asyncio.ensure_future(batcher.submit(5)))
    await send.until_batches(2)
    # Four waiting (under half a batch) started no batch; the fifth did, and it took all five.
    assert send.batches == [[0], [1, 2, 3, 4, 5]]
    send.gate.set()
    assert await asyncio.gather(*calls) == [f"ok {i}" for i in range(6)]
    assert send.most_in_flight == 2


async def test_one_batch_in_flight_by_default() -> None:
    send = GatedSend()
    batcher = Batcher(send, max_batch=100)
    first = asyncio.ensure_future(batcher.submit(0))
    await send.until_batches(1)
    rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 6)]
    send.gate.set()
    assert await asyncio.gather(first, *rest) == [f"ok {i}" for i in range(6)]
    # What queued behind the first batch went out together, after it.
    assert send.batches == [[0], [1, 2, 3, 4, 5]]
    assert send.most_in_flight == 1


async def test_an_item_submitted_as_the_last_batch_is_answered_goes_out() -> None:
    """The caller wakes before the finished flusher's done callback runs: a batcher that took
    that flusher for busy would leave the item queued for ever."""
    send = GatedSend()
    send.gate.set()
    batcher = Batcher(send, max_in_flight=1)
    async with asyncio.timeout(10):  # no task in between: the caller wakes straight from its batch
        for i in range(3):
            assert await batcher.submit(i) == f"ok {i}"
    assert send.batches == [[0], [1], [2]]


async def test_a_failed_batch_fails_its_own_callers_only() -> None:
    send = GatedSend()
    batcher = Batcher(send, max_batch=2, max_in_flight=2)
    calls = [asyncio.ensure_future(batcher.submit(i)) for i in (-1, 1, 2, 3)]
    send.gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert [type(r) for r in results[:2]] == [RuntimeError, RuntimeError]
    assert results[2:] == ["ok 2", "ok 3"]
    assert batcher.batches == 1  # batches answered: the refused one is not counted


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"max_in_flight": 0}])
def test_a_batcher_needs_room_for_one_item_and_one_batch(bad: dict[str, int]) -> None:
    async def send(items: list[int]) -> list[int]:
        return items

    with pytest.raises(ValueError, match="at least 1"):
        Batcher(send, **bad)
