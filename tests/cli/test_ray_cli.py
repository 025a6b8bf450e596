"""The Ray-backed CLI verbs, end to end on the session's local Ray: run, resume, demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from actors.cli import main

ROOT = Path(__file__).resolve().parents[2]
TEST_CONFIG = str(ROOT / "configs" / "test.toml")

pytestmark = pytest.mark.usefixtures("ray_cluster")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_run_on_ray_then_inspect(redis_url: str, namespace: str, tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text('name = "cli"\nrounds = 3\ntools_per_round = 2\nllm_latency_ms = 20\n')
    report = tmp_path / "r.json"
    code, out = invoke(
        "run", "--redis-url", redis_url, "--namespace", namespace, "--config", TEST_CONFIG,
        "--scenario", str(scenario), "--turns", "12", "--hosts", "2", "--run-id", "ray",
        "--report", str(report),
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(report.read_text())
    assert data["outcomes"] == {"answered": 12}
    assert len(data["host_rss_mib"]) == 2
    code, out = invoke(
        "inspect", "ray-t000003", "--redis-url", redis_url, "--namespace", namespace, "--json"
    )
    assert code == 0 and json.loads(out)["in_progress"] is False


def test_demo_kills_a_host_and_gives_the_verdict(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(  # as the shipped demo: random replies, a tool that acts then waits
        'name = "demo"\nrounds = 6\ntools_per_round = 2\nllm_latency_ms = 100\n'
        'tools = ["echo", "send"]\ntool_latency_ms = 300\nreplies = "random"\n'
    )
    report = tmp_path / "demo.json"
    # The default kill (--kill-at 0.3): these short, identical turns run in lockstep, and the
    # kill used to wait for 30 % of them to *finish*, when host 0 had nothing left in flight
    # (resumed 0). It comes once 30 % have durable progress, while they run.
    code, out = invoke(
        "demo", "--redis-url", redis_url, "--namespace", namespace, "--config", TEST_CONFIG,
        "--scenario", str(scenario), "--turns", "30", "--report", str(report),
    )  # fmt: skip
    assert code == 0, out
    data = json.loads(report.read_text())
    assert data["ok"] is True and data["completed"] == data["correct"] == 30
    assert len(data["kills"]) == 1 and data["respawns"] >= 1 and data["resumed"] >= 1
    assert data["kills"][0]["finished_before"] < 9  # not after 30 % of the turns finished
    assert data["verdict"]["verdict"] == "promises"  # the default for random replies
    assert data["duplicate_side_effects"] == data["orphaned_side_effects"] == 0
    assert data["model_calls"] >= 30 * 7 and data["calls_repaid"] is not None
    assert "verdict (promises)" in out and "ok" in out and "calls_repaid" in out
