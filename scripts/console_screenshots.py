"""The console's screenshots in the README and docs/CONSOLE.md, made for real.

On a fresh embedded Redis: 40 short scripted turns (some with model faults the loop recovers
from or stops on), one turn whose ``phaseline run`` is SIGKILLed mid-turn and finished by a
resume (its page is the turn screenshot: the timeline shows both incarnations), and one turn
left waiting for an approval; then a Ray deployment of two hosts busy with 40 more. The console,
attached to the deployment, serves them; Debian's chromium, driven by Playwright's client, takes
the three pages.

Run from a checkout: ``.venv/bin/python scripts/console_screenshots.py [--out docs/images]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import redis
import uvicorn
from playwright.async_api import async_playwright

from actors.cluster.runtime import Runtime
from actors.console import ConsoleSettings, console_app
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from actors.engine.turn_engine import TurnEngine
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "demo"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SETTINGS = {
    "redis": {"namespace": NAMESPACE},
    "checkpoint": {"min_interval_s": 0},
    "approvals": {"poll_s": 0.05},
}


def crash_and_resume(url: str, tmp: Path) -> str:
    """A turn SIGKILLed after its first checkpoint, then finished by ``phaseline resume``."""
    scenario = tmp / "crash.toml"
    scenario.write_text(
        'name = "crash"\nrounds = 3\ntools_per_round = 2\n'
        'tools = ["echo", "counter_increment"]\nllm_latency_ms = 1500\n'
    )
    common = [
        "--redis-url",
        url,
        "--namespace",
        NAMESPACE,
        "--config",
        str(ROOT / "configs" / "test.toml"),
    ]
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.cli",
            "run",
            "--in-process",
            *common,
            "--scenario",
            str(scenario),
            "--turns",
            "1",
            "--run-id",
            "crashed",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    key = KeyLayout(NAMESPACE).turn("crashed-t000000")
    probe = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    live = KeyLayout(NAMESPACE).live("crashed-t000000")

    def published() -> bool:  # its first checkpoint, and the live events up to it
        kinds = [fields.get(b"kind") for _id, fields in probe.xrange(live)]
        return probe.hget(key, "reason") == b"tool_batch" and b"checkpoint" in kinds

    while not published():
        if time.monotonic() > deadline or child.poll() is not None:
            raise RuntimeError("the run made no checkpoint")
        time.sleep(0.05)  # polling Redis with a deadline
    os.kill(child.pid, signal.SIGKILL)  # in its next model call (1.5 s)
    child.wait()
    subprocess.run(
        [sys.executable, "-m", "actors.cli", "resume", "--in-process", *common],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return "crashed-t000000"


async def populate(url: str) -> asyncio.Task[object]:
    """40 turns run to their end, and one left waiting for an approval (its task)."""
    client = connect(url)
    engine = TurnEngine.from_settings(client, Settings.model_validate(SETTINGS), watchdog=None)
    plain = parse_scenario({"name": "tool_loop", "rounds": 3, "tools_per_round": 2})
    retried = parse_scenario(
        {
            "name": "flaky",
            "rounds": 2,
            "tools_per_round": 1,
            "faults": [{"at_call": 2, "kind": "retryable"}],
        }
    )
    looping = parse_scenario(
        {
            "name": "loopy",
            "rounds": 6,
            "tools_per_round": 1,
            "faults": [{"at_call": 2, "kind": "loop"}],
        }
    )
    await engine.run_new(*scripted_turn(plain), [f"run1-t{i:06d}" for i in range(30)])
    await engine.run_new(*scripted_turn(retried), [f"run2-t{i:06d}" for i in range(6)])
    await engine.run_new(*scripted_turn(looping), [f"run3-t{i:06d}" for i in range(4)])
    gated = parse_scenario(
        {"name": "gated", "rounds": 1, "tools_per_round": 1, "require_approval": ["echo"]}
    )
    agent, turn_input = scripted_turn(gated)
    record = (await engine.submit_many(agent, turn_input, ["needs-approval"]))[0][1]
    spec = await engine.store.load_spec("needs-approval")
    task: asyncio.Task[object] = asyncio.ensure_future(engine.start(record, spec))
    while engine.pending_approval("needs-approval") is None:  # noqa: ASYNC110 - its own flag
        await asyncio.sleep(0.05)  # until it asks (it runs in this loop)
    return task


async def shoot(url: str, crashed: str, out: Path) -> None:
    task = await populate(url)
    task.cancel()  # the deployment below adopts it (one owner at a time): it waits there
    with contextlib.suppress(asyncio.CancelledError):
        await task
    # A deployment beside them, busy with 40 turns, for the deployment page (attached).
    rt = await Runtime.start(Settings.model_validate(SETTINGS), redis_url=url, hosts=2)
    busy = parse_scenario(
        {
            "name": "busy",
            "rounds": 8,
            "tools_per_round": 2,
            "llm_latency_ms": 800,
            "tool_latency_ms": 200,
        }
    )
    await rt.submit(*scripted_turn(busy), [f"ray-t{i:06d}" for i in range(40)])
    await asyncio.sleep(3)  # let the hosts get going: the page shows them at work
    address = ray.get_runtime_context().gcs_address
    settings = Settings.model_validate(SETTINGS)
    app = console_app(settings, ConsoleSettings(redis_url=url, ray_address=address))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=18_321, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # noqa: ASYNC110 - uvicorn's own flag, set in its thread
        await asyncio.sleep(0.02)
    base = "http://127.0.0.1:18321"
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(
                executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS
            )
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            for name, path in (
                ("turns", "/turns"),
                ("turn", f"/turns/{crashed}"),
                ("deployment", "/deployment"),
            ):
                await page.goto(base + path)
                await page.screenshot(path=str(out / f"console-{name}.png"), full_page=False)
                print("wrote", out / f"console-{name}.png")
            await browser.close()
    finally:
        server.should_exit = True
        await rt.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(data_dir=tmp) as server:
        crashed = crash_and_resume(server.url, Path(tmp))
        asyncio.run(shoot(server.url, crashed, args.out))


if __name__ == "__main__":
    main()
