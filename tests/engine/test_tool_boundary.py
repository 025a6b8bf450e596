"""A tool that raises what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``, a bare
``BaseException``, a ``CancelledError`` nobody asked for) fails its call, not the process: in
``phaseline run --in-process`` (a real child process, which such a tool used to end with status
3 and every turn in progress) and on a Ray ToolWorker (which it used to kill)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import redis.asyncio as aioredis

from actors.cluster.runtime import Runtime
from actors.engine.config import Settings
from store.checkpoint import RedisCheckpointStore
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnInput

ROOT = Path(__file__).resolve().parents[2]
RAISER = "tests.support.agents:raiser"
BAD = ("exits", "interrupts", "raises_base", "cancels_itself", "exits_in_a_thread")


def assert_each_call_failed_alone(record: CheckpointRecord) -> None:
    results = {m.tool_result.name: m.tool_result for m in record.messages if m.tool_result}
    assert results["add"].status == "ok" and results["add"].output == "5"
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
