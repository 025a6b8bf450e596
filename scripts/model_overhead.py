"""Milliseconds per model call: the scripted in-process model against the HTTP model client
(the real ``openai`` SDK, streamed and JSON) talking to the tests' local OpenAI-compatible
server on loopback, in one run. Each call includes its tool call and checkpoint, so the
difference is what the HTTP path adds (the server's own work included).

Run from the checkout: ``.venv/bin/python scripts/model_overhead.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.engine.models.scenario import parse_scenario  # noqa: E402
from actors.engine.models.scripted import scripted_turn  # noqa: E402
from actors.engine.settings.engine_settings import EngineSettings  # noqa: E402
from actors.engine.turn_engine import TurnEngine  # noqa: E402
from actors.harness.http_agents import TEST_KEY_ENV  # noqa: E402
from actors.turn.settings import LoopSettings  # noqa: E402
from store.keys import KeyLayout  # noqa: E402
from store.records import TurnInput  # noqa: E402
from store.redis.connection import connect  # noqa: E402
from store.redis.embedded import EmbeddedRedis  # noqa: E402

ROUNDS, TURNS, REPEATS = 10, 30, 2


async def per_call_ms(client: object, label: str, agent: str, turn_input: TurnInput) -> float:
    engine = TurnEngine(
        client,
        KeyLayout(f"overhead{label}", 4),
        EngineSettings(watchdog=None, loop=LoopSettings(checkpoint_min_interval_s=0)),
    )
    await engine.run_new(agent, turn_input, [f"warm-{label}"])
    t0 = time.perf_counter()
    for i in range(TURNS):
        await engine.run_new(agent, turn_input, [f"{label}-{i}"])
    return (time.perf_counter() - t0) / (TURNS * (ROUNDS + 1)) * 1000


async def measure() -> dict[str, object]:
    scenario = parse_scenario({"name": "overhead", "rounds": ROUNDS, "payload_bytes": 20})
    http = TurnInput(message="#script " + json.dumps({"rounds": ROUNDS, "tool": "add"}))
    paths = {
        "scripted": scripted_turn(scenario),
        "http_stream": ("actors.harness.http_agents:http_stream", http),
        "http_json": ("actors.harness.http_agents:http_json", http),
    }
    with tempfile.TemporaryDirectory() as data:
        server = EmbeddedRedis(data_dir=data)
        client = connect(server.start())
        try:
            runs: dict[str, list[float]] = {k: [] for k in paths}
            for rep in range(REPEATS):
                for name, (agent, turn_input) in paths.items():
                    runs[name].append(await per_call_ms(client, f"{name}{rep}", agent, turn_input))
        finally:
            await client.aclose()
            server.stop()
    best = {k: min(v) for k, v in runs.items()}
    return {
        "ms_per_model_call": {k: round(v, 2) for k, v in best.items()},
        "added_ms": {k: round(best[k] - best["scripted"], 2) for k in ("http_stream", "http_json")},
        "ratio_to_scripted": {k: round(best[k] / best["scripted"], 2) for k in best},
    }


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = subprocess.Popen(
        [sys.executable, "-m", "actors.harness.model_endpoint", str(port)], cwd=ROOT
    )
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_stats", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)  # waiting for the endpoint to listen
        os.environ["OPENAI_BASE_URL"] = f"http://127.0.0.1:{port}/v1"
        os.environ[TEST_KEY_ENV] = "unused-local-key"
        print(json.dumps(asyncio.run(measure())))
    finally:
        endpoint.terminate()


if __name__ == "__main__":
    main()
