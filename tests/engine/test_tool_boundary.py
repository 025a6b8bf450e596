"""A tool that raises what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``, a bare
``BaseException``, a ``CancelledError`` nobody asked for) fails its call, not the process: in
``phaseline run --in-process`` (a real child process, which such a tool used to end with status
3 and every turn in progress) and on a Ray ToolWorker (which it used to kill)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.cluster.runtime import Runtime
from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineHooks, EngineSettings
from actors.engine.tools.local_tools import LocalToolRunner
from actors.engine.turn_engine import TurnEngine
from actors.harness.bad_tools import RAISER, RAISING
from actors.turn.tools import BLOCKED, ToolContext, ToolSpec
from bus.events import LiveEvent, ToolWait, ToolWaiting
from bus.messages import ToolCall
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnInput
from store.write.checkpoint import RedisCheckpointStore
from tests.support.agents import CROWD
from tests.support.polling import eventually
from tests.support.reference import FAST

ROOT = Path(__file__).resolve().parents[2]
BAD = RAISING


def assert_each_call_failed_alone(record: CheckpointRecord) -> None:
    results = {m.tool_result.name: m.tool_result for m in record.messages if m.tool_result}
    assert results["echo"].status == "ok" and results["echo"].output == "fine"
    for name in BAD:
        assert results[name].status == "error", (name, results[name])
        assert "the tool raised" in results[name].output, results[name].output
    assert "SystemExit: 3" in results["exits"].output
    assert record.counters.outcome == "answered"


def run_in_process(url: str, namespace: str, report: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", "run", "--in-process", "--redis-url", url,
         "--namespace", namespace, "--config", str(ROOT / "configs" / "test.toml"),
         "--agent", RAISER, "--input", "go", "--turns", "3", "--run-id", "raise",
         "--report", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


async def test_a_tool_raising_base_exceptions_fails_its_call_not_the_process(
    redis_url: str, real_client: aioredis.Redis, namespace: str, tmp_path: Path
) -> None:
    report = tmp_path / "run.json"
    done = run_in_process(redis_url, namespace, report)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["outcomes"] == {"answered": 3}, data
    store = RedisCheckpointStore(real_client, KeyLayout(namespace, shards=16))
    for i in range(3):
        assert_each_call_failed_alone(await store.load(f"raise-t{i:06d}"))
    assert await store.list_in_progress() == []


async def test_a_tool_raising_base_exceptions_leaves_its_tool_worker_alive(
    redis_url: str, namespace: str, ray_cluster: object
) -> None:
    settings = Settings.model_validate({
        "redis": {"namespace": namespace}, "checkpoint": {"min_interval_s": 0},
        "tools": {"workers": 1},
    })  # fmt: skip
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    try:
        worker = rt.tool_worker("default", 0)
        assert worker is not None
        before = (await worker.hello()).pid
        ids = [f"rr{i}" for i in range(3)]
        await rt.submit(RAISER, TurnInput(message="go"), ids)
        finals = await rt.wait(ids, timeout=120)
        for record in finals.values():
            assert_each_call_failed_alone(record)
        after = rt.tool_worker("default", 0)
        assert after is not None and (await after.hello()).pid == before  # never restarted
    finally:
        await rt.shutdown()


def test_a_sync_tool_that_never_returns_does_not_hold_the_process(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Its call times out, the turn answers, and ``run --in-process`` exits: the thread is left
    running, not joined (asyncio's own pool held the process at exit for ever)."""
    report = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "actors.cli", "run", "--in-process", "--redis-url", redis_url,
         "--namespace", namespace, "--config", str(ROOT / "configs" / "test.toml"),
         "--agent", "tests.support.agents:hanging", "--input", "go", "--turns", "2",
         "--run-id", "hang", "--report", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(report.read_text())["outcomes"] == {"answered": 2}
    assert "given up while its thread runs on" in done.stderr


