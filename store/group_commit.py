"""Group commit: what many concurrent callers submit while one batch is in flight goes out
together in the next, so they share one round trip and one durability wait.

:class:`Batcher` is the mechanism; :class:`GroupCommit` is the in-process engine's
:class:`~actors.turn.deps.Checkpointer` on it (each batch one pipeline of save scripts and one
``WAIT``/``WAITAOF``, :meth:`~store.checkpoint.RedisCheckpointStore.save_many`), as the
CheckpointActor's client is on Ray (``actors.cluster.checkpoint_actor``): 200 turns of one
process saving at once pay a few fsync waits per round, not 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from store.checkpoint import RedisCheckpointStore, acked
from store.records import CheckpointRecord, SaveAck, Settle

__all__ = ["Batcher", "GroupCommit"]

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


class GroupCommit:
    """Saves of one process's concurrent turns, group-committed through ``store``."""

    def __init__(self, store: RedisCheckpointStore, *, max_batch: int = 1024) -> None:
        self.store = store
        self._batcher: Batcher[tuple[CheckpointRecord, Sequence[Settle]], SaveAck | Exception] = (
            Batcher(self._send, max_batch=max_batch)
        )

    async def _send(
        self, batch: list[tuple[CheckpointRecord, Sequence[Settle]]]
    ) -> list[SaveAck | Exception]:
        return list(
            await self.store.save_many(
                [record for record, _ in batch], settles=[s for _, s in batch]
            )
        )

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        """As :meth:`RedisCheckpointStore.save`, in the next batch."""
        return acked(record, await self._batcher.submit((record, settles)))

    @property
    def batches(self) -> int:
        """Batches sent."""
        return self._batcher.batches
