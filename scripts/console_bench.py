"""How the console's pages cost with 10,000 turns in the store, against 200 in the same run.

Two namespaces on one fresh embedded Redis: both get ``--finished`` (200) real scripted turns
run to the end in process; the large one also gets submitted turns up to ``--turns`` (10,000)
in all. The console serves both (uvicorn on loopback, as ``phaseline ui``), and each page is
fetched ``--samples`` (30) times after a warm-up: the list, the list filtered by outcome (it
reads past the submitted turns to find finished ones), the list's last page link, and one
finished turn's page. Reported: the median milliseconds per page in each namespace and their
ratio (large / small): a page that reads only its own rows stays near 1.

Run from a checkout: ``.venv/bin/python scripts/console_bench.py [--report FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import uvicorn

from actors.console import ConsoleSettings, console_app
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from actors.engine.turn_engine import TurnEngine
from bus.phase import TurnPhase
from store.records import CheckpointRecord, Counters, TurnSpec
from store.redis.connection import connect
from store.redis.embedded import EmbeddedRedis

SCENARIO = {"name": "short", "rounds": 2, "tools_per_round": 1, "payload_bytes": 300}


def _submitted(turn_id: str, at: int) -> tuple[TurnSpec, CheckpointRecord]:
    spec = TurnSpec(
        turn_id=turn_id, session_id="", agent="bench:agent", input={"message": "hi"}, created_at=at
    )
    record = CheckpointRecord(
        turn_id=turn_id,
        session_id="",
        agent="bench:agent",
        epoch=1,
        seq=0,
        phase=TurnPhase.INIT,
        in_progress=True,
        reason="submitted",
        messages=(),
        meta=(),
        baseline=0,
        counters=Counters(),
        updated_at=at,
    )
    return spec, record


async def fill(url: str, namespace: str, finished: int, total: int) -> str:
    """The store of one namespace; returns a finished turn's id."""
    settings = Settings.model_validate(
        {"redis": {"namespace": namespace}, "checkpoint": {"min_interval_s": 0}}
    )
    client = connect(url)
    try:
        engine = TurnEngine.from_settings(client, settings, watchdog=None)
        agent, turn_input = scripted_turn(parse_scenario(SCENARIO))
        await engine.run_new(agent, turn_input, [f"done{i:05d}" for i in range(finished)])
        await engine.aclose()
        now = int(time.time() * 1000)
        for start in range(0, total - finished, 500):
            batch = range(start, min(start + 500, total - finished))
            await asyncio.gather(
                *(engine.store.submit(*_submitted(f"sub{i:05d}", now + i)) for i in batch)
            )
    finally:
        await client.aclose()
    return "done00042"


def serve(url: str, namespace: str, port: int) -> uvicorn.Server:
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    app = console_app(settings, ConsoleSettings(redis_url=url))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the console did not start")
        time.sleep(0.02)  # the server's own started flag, polled with a deadline
    return server


def median_ms(url: str, samples: int) -> float:
    times = []
    for i in range(samples + 3):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as reply:
            reply.read()
            assert reply.status == 200, url
        if i >= 3:  # after a warm-up
            times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--finished", type=int, default=200)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    pages = {"list": "/turns", "filtered": "/turns?outcome=answered", "turn": "/turns/{turn}"}
    results: dict[str, object] = {"turns": args.turns, "finished": args.finished}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(data_dir=tmp) as redis:
        sizes = {"small": args.finished, "large": args.turns}
        figures: dict[str, dict[str, float]] = {}
        for port, (label, total) in enumerate(sizes.items(), start=18_400):
            turn = asyncio.run(fill(redis.url, label, args.finished, total))
            server = serve(redis.url, label, port)
            try:
                base = f"http://127.0.0.1:{port}"
                figures[label] = {
                    name: median_ms(base + path.format(turn=turn), args.samples)
                    for name, path in pages.items()
                }
            finally:
                server.should_exit = True
            print(label, total, "turns:", json.dumps(figures[label]), flush=True)
        results["median_ms"] = figures
        results["ratio_large_to_small"] = {
            name: round(figures["large"][name] / figures["small"][name], 2) for name in pages
        }
    print(json.dumps(results["ratio_large_to_small"]))
    if args.report:
        args.report.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
