"""Batching: what many concurrent callers submit while one batch is in flight goes out together
in the next, so they share one round trip (and, for saves, one durability wait).

:class:`Batcher` is the mechanism, used by the group commit of saves
(:mod:`store.write.group_commit`, and the CheckpointActor's client); :class:`ScriptCalls` puts the
script calls of concurrent turns (the ledger's claims and compare-and-sets, a turn's start) in
shared round trips of the transport (:mod:`store.redis.transport`), or leaves them to the client's
:class:`~store.redis.lane.Lane` where it has one (which writes what concurrent callers send in one
turn of the event loop together by itself). redis-py's client work per command is mostly per
round trip, so a command in a pipeline costs a fraction of one sent alone
(``scripts/client_costs.py`` measures both)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from store.redis.connection import StoreClient
from store.redis.lane import lane_of
from store.redis.transport import transport_of

__all__ = ["Batcher", "ScriptCalls"]

_Item = TypeVar("_Item")
_Reply = TypeVar("_Reply")


class Batcher(Generic[_Item, _Reply]):
    """Sends what is submitted in batches of at most ``max_batch``: the first item at once,
    then whatever queued while a batch was in flight, with at most ``max_in_flight`` batches
    in flight. ``send`` answers each item of a batch in order, or raises, which fails the
    whole batch.

    One batch in flight makes every stage behind ``send`` wait for the others: a host's
    callers are idle while the batch is checked and written, and the writer is idle while
    they make the next one. Two in flight, each capped, let the stages overlap (the
    CheckpointActor's client: ``phaseline bench``'s throughput at 1,000 turns, with
    docs/BENCHMARKS.md). A batch goes out beside one in flight only once half a batch waits,
    so a light load still shares batches (each costs a round trip). A caller awaits its own
    item, so no caller has two items in flight.
    """

    def __init__(
        self,
        send: Callable[[list[_Item]], Awaitable[Sequence[_Reply]]],
        *,
        max_batch: int = 1024,
        max_in_flight: int = 1,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be at least 1")
        self._send = send
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self._extra_at = max(1, max_batch // 2)
        self._queue: list[tuple[_Item, asyncio.Future[_Reply]]] = []
        self._flushers: set[asyncio.Task[None]] = set()
        self.batches = 0
        """Batches sent."""

    async def submit(self, item: _Item) -> _Reply:
        """``item``'s answer once its batch is sent. Cancelling the wait does not take the
        item back: it may be in a batch in flight."""
        fut: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        # A flusher that is not done is waiting on its batch and sends the queue after it; one
        # that is done may still be in the set (its done callback has not run yet).
        busy = sum(not f.done() for f in self._flushers)
        if not busy or (busy < self.max_in_flight and len(self._queue) >= self._extra_at):
            flusher = asyncio.ensure_future(self._flush())
            self._flushers.add(flusher)  # held here: the loop keeps only a weak reference
            flusher.add_done_callback(self._flushers.discard)
        return await fut

    async def _flush(self) -> None:
        while self._queue:
            batch = self._queue[: self.max_batch]
            del self._queue[: self.max_batch]
            try:
                replies = await self._send([item for item, _ in batch])
            except Exception as exc:  # the batch failed as a whole: each caller hears why
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            for (_, fut), reply in zip(batch, replies, strict=True):
                if not fut.done():
                    fut.set_result(reply)


#: One script call: the script, its KEYS and its ARGV.
_ScriptCall = tuple[AsyncScript, list[str], list[bytes | str | int]]


class ScriptCalls:
    """Script calls of concurrent callers in shared round trips, each still its own atomic
    step with its own answer (:mod:`store.redis.transport` sends them and applies its rules). On
    one server, what queues while a round trip is out goes in the next (on a lane, the lane
    writes concurrent calls together by itself); on a Redis Cluster each call goes alone to
    its slot's node."""

    def __init__(self, client: StoreClient) -> None:
        self.transport = transport_of(client)
        self._batcher: Batcher[_ScriptCall, object] | None = (
            None
            if lane_of(client) is not None or isinstance(client, aioredis.RedisCluster)
            else Batcher(self._send)
        )

    @property
    def batches(self) -> int:
        """Round trips shared by calls so far (0 on a Redis Cluster or a lane)."""
        return 0 if self._batcher is None else self._batcher.batches

    async def call(
        self, script: AsyncScript, keys: list[str], args: list[bytes | str | int] | None = None
    ) -> Any:
        """The script's reply; raises what Redis answered this call (the caller translates)."""
        if self._batcher is None:
            (reply,) = await self._send([(script, keys, args or [])])
        else:
            reply = await self._batcher.submit((script, keys, args or []))
        if isinstance(reply, Exception):  # Redis's answer to this call alone
            raise reply
        return reply

    async def _send(self, calls: list[_ScriptCall]) -> list[object]:
        """The calls in one round trip (on one server: any key finds it), by ``EVALSHA``."""
        commands = [
            ("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls
        ]
        return (await self.transport.send(calls[0][1][0], commands)).replies
