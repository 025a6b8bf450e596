"""The CheckpointActor and the host-side client that group-commits through it.

Hosts never write checkpoints themselves: a :class:`CheckpointClient` queues each turn's
snapshot and sends whatever has queued while a call was in flight as one batch, so checkpoint
throughput is not capped by one Ray call per save; under load a second batch goes out beside
the first (``[checkpoint] batches_in_flight``), so the host makes one while the actor writes
the other. The actor validates each record and writes the batch with
:meth:`~store.write.checkpoint.RedisCheckpointStore.save_many` (one pipeline of fenced save
scripts). Records cross Ray as msgpack, never as pickles.

Where a batch goes is a :data:`BatchSender`: :func:`actor_sender` (the CheckpointActor, what
hosts use) or :func:`local_sender` (the same validation and transactions in this process, the
Ray-free ceiling ``phaseline bench`` compares against).

If the actor dies mid-batch the client resends the batch to its restarted incarnation; a save
that had already landed comes back as ``AlreadySaved`` and counts as acked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar

from ray.exceptions import RayActorError, RayTaskError

from actors.cluster.deployment import Deployment
from actors.cluster.info import Answer, SaveVerdict, ServiceInfo
from actors.cluster.metrics import metrics
from actors.cluster.refs import CheckpointRef
from actors.engine.gc_tuning import tune_gc
from actors.engine.settings.config import CheckpointSettings
from actors.engine.settings.engine_settings import EngineSettings
from bus.errors import AlreadySaved, RecordTooLarge, ServiceRestarting, StaleOwner, StoreError
from store.codec import DEFAULT_MAX_RECORD_BYTES, EncodedRecord, check_record_size
from store.records import CheckpointRecord, SaveAck, Settle
from store.redis.batcher import Batcher
from store.write.checkpoint import RedisCheckpointStore
from store.write.save_script import REPLAYED
from store.write.transcript import KnownBodies

log = logging.getLogger(__name__)


BatchSender = Callable[[list[bytes]], Awaitable[Sequence[Answer]]]
"""Saves a batch of wire records, one answer each. Raises :class:`ServiceRestarting` when the
batch may be sent again, :class:`StoreError` when it failed as a whole."""


async def save_wire_batch(store: RedisCheckpointStore, blobs: list[bytes]) -> list[Answer]:
    """Check and save a batch of wire records; one answer per record, in order."""
    answers: list[Answer | None] = [None] * len(blobs)
    records: list[EncodedRecord] = []
    where: list[int] = []
    for i, blob in enumerate(blobs):
        try:
            records.append(EncodedRecord.from_wire(blob))
            where.append(i)
        except ValueError as exc:
            answers[i] = Answer(SaveVerdict.ERROR, f"invalid record: {exc}")
    for i, result in zip(where, await store.save_many(records), strict=True):
        if isinstance(result, SaveAck):
            answers[i] = Answer(SaveVerdict.OK, result.event_id, result.inbox_len)
        elif isinstance(result, AlreadySaved):
            answers[i] = Answer(SaveVerdict.OK, REPLAYED)
        elif isinstance(result, StaleOwner):
            answers[i] = Answer(SaveVerdict.STALE, str(result))
        elif isinstance(result, RecordTooLarge):
            answers[i] = Answer(SaveVerdict.TOO_LARGE, str(result))
        else:
            answers[i] = Answer(SaveVerdict.ERROR, str(result))
    return [a or Answer(SaveVerdict.ERROR, "not answered") for a in answers]


class CheckpointActor:
    """Performs the atomic, fenced saves of every host."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,
        "max_restarts": -1,  # restarted by Ray; hosts resend the batch it died with
        "max_task_retries": 0,
    }

    def __init__(self, deployment_json: str) -> None:
        dep = Deployment.from_wire(deployment_json)
        tune_gc(dep.settings.host.gc_threshold)
        self._client = dep.connect(max_connections=64)
        self._store = EngineSettings.of(dep.settings).checkpoint_store(self._client, dep.keys)
        self._batches = 0
        self._saves = 0

    async def save_batch(self, blobs: list[bytes]) -> list[tuple[str, str, int]]:
        self._batches += 1
        self._saves += len(blobs)
        started = time.monotonic()
        answers = await save_wire_batch(self._store, blobs)
        m = metrics()
        m.save_latency.observe((time.monotonic() - started) * 1000)
        m.save_batch.observe(len(blobs))
        for verdict, n in Counter(a.verdict for a in answers).items():
            m.saves.inc(n, tags={"outcome": verdict.value})
        return [a.wire() for a in answers]

    async def hello(self) -> dict[str, Any]:
        counts = {"batches": self._batches, "saves": self._saves}
        return ServiceInfo.here(counts)


