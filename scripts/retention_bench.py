"""Redis memory under a steady load of short turns, with and without retention.

Runs ``--turns`` (10,000) short scripted turns in process (2 tool rounds, 500-byte payloads),
in batches of ``--batch`` (200), against a fresh embedded Redis, twice: with ``[retention]
finished_ttl_s`` = ``--ttl`` (10 s) and with retention off (the baseline, same run). After
each batch the script lets Redis's own expiry catch up for a moment (``--settle``, 1 s: what a
real load's gaps give it) and reads ``used_memory``. Reported: memory after 1,000 and after
10,000 turns for both, and the memory per finished turn without retention (the sizing figure of
docs/OPERATIONS.md).

Run from a checkout: ``.venv/bin/python scripts/retention_bench.py [--turns 10000] [--ttl 10]
[--report FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from store.domain.retention import Retention
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.embedded import EmbeddedRedis

SCENARIO = {"name": "short", "rounds": 2, "tools_per_round": 1, "payload_bytes": 500}


async def load(url: str, turns: int, batch: int, ttl_s: float, settle_s: float) -> dict[str, int]:
    """Memory (bytes) after each thousand turns."""
    client = connect(url)
    keys = KeyLayout(f"ret{int(ttl_s)}")
    engine = TurnEngine(
        client,
        keys,
        EngineSettings(
            watchdog=None,
            retention=Retention(finished_ttl_s=ttl_s),
            loop=LoopSettings(checkpoint_min_interval_s=0),
        ),
    )
    agent, turn_input = scripted_turn(parse_scenario(SCENARIO))
    memory: dict[str, int] = {}
    try:
        for start in range(0, turns, batch):
            ids = [f"t{i:06d}" for i in range(start, min(start + batch, turns))]
            before = engine.stats.finished  # the engine's stats add up over its runs
            stats = await engine.run_new(agent, turn_input, ids)
            assert stats.finished == before + len(ids), stats.as_dict()
            await asyncio.sleep(settle_s)  # a gap in the load: expiry runs (the point)
            done = start + len(ids)
            if done % 1000 == 0:
                info = await client.info("memory")
                memory[str(done)] = int(info["used_memory"])
    finally:
        await client.aclose()
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, object] = {"turns": args.turns, "ttl_s": args.ttl}
    for label, ttl in (("with_ttl", args.ttl), ("without_ttl", 0.0)):
        with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(data_dir=tmp) as server:
            started = time.monotonic()
            memory = asyncio.run(load(server.url, args.turns, args.batch, ttl, args.settle))
            results[label] = {"used_memory": memory, "wall_s": round(time.monotonic() - started, 1)}
            print(label, json.dumps(results[label]), flush=True)
    base = results["without_ttl"]["used_memory"]  # type: ignore[index]
    grown = base[str(args.turns)] - base["1000"]
    results["bytes_per_finished_turn_without_ttl"] = grown // (args.turns - 1000)
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}))
    if args.report:
        args.report.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
