"""Checkpoint latency and throughput, measured from a process set up like a TurnActor.

The :class:`BenchProbe` actor has what a host has (a Redis pool of the same size, a
:class:`~actors.cluster.checkpoint_actor.CheckpointClient` on the deployment's
CheckpointActor) and drives synthetic turns that do nothing but save, through four paths:

* ``batched``: the production path (group commit through the CheckpointActor);
* ``unbatched``: one Ray call per save to the same actor (concurrent calls, no queue);
* ``raw``: the same group commit, validation and fenced save scripts done in this process,
  without Ray: the ceiling of the Redis side;
* ``bare``: one plain MULTI/EXEC of the record (HSET + XADD + SADD, no fence, no script), the
  latency floor of a durable write.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from actors.cluster.checkpoint_actor import (
    CheckpointClient,
    Verdict,
    actor_sender,
    local_sender,
    record_to_wire,
)
from actors.cluster.deployment import RAY_NAMESPACE, Deployment
from actors.harness.bench.sizes import bench_record
from bus.errors import StoreError
from store.checkpoint import RedisCheckpointStore
from store.codec import EncodedRecord
from store.connection import connect, translated
from store.records import CheckpointRecord, SaveAck

Save = Callable[[CheckpointRecord], Awaitable[Any]]

PATHS = ("batched", "unbatched", "raw", "bare")


@ray.remote(num_cpus=0, max_restarts=0)
class BenchProbe:
    def __init__(self, deployment_json: str, messages: int, payload_bytes: int) -> None:
        dep = Deployment.from_wire(deployment_json)
        self.client = connect(
            dep.redis_url, max_connections=128, retry_s=dep.settings.redis.retry_s
        )  # as TurnActor
        # The raw baseline promises what the CheckpointActor does (same durability).
        self.store = RedisCheckpointStore(
            self.client, dep.keys, durability=dep.settings.redis.durability_policy()
        )
        actor = ray.get_actor(dep.name("checkpoint"), namespace=RAY_NAMESPACE)
        self.send = actor_sender(lambda: actor)
        self.paths: dict[str, Save] = {
            "batched": CheckpointClient(self.send).save,
            "unbatched": self._unbatched,
            "raw": CheckpointClient(local_sender(self.store)).save,
            "bare": self._bare,
        }
        self.messages = messages
        self.payload_bytes = payload_bytes
        self._runs = 0

    async def pid(self) -> int:
        return os.getpid()

    async def latency(self, n: int) -> dict[str, list[float]]:
        """Milliseconds of ``n`` sequential saves of one turn on the ``batched`` and ``bare``
        paths, interleaved so both see the same noise."""
        out: dict[str, list[float]] = {"batched": [], "bare": []}
        records = {p: self._record(f"lat-{p}") for p in out}
        for i in range(1, n + 1):
            for path, ms in out.items():
                record = records[path].model_copy(update={"seq": i})
                t0 = time.perf_counter()
                await self.paths[path](record)
                ms.append((time.perf_counter() - t0) * 1000)
        return out

    async def throughput(self, path: str, turns: int, duration_s: float) -> dict[str, float]:
        """``turns`` concurrent turns saving back to back on ``path`` for ``duration_s``."""
        save = self.paths[path]
        base = [self._record(f"thr-{path}-{turns}-{i}") for i in range(turns)]
        counts = [0] * turns
        stop = time.perf_counter() + duration_s

        async def turn(i: int) -> None:
            seq = 0
            while time.perf_counter() < stop:
                seq += 1
                await save(base[i].model_copy(update={"seq": seq}))
                counts[i] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(turn(i) for i in range(turns)))
        wall = time.perf_counter() - t0
        return {"saves": sum(counts), "wall_s": wall, "saves_per_s": sum(counts) / wall}

    def _record(self, label: str) -> CheckpointRecord:
        self._runs += 1
        return bench_record(
            f"bench-{label}-r{self._runs}", messages=self.messages, payload_bytes=self.payload_bytes
        )

    async def _unbatched(self, record: CheckpointRecord) -> None:
        (answer,) = await self.send([record_to_wire(record)])
        if answer.verdict is not Verdict.OK:
            raise StoreError(f"unbatched save refused: {answer.verdict}: {answer.detail}")

    async def _bare(self, record: CheckpointRecord) -> SaveAck:
        """The latency floor: the same three writes in one MULTI/EXEC, no fence, no script."""
        encoded, keys = EncodedRecord.of(record), self.store.keys
        with translated("bare save"):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(keys.turn(record.turn_id), mapping=encoded.fields)  # type: ignore[arg-type]
                pipe.xadd(
                    keys.events_of(record.turn_id),
                    {"turn_id": record.turn_id, "epoch": record.epoch, "seq": record.seq},
                    maxlen=self.store.events_maxlen,
                    approximate=True,
                )
                pipe.sadd(keys.in_progress_of(record.turn_id), record.turn_id)
                replies = await pipe.execute()
        return SaveAck(record.turn_id, record.epoch, record.seq, str(replies[1]))
