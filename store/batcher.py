"""Batching: what many concurrent callers submit while one batch is in flight goes out together
in the next, so they share one round trip (and, for saves, one durability wait).

Used by the group commit of saves (:mod:`store.group_commit`, and the CheckpointActor's
client) and by the ledger's claims (:class:`~store.ledger.ToolLedger`): redis-py spends about
100 µs of client CPU on a command sent alone and about 15 in a pipeline (``phaseline bench``'s
``durable_loop`` at 200 turns at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batcher"]

_Item = TypeVar("_Item")
_Reply = TypeVar("_Reply")


class Batcher(Generic[_Item, _Reply]):
    """Sends what is submitted in batches of at most ``max_batch``: the first item at once,
    then whatever queued while a batch was in flight, one batch at a time. ``send`` answers
    each item of a batch in order, or raises, which fails the whole batch."""

    def __init__(
        self, send: Callable[[list[_Item]], Awaitable[Sequence[_Reply]]], *, max_batch: int = 1024
    ) -> None:
        self._send = send
        self.max_batch = max_batch
        self._queue: list[tuple[_Item, asyncio.Future[_Reply]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        """Batches sent."""

    async def submit(self, item: _Item) -> _Reply:
        """``item``'s answer once its batch is sent. Cancelling the wait does not take the
        item back: it may be in a batch in flight."""
        fut: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
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
