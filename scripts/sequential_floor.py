#!/usr/bin/env python3
"""Where a durable turn's time goes, one turn at a time: the ``durable_loop`` figure's
sequential part beside what bounds it on this machine.

    .venv/bin/python scripts/sequential_floor.py [--turns N]

On an embedded server under ``appendfsync always`` (what the default ``fsync`` durability runs
on), in a temporary directory:

1. the ``durable_loop`` figure, its sequential part of ``--turns`` turns (durable and in-memory
   alternating; its concurrent part is cut to one round of 20);
2. the server's own time per script call over that figure (``INFO commandstats``, ``EVALSHA``);
3. ``fdatasync`` after a 600-byte append in the server's data directory, what ``appendfsync
   always`` does once per pass of its event loop with a write in it (median of 2,000);
4. round trips on the client's lane that write nothing (``GET``) and that write (``SET``): wall
   and client CPU of each, one at a time.

Then the arithmetic: the durable turn as the in-memory turn, plus its round trips at the price
of the cheapest durable write (the figure's floor), plus what its own code spends beyond both;
and the ratio each would allow alone. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.harness.bench.durable_loop import durable_loop
from store.redis.connection import connect
from store.redis.embedded import EmbeddedRedis
from store.redis.lane import lane_of


def fdatasync_ms(directory: Path, n: int = 2000) -> float:
    """Median ms of ``fdatasync`` after a 600-byte append to a file in ``directory``."""
    path = directory / "fdatasync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        took = []
        for _ in range(n):
            os.write(fd, b"x" * 600)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            took.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return round(1000 * statistics.median(took), 3)


async def lane_round_trips(url: str, n: int = 2000) -> dict[str, dict[str, float]]:
    """Wall ms and client CPU µs of ``n`` lane round trips in a row, reading and writing."""
    client = connect(url)
    lane = lane_of(client)
    if lane is None:
        raise SystemExit(f"{url}: no lane for this URL")
    value = b"x" * 500
    out: dict[str, dict[str, float]] = {}
    try:
        for name, command in (
            ("get", ("GET", "floor-probe")),
            ("set", ("SET", "floor-probe", value)),
        ) * 2:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                await lane.call(*command)
            out[name] = {  # the second of each pair is kept
                "ms": round(1000 * (time.perf_counter() - t0) / n, 3),
                "client_cpu_us": round(1e6 * (time.process_time() - c0) / n, 1),
            }
        await client.delete("floor-probe")
    finally:
        await client.aclose()
    return out


async def script_us_per_call(url: str) -> float:
    client = connect(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return float(stats["cmdstat_evalsha"]["usec_per_call"])


async def measure(url: str, data_dir: Path, turns: int) -> dict[str, Any]:
    fig = await durable_loop(url, turns=turns, concurrent=20, reps=1)
    seq = fig["sequential"]
    trips = await lane_round_trips(url)
    fsync = fdatasync_ms(data_dir)
    memory, durable = seq["memory_ms_per_turn"], seq["durable_ms_per_turn"]
    n = seq["round_trips_per_turn"]
    floor = seq["floor_ms_per_turn"]
    return {
        "sequential": seq,
        "server_us_per_script_call": await script_us_per_call(url),
        "fdatasync_ms": fsync,
        "lane_round_trips": trips,
        "arithmetic": {
            "memory_turn_ms": memory,
            "round_trips_ms": round(floor - memory, 3),
            "beyond_the_floor_ms": round(durable - floor, 3),
            "durable_turn_ms": durable,
            "durable_cpu_beyond_memory_ms": round(
                seq["durable_cpu_ms_per_turn"] - seq["memory_cpu_ms_per_turn"], 3
            ),
            "ratio": seq["ratio"],
            "ratio_if_nothing_beyond_the_floor": seq["ceiling_ratio"],
            "ratio_if_each_round_trip_cost_only_the_fsync": round(memory / (memory + n * fsync), 3),
            "ms_left_for_the_durable_code_at_0_3": round(memory / 0.3 - floor, 3),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--turns", type=int, default=100, help="sequential turns per variant")
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(data_dir=tmp, appendfsync="always") as server,
    ):
        print(json.dumps(asyncio.run(measure(server.url, Path(tmp), args.turns)), indent=2))


if __name__ == "__main__":
    main()
