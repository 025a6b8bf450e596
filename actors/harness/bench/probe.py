"""Checkpoint latency and throughput, measured from a process set up like a TurnActor.

The :class:`BenchProbe` actor has what a host has (a Redis pool of the same size, a
:class:`~actors.cluster.checkpoint_actor.CheckpointClient` on the deployment's
CheckpointActor) and drives synthetic turns that do nothing but save, through four paths:

* ``batched``: the production path (group commit through the CheckpointActor);
* ``unbatched``: one Ray call per save to the same actor (concurrent calls, no queue);
* ``raw_script`` and ``raw_multi_exec``: the same group commit and validation done in this
  process, without Ray, with each ``[checkpoint] atomic`` path: the ceiling of the Redis side,
  and the two atomic saves side by side;
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

from actors.cluster.checkpoint_actor import CheckpointClient, actor_sender, local_sender
from actors.cluster.deployment import Deployment
from actors.cluster.info import SaveVerdict
from actors.cluster.refs import CheckpointRef
from actors.engine.gc_tuning import tune_gc
from actors.harness.bench.sizes import bench_record
from bus.errors import StoreError
from store.codec import EncodedRecord
from store.records import CheckpointRecord, SaveAck
from store.redis.connection import connect
from store.redis.failures import translated
from store.write.checkpoint import RedisCheckpointStore
from store.write.transaction import AtomicSave
from store.write.transcript import KnownBodies

Save = Callable[[CheckpointRecord], Awaitable[Any]]

PATHS = ("batched", "unbatched", "raw_script", "raw_multi_exec", "bare")


@ray.remote(num_cpus=0, max_restarts=0)
class BenchProbe:
    def __init__(self, deployment_json: str, messages: int, payload_bytes: int) -> None:
        dep = Deployment.from_wire(deployment_json)
        tune_gc(dep.settings.host.gc_threshold)  # as TurnActor
        self.client = connect(
            dep.redis_url, max_connections=128, retry_s=dep.settings.redis.retry_s
        )  # as TurnActor
        # The raw baselines promise what the CheckpointActor does (same durability).
        stores = {
            atomic: RedisCheckpointStore(
                self.client,
                dep.keys,
                durability=dep.settings.redis.durability_policy(),
                atomic=atomic,
            )
            for atomic in AtomicSave
        }
        self.store = stores[dep.settings.checkpoint.atomic]
        actor = CheckpointRef.named(dep.name("checkpoint"))
        self.send = actor_sender(lambda: actor)
        self.paths: dict[str, Save] = {
            "batched": CheckpointClient.configured(self.send, dep.settings.checkpoint).save,
            "unbatched": self._unbatched,
            **{
                f"raw_{atomic.value}": CheckpointClient.configured(
                    local_sender(store), dep.settings.checkpoint
                ).save
                for atomic, store in stores.items()
            },
            "bare": self._bare,
        }
        self.messages = messages
        self.payload_bytes = payload_bytes
        self._runs = 0
        # What the two paths that skip the CheckpointClient know of their turns' bodies.
        self._bare_known = KnownBodies()
        self._unbatched_known = KnownBodies()

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

    async def throughput(
        self, path: str, turns: int, duration_s: float, messages: int
    ) -> dict[str, float]:
        """``turns`` concurrent turns of ``messages`` messages saving back to back on ``path``
        for ``duration_s``. Each turn's first save (all its bodies) is made before the clock
        starts: what is timed is a running turn's saves."""
        save = self.paths[path]
        base = [self._record(f"thr-{path}-{turns}-{i}", messages) for i in range(turns)]
        await asyncio.gather(*(save(b) for b in base))
        counts = [0] * turns
        stop = time.perf_counter() + duration_s

        async def turn(i: int) -> None:
            seq = base[i].seq
            while time.perf_counter() < stop:
                seq += 1
                await save(base[i].model_copy(update={"seq": seq}))
                counts[i] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(turn(i) for i in range(turns)))
        wall = time.perf_counter() - t0
        return {"saves": sum(counts), "wall_s": wall, "saves_per_s": sum(counts) / wall}

    def _record(self, label: str, messages: int | None = None) -> CheckpointRecord:
        self._runs += 1
        return bench_record(
            f"bench-{label}-r{self._runs}",
            messages=messages or self.messages,
            payload_bytes=self.payload_bytes,
        )

    async def _unbatched(self, record: CheckpointRecord) -> None:
        encoded = EncodedRecord.of(record, self._unbatched_known)
        (answer,) = await self.send([encoded.to_wire()])
        ok = answer.verdict is SaveVerdict.OK
        self._unbatched_known.settle(record.turn_id, record.seq, landed=ok, in_progress=True)
        if not ok:
            raise StoreError(f"unbatched save refused: {answer.verdict}: {answer.detail}")

    async def _bare(self, record: CheckpointRecord) -> SaveAck:
        """The latency floor: the same writes in one MULTI/EXEC, no fence, no script."""
        encoded, keys = EncodedRecord.of(record, self._bare_known), self.store.keys
        with translated("bare save"):
            async with self.client.pipeline(transaction=True) as pipe:
                if encoded.puts:
                    pipe.hset(keys.bodies(record.turn_id), mapping=encoded.puts)  # type: ignore[arg-type]
                pipe.hset(keys.turn(record.turn_id), mapping=encoded.fields)  # type: ignore[arg-type]
                pipe.xadd(
                    keys.events_of(record.turn_id),
                    {"turn_id": record.turn_id, "epoch": record.epoch, "seq": record.seq},
                    maxlen=self.store.events_maxlen,
                    approximate=True,
                )
                pipe.sadd(keys.in_progress_of(record.turn_id), record.turn_id)
                replies = await pipe.execute()
        self._bare_known.settle(record.turn_id, record.seq, landed=True, in_progress=True)
        return SaveAck(record.turn_id, record.epoch, record.seq, str(replies[-2]))
