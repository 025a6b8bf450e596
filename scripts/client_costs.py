#!/usr/bin/env python3
"""What the Redis client costs a host's CPU, the two measurements behind the batching of script
calls (store/redis/batcher.py) and ``[host] gc_threshold`` (actors/engine/gc_tuning.py):

    .venv/bin/python scripts/client_costs.py [--redis-url URL] [--turns N]

1. client CPU per ``EVALSHA``: 200 sent at once each on its own, against 200 in one pipeline,
   and against 200 on the client's lane (``store/redis/lane.py``); and one at a time, the round
   trip and its CPU, through redis-py and on the lane;
2. the ``durable_loop`` figure (one turn at a time, then 200 at once) under several
   young-generation GC thresholds, 700 being Python's own.

Without ``--redis-url``: an embedded server under ``appendfsync always`` (what the default
``fsync`` durability runs on). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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

THRESHOLDS = (700, 5_000, 20_000, 100_000)


async def per_command_cpu(
    url: str, rounds: int = 40, width: int = 200, one_by_one: int = 2000
) -> dict[str, float]:
    """Client CPU µs per ``EVALSHA`` of a small script: ``width`` at once each alone, in one
    pipeline, on the lane; then ``one_by_one`` in a row, through redis-py and on the lane
    (wall ms per round trip too)."""
    client = connect(url, max_connections=256)
    lane = lane_of(client)
    if lane is None:
        raise SystemExit(f"{url}: no lane for this URL (plain TCP to one server has one)")
    try:
        sha = await client.script_load("redis.call('HSET', KEYS[1], 'f', ARGV[1]) return 1")
        value = b"x" * 120

        def key(i: int) -> str:
            return f"client-costs:{{s{i % 64}}}:{i}"

        async def alone(i: int) -> None:
            await client.evalsha(sha, 1, key(i), value)

        async def on_lane(i: int) -> None:
            await lane.call("EVALSHA", sha, 1, key(i), value)

        async def piped() -> None:
            async with client.pipeline(transaction=False) as pipe:
                for i in range(width):
                    pipe.evalsha(sha, 1, key(i), value)
                await pipe.execute()

        out: dict[str, float] = {}
        for name in ("alone", "pipeline", "lane") * 2:  # twice each, the last kept
            c0 = time.process_time()
            for _ in range(rounds):
                if name == "pipeline":
                    await piped()
                else:
                    each = alone if name == "alone" else on_lane
                    await asyncio.gather(*(each(i) for i in range(width)))
            out[f"{name}_cpu_us"] = round(1e6 * (time.process_time() - c0) / (rounds * width), 1)
        for name in ("sequential_redis_py", "sequential_lane") * 2:
            each = alone if name == "sequential_redis_py" else on_lane
            c0, t0 = time.process_time(), time.perf_counter()
            for i in range(one_by_one):
                await each(i)
            out[f"{name}_cpu_us"] = round(1e6 * (time.process_time() - c0) / one_by_one, 1)
            out[f"{name}_ms"] = round(1e3 * (time.perf_counter() - t0) / one_by_one, 3)
        return out
    finally:
        await client.aclose()


async def measure(url: str, turns: int) -> dict[str, Any]:
    loops = {}
    for threshold in THRESHOLDS:
        fig = await durable_loop(
            url, turns=turns, concurrent=200, reps=5, warmup=10, gc_threshold=threshold
        )
        loops[str(threshold)] = {
            "sequential_ratio": fig["sequential"]["ratio"],
            "concurrent_ratio": fig["concurrent"]["ratio"],
            "durable_turns_per_s": fig["concurrent"]["durable_turns_per_s"],
            "durable_cpu_ms_per_turn": fig["concurrent"]["durable_cpu_ms_per_turn"],
        }
    return {"per_command": await per_command_cpu(url), "durable_loop_by_gc_threshold": loops}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--turns", type=int, default=50, help="sequential turns per threshold")
    ap.add_argument("--per-command-only", action="store_true", help="skip the durable loop runs")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if url is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            url = stack.enter_context(EmbeddedRedis(data_dir=tmp, appendfsync="always")).url
        run = per_command_cpu(url) if args.per_command_only else measure(url, args.turns)
        print(json.dumps(asyncio.run(run), indent=2))


if __name__ == "__main__":
    main()
