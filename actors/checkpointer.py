"""The CheckpointActor and the host-side client that group-commits through it.

Hosts never write checkpoints themselves: a :class:`CheckpointClient` queues each turn's
snapshot and sends whatever has queued while the previous call was in flight as one batch, so
checkpoint throughput is not capped by one Ray call per save. The actor validates each record
and writes the batch with :meth:`~store.checkpoint.RedisCheckpointStore.save_many` (one
WATCH + MULTI/EXEC per shard). Records cross Ray as msgpack, never as pickles.

If the actor dies mid-batch the client resends the batch to its restarted incarnation; a save
that had already landed comes back as ``AlreadySaved`` and counts as acked.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import ray
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayTaskError

from actors.deployment import Deployment
from bus.errors import AlreadySaved, StaleOwner, StoreError
from store.checkpoint import RedisCheckpointStore, SaveAck
from store.codec import dump_model, pack, unpack
from store.connection import connect
from store.records import CheckpointRecord

log = logging.getLogger(__name__)

Answer = tuple[str, str]
"""``("ok", event_id)``, ``("stale", why)`` or ``("error", why)`` per record."""

_Pending = tuple[bytes, "asyncio.Future[SaveAck]", CheckpointRecord]


def record_to_wire(record: CheckpointRecord) -> bytes:
    return pack(dump_model(record))


async def save_wire_batch(store: RedisCheckpointStore, blobs: list[bytes]) -> list[Answer]:
    """Validate and save a batch of wire records; one answer per record, in order."""
    answers: list[Answer | None] = [None] * len(blobs)
    records: list[CheckpointRecord] = []
    where: list[int] = []
    for i, blob in enumerate(blobs):
        try:
            records.append(CheckpointRecord.model_validate(unpack(blob)))
            where.append(i)
        except (ValueError, TypeError, ValidationError) as exc:
            answers[i] = ("error", f"invalid record: {exc}")
    for i, result in zip(where, await store.save_many(records), strict=True):
        if isinstance(result, SaveAck):
            answers[i] = ("ok", result.event_id)
        elif isinstance(result, AlreadySaved):
            answers[i] = ("ok", "replayed")
        elif isinstance(result, StaleOwner):
            answers[i] = ("stale", str(result))
        else:
            answers[i] = ("error", str(result))
    return [a if a is not None else ("error", "not answered") for a in answers]


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class CheckpointActor:
    """Performs the atomic, fenced saves of every host."""

    def __init__(self, deployment_json: str) -> None:
        dep = Deployment.from_wire(deployment_json)
        self._client = connect(dep.redis_url, max_connections=64)
        self._store = RedisCheckpointStore(self._client, dep.keys)
        self._batches = 0
        self._saves = 0

    async def save_batch(self, blobs: list[bytes]) -> list[Answer]:
        self._batches += 1
        self._saves += len(blobs)
        return await save_wire_batch(self._store, blobs)

    async def hello(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "batches": self._batches, "saves": self._saves}


class CheckpointClient:
    """A :class:`~actors.loop.Checkpointer` that batches saves through the CheckpointActor."""

    def __init__(
        self,
        actor: Callable[[], Any],
        *,
        max_batch: int = 1024,
        retry_for_s: float = 60.0,
    ) -> None:
        """``actor`` returns the current actor handle (it is looked up again after a death)."""
        self._actor = actor
        self.max_batch = max_batch
        self.retry_for_s = retry_for_s
        self._queue: list[_Pending] = []
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        self.resends = 0

    async def save(self, record: CheckpointRecord) -> SaveAck:
        fut: asyncio.Future[SaveAck] = asyncio.get_running_loop().create_future()
        self._queue.append((record_to_wire(record), fut, record))
        self._wake.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_forever())
        return await fut

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                await self._send(batch)

    async def _send(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_for_s
        blobs = [blob for blob, _, _ in batch]
        while True:
            try:
                answers: list[Answer] = await self._actor().save_batch.remote(blobs)
                break
            except (RayTaskError, ValueError) as exc:
                # The actor raised, or is not registered (yet): fail this batch, never hang
                # it. Each loop retries its save at the next site.
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(StoreError(f"checkpoint batch failed: {exc}"))
                return
            except RayActorError as exc:
                # The actor died with the batch in flight; its restarted incarnation gets it
                # again. Saves that had landed come back as AlreadySaved, i.e. acked.
                self.resends += 1
                if loop.time() > deadline:
                    for _, fut, _ in batch:
                        if not fut.done():
                            fut.set_exception(StoreError(f"checkpoint actor unavailable: {exc}"))
                    return
                await asyncio.sleep(0.2)  # backoff while Ray restarts the actor
        self.batches += 1
        for (_, fut, record), (status, detail) in zip(batch, answers, strict=True):
            if fut.done():
                continue
            if status == "ok":
                fut.set_result(SaveAck(record.turn_id, record.epoch, record.seq, detail))
            elif status == "stale":
                fut.set_exception(StaleOwner(detail))
            else:
                fut.set_exception(StoreError(detail))