def actor_sender(actor: Callable[[], CheckpointRef | None]) -> BatchSender:
    """Send batches to the CheckpointActor; ``actor`` returns its current ref (looked up
    again after a death; None while it is not registered)."""

    async def send(blobs: list[bytes]) -> list[Answer]:
        ref = actor()
        if ref is None:
            raise StoreError("checkpoint batch failed: the checkpoint actor is not registered")
        try:
            return await ref.save_batch(blobs)
        except RayActorError as exc:
            # Died with the batch in flight; its restarted incarnation may get it again.
            raise ServiceRestarting(f"checkpoint actor unavailable: {exc}") from exc
        except RayTaskError as exc:  # it raised
            raise StoreError(f"checkpoint batch failed: {exc}") from exc

    return send


def local_sender(store: RedisCheckpointStore) -> BatchSender:
    """Validate and save batches in this process: the CheckpointActor's work without Ray."""
    return functools.partial(save_wire_batch, store)


class ShardedCheckpoints:
    """A :class:`~actors.turn.loop.Checkpointer` over several CheckpointActors: each turn's
    saves go through the client of the actor its key shard maps to (``route``), so a turn's
    saves stay in order on one actor while the actors group-commit in parallel."""

    def __init__(self, clients: Mapping[str, CheckpointClient], route: Callable[[str], str]):
        self.clients = dict(clients)
        self.route = route

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        return await self.clients[self.route(record.turn_id)].save(record, settles)

    @property
    def batches(self) -> int:
        """Batches sent over every actor."""
        return sum(c.batches for c in self.clients.values())


class CheckpointClient:
    """A :class:`~actors.turn.loop.Checkpointer` that group-commits saves through a sender."""

    def __init__(
        self,
        send: BatchSender,
        *,
        max_batch: int = 512,
        max_in_flight: int = 2,
        retry_for_s: float = 60.0,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        self._send_batch = send
        self.max_record_bytes = max_record_bytes
        self.retry_for_s = retry_for_s
        self._batcher: Batcher[bytes, Answer] = Batcher(
            self._send, max_batch=max_batch, max_in_flight=max_in_flight
        )
        self.known = KnownBodies()
        """What this host's acknowledged saves left in Redis: a save ships only new bodies."""
        self.resends = 0

    @classmethod
    def configured(cls, send: BatchSender, settings: CheckpointSettings) -> CheckpointClient:
        """A client with a deployment's ``[checkpoint]`` batching and size cap."""
        return cls(
            send,
            max_batch=settings.batch_max_saves,
            max_in_flight=settings.batches_in_flight,
            max_record_bytes=settings.max_record_bytes,
        )

    @property
    def batches(self) -> int:
        """Batches answered."""
        return self._batcher.batches

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        encoded = EncodedRecord.of(record, self.known)
        if settles:
            encoded = dataclasses.replace(encoded, settles=tuple(settles))
        try:
            # Checked here too (the store's measure), so an oversized record never crosses Ray.
            check_record_size(record.turn_id, encoded.nbytes, self.max_record_bytes)
            ack = (await self._batcher.submit(encoded.to_wire())).ack(record)
        except (StaleOwner, RecordTooLarge):
            self.known.settle(record.turn_id, record.seq, landed=False, in_progress=True)
            raise
        except BaseException:
            # A failed batch, or cancelled while queued or in flight: it may have landed.
            self.known.settle(record.turn_id, record.seq, landed=None, in_progress=True)
            raise
        self.known.settle(record.turn_id, record.seq, landed=True, in_progress=record.in_progress)
        return ack

    async def _send(self, blobs: list[bytes]) -> Sequence[Answer]:
        """One batch, sent again while the actor restarts (for up to ``retry_for_s``): saves
        that had landed come back as ``AlreadySaved`` on the resend, i.e. acked. A
        :class:`StoreError` fails the batch, never hangs it: each loop retries its save at
        the next site."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_for_s
        while True:
            try:
                return await self._send_batch(blobs)
            except ServiceRestarting as exc:
                self.resends += 1
                if loop.time() > deadline:
                    raise StoreError(str(exc)) from exc
                await asyncio.sleep(0.2)  # backoff while Ray restarts the actor
