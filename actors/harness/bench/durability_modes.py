"""The ``durability_modes`` figure: what each ``[redis] durability`` promise costs in saves/s.

Measured on servers the figure starts itself (a primary and, for ``replicas:1``, a replica),
in this process, with the store's own group commit: batches of 200 records of 12 messages, each
mode for a few seconds, the modes alternating. ``ack`` on the same primary is the baseline.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.harness.bench.sizes import bench_record
from bus.errors import StoreError
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.durability import parse_durability
from store.redis.embedded import EmbeddedRedis
from store.redis.failures import translated
from store.write.checkpoint import RedisCheckpointStore

MODES = ("ack", "fsync", "replicas:1")
BATCH = 200


async def saves_per_s(url: str, mode: str, *, seconds: float, payload_bytes: int = 500) -> float:
    """Group-committed saves/s under ``mode`` against ``url`` (fails on any refused save)."""
    client = connect(url)
    keys = KeyLayout(f"dur{mode.replace(':', '')}{time.time_ns()}")
    store = RedisCheckpointStore(client, keys, durability=parse_durability(mode))
    records = [
        bench_record(f"t{i}", messages=12, payload_bytes=payload_bytes) for i in range(BATCH)
    ]
    saved, seq, started = 0, 1, time.perf_counter()
    try:
        while time.perf_counter() - started < seconds:
            answers = await store.save_many([r.model_copy(update={"seq": seq}) for r in records])
            failed = [a for a in answers if isinstance(a, Exception)]
            if failed:
                raise failed[0]
            saved, seq = saved + len(answers), seq + 1
    finally:
        await client.aclose()
    return saved / (time.perf_counter() - started)


async def _linked(replica_url: str, timeout_s: float = 30.0) -> None:
    """Wait until the replica has synced with its primary (else WAIT counts 0 replicas)."""
    client = connect(replica_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with translated("read replication info"):
                info = await client.info("replication")
            if info.get("master_link_status") == "up":
                return
            if time.monotonic() > deadline:
                raise StoreError(f"replica not linked to its primary after {timeout_s:g} s")
            await asyncio.sleep(0.05)  # polling the replica's link, with a deadline
    finally:
        await client.aclose()


async def durability_modes(
    *, appendfsync: str = "always", seconds: float = 3.0, reps: int = 2
) -> dict[str, Any]:
    """Median saves/s per mode over ``reps`` alternating rounds, and each mode's overhead
    against ``ack`` on the same kind of server.

    ``ack`` and ``fsync`` run on a server alone, as the embedded one is; ``replicas:1`` runs on
    a second primary with a replica, beside ``ack`` on that primary (``ack+replica``): a replica
    changes the primary's timing (with one attached, ``WAITAOF`` under ``everysec`` answered
    about three times faster than without, in ``scripts/durability_saves.py`` runs here).
    """
    rates: dict[str, list[float]] = {m: [] for m in (*MODES, "ack+replica")}
    with tempfile.TemporaryDirectory(prefix="phaseline-durability-") as tmp:
        solo = EmbeddedRedis(data_dir=Path(tmp) / "solo", appendfsync=appendfsync)
        primary = EmbeddedRedis(data_dir=Path(tmp) / "primary", appendfsync=appendfsync)
        with solo, primary:
            assert primary.port is not None
            follow = [f"replicaof 127.0.0.1 {primary.port}", f"masterauth {primary.password}"]
            with EmbeddedRedis(
                data_dir=Path(tmp) / "replica", appendfsync=appendfsync, extra_config=follow
            ) as replica:
                await _linked(replica.url)
                for _ in range(reps):
                    for mode, url in (
                        ("ack", solo.url),
                        ("fsync", solo.url),
                        ("ack+replica", primary.url),
                        ("replicas:1", primary.url),
                    ):
                        wire = "ack" if mode == "ack+replica" else mode
                        rates[mode].append(await saves_per_s(url, wire, seconds=seconds))
    median = {m: statistics.median(r) for m, r in rates.items()}
    base = {"ack": "ack", "fsync": "ack", "ack+replica": "ack+replica", "replicas:1": "ack+replica"}
    return {
        "appendfsync": appendfsync,
        "saves_per_s": {m: round(v) for m, v in median.items()},
        "rounds": {m: [round(x) for x in r] for m, r in rates.items()},
        "overhead_pct_vs_ack": {
            m: round(100 * (1 - v / median[base[m]]), 1) for m, v in median.items()
        },
    }
