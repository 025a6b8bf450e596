"""Group commit: saves of concurrent turns share one round trip and one durability wait.

:class:`GroupCommit` is the in-process engine's :class:`~actors.turn.deps.Checkpointer` on a
:class:`~store.redis.batcher.Batcher` (each batch one pipeline of save scripts and one
``WAIT``/``WAITAOF``, :meth:`~store.write.checkpoint.RedisCheckpointStore.save_many`), as the
CheckpointActor's client is on Ray (``actors.cluster.checkpoint_actor``): 200 turns of one
process saving at once pay a few fsync waits per round, not 200.
"""

from __future__ import annotations

from collections.abc import Sequence

from store.records import CheckpointRecord, SaveAck, Settle
from store.redis.batcher import Batcher
from store.write.checkpoint import RedisCheckpointStore, acked

__all__ = ["GroupCommit"]


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