async def test_sync_tool_calls_of_a_batch_run_at_once(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """Eight sync calls meet at a barrier of eight: none waits for a free thread of a pool
    sized for the cores (six here), which would time the barrier out."""
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    await engine.run_new("tests.support.agents:meeting", TurnInput(message="go"), ["meet"])
    final = await engine.store.load("meet")
    results = [m.tool_result for m in final.messages if m.tool_result is not None]
    assert [r.status for r in results] == ["ok"] * 8, results


async def test_sync_calls_past_the_threads_setting_wait_and_say_so(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """``[tools] threads = 2``: of six sync calls at once, two run and four wait, each told
    to watchers as waiting (not running) until its wait is over, then run."""
    events: list[LiveEvent] = []
    settings = EngineSettings(loop=FAST, watchdog=None, tool_threads=2)
    engine = TurnEngine(real_client, keys, settings, EngineHooks(on_event=events.append))
    await engine.run_new("tests.support.agents:crowd", TurnInput(message="go"), ["crowd"])
    final = await engine.store.load("crowd")
    results = [m.tool_result for m in final.messages if m.tool_result is not None]
    assert [r.status for r in results] == ["ok"] * 6, results
    assert CROWD.most == 2
    waits = [e for e in events if isinstance(e, ToolWaiting)]
    assert {e.waits_for for e in waits} == {ToolWait.THREADS}
    began = [e.call_id for e in waits if not e.over]
    ended = [e.call_id for e in waits if e.over]
    assert len(began) == 4 and sorted(began) == sorted(ended)
    for call in began:  # waiting, then running, then its result
        at = [i for i, e in enumerate(events) if getattr(e, "call_id", None) == call]
        kinds = [type(events[i]).__name__ for i in at]
        assert kinds[-3:] == ["ToolWaiting", "ToolWaiting", "ToolReturned"], kinds


async def test_calls_past_a_tools_own_limit_wait_and_say_so() -> None:
    """A tool of ``max_concurrency = 1``: a second call waits for the first, told as waiting
    for the tool's limit, not for a thread."""
    events: list[LiveEvent] = []
    runner = LocalToolRunner(on_event=events.append)
    gate = asyncio.Event()

    async def slow(args: Mapping[str, Any], ctx: ToolContext) -> str:
        await gate.wait()
        return "done"

    spec = ToolSpec("slow", slow, idempotent=True, max_concurrency=1)
    ctx = ToolContext("t1", "k", epoch=3)
    calls = [ToolCall(id=f"s{i}", name="slow", args={}) for i in range(2)]
    running = [asyncio.ensure_future(runner.run(spec, c, ctx)) for c in calls]

    async def second_waits() -> bool:
        return any(isinstance(e, ToolWaiting) for e in events)

    await eventually(second_waits, timeout=10, what="the second call to wait")
    (wait,) = events
    assert isinstance(wait, ToolWaiting)
    assert (wait.call_id, wait.epoch, wait.waits_for, wait.over) == (
        "s1",
        3,
        ToolWait.TOOL_LIMIT,
        False,
    )
    gate.set()
    assert [r.status for r in await asyncio.gather(*running)] == ["ok", "ok"]
    assert [(e.call_id, e.over) for e in events if isinstance(e, ToolWaiting)] == [
        ("s1", False),
        ("s1", True),
    ]


async def test_an_async_tool_that_blocks_the_event_loop_is_reported(
    real_client: aioredis.Redis, keys: KeyLayout, caplog: pytest.LogCaptureFixture
) -> None:
    """It stalls every turn of the process while it runs, and nothing can stop it; it is
    named, with how long it held the loop (it used to pass in silence)."""
    before = BLOCKED["hogs"]
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    with caplog.at_level(logging.WARNING, logger="actors.turn.tools"):
        await engine.run_new("tests.support.agents:hogging", TurnInput(message="go"), ["hog"])
    final = await engine.store.load("hog")
    assert final.counters.outcome == "answered"
    assert BLOCKED["hogs"] == before + 1
    assert any("tool hogs held the event loop for 0.8 s" in r.message for r in caplog.records)
