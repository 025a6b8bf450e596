"""Pure parts of the chaos harness: target parsing, recovery latency, the timeline picture."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from actors.harness.chaos import recoveries
from actors.harness.chaos_report import PLOT_ROWS, ChaosReport, Fault, plot_rows
from actors.harness.targets import LOCAL_ONLY, TARGETS, ChaosTarget, parse_targets
from actors.harness.timeline import plot_timeline
from actors.harness.verdict import Verdict
from bus.errors import ConfigError
from bus.phase import Transition, TurnPhase

P = TurnPhase


def test_targets_are_validated() -> None:
    local = tuple(t for t in TARGETS if t not in LOCAL_ONLY)
    assert parse_targets("all", embedded=True, nodes=True, cluster=True, http=True) == local
    assert parse_targets("all", embedded=True, nodes=True, http=True) == tuple(
        t for t in TARGETS if t is not ChaosTarget.REDIS_FAILOVER
    )
    # a scenario's model is in process: its hosts can lose Redis, not a provider
    assert "partition" in parse_targets("all", embedded=True)
    assert "provider" not in parse_targets("all", embedded=True)
    with pytest.raises(ConfigError, match="OPENAI_BASE_URL"):
        parse_targets("provider", embedded=True)
    with pytest.raises(ConfigError, match="without --ray-address"):
        parse_targets("partition", embedded=True, local=False)
    assert "redis" not in parse_targets("all", embedded=False)  # needs the embedded server
    assert "node" not in parse_targets("all", embedded=True)  # needs a local multi-node cluster
    assert parse_targets("node,host", embedded=False, nodes=True) == ("node", "host")
    with pytest.raises(ConfigError, match="--nodes 2"):
        parse_targets("node", embedded=True)
    assert parse_targets("host, tool", embedded=False) == ("host", "tool")
    with pytest.raises(ConfigError, match="unknown chaos targets"):
        parse_targets("host,gremlin", embedded=True)
    with pytest.raises(ConfigError, match="embedded"):
        parse_targets("redis", embedded=False)


def move(turn: str, epoch: int, at_s: float, dst: P = P.AWAITING_LLM) -> Transition:
    return Transition(turn, epoch, 1, P.SETUP, dst, int((1000 + at_s) * 1000))


def test_recovery_latency_is_kill_to_first_move_under_a_newer_epoch() -> None:
    fault = Fault(
        at_s=10.0, target=ChaosTarget.HOST, victim="host0", pid=1, affected={"a": 1, "b": 2}
    )
    moves = [
        move("a", 1, 9.0), move("a", 1, 10.5),  # the dead owner's moves do not count
        move("a", 2, 12.0), move("a", 2, 13.0),
        move("b", 3, 10.25),
    ]  # fmt: skip
    got = {t: (round(ms), kind) for t, _, ms, kind in recoveries(moves, [fault], 1000.0)}
    assert got == {"a": (2000, "host"), "b": (250, "host")}


def report_with(verdict: Verdict, recovered: list[tuple[str, float, float, str]]) -> ChaosReport:
    return ChaosReport(
        config={}, verdict=verdict, faults=[], wall_s=1.0, respawns=0, started_at=0.0,
        latency_ms=[ms for _, _, ms, _ in recovered], moves=[], recovered=recovered,
        turn_ids=[f"t{i}" for i in range(100)],
    )  # fmt: skip


def test_recovery_latency_is_reported_per_fault_kind() -> None:
    rec = [("a", 1, 100.0, "host"), ("b", 1, 300.0, "host"), ("c", 2, 9000.0, "freeze")]
    by_kind = report_with(Verdict(turns=3), rec).as_dict()["recovery_latency_ms_by_kind"]
    assert by_kind["host"]["n"] == 2 and by_kind["host"]["p99"] == 300.0
    assert by_kind["freeze"]["p50"] == 9000.0


def test_each_fault_reports_when_its_last_turn_moved_again() -> None:
    node = Fault(
        at_s=10.0, target=ChaosTarget.NODE, victim="n1", pid=None, affected={"a": 1, "b": 1}
    )
    late = Fault(at_s=20.0, target=ChaosTarget.NODE, victim="n2", pid=None, affected={"c": 1})
    idle = Fault(at_s=30.0, target=ChaosTarget.NODE, victim="n3", pid=None)  # no turns on it
    moves = [move("a", 2, 11.0), move("b", 2, 13.5), move("c", 2, 21.0)]
    report = dataclasses.replace(
        report_with(Verdict(turns=3), []), faults=[node, late, idle], moves=moves,
        started_at=1000.0,
    )  # fmt: skip
    data = report.as_dict()
    assert [f["recovery_ms"] and f["recovery_ms"]["max"] for f in data["faults"]] == [
        3500.0, 1000.0, None
    ]  # fmt: skip
    last = data["recovery_last_turn_ms_by_kind"]["node"]
    assert last["n"] == 2 and last["max"] == 3500.0 and last["p50"] in (1000.0, 3500.0)


def test_the_timeline_always_shows_failed_suspended_and_most_resumed_turns() -> None:
    v = Verdict(turns=100, flagged={"t95", "t96"}, resumes={f"t{i}": i % 3 for i in range(100)})
    v.poison["t97"] = {"outcome": "suspended:poison"}
    rows, highlighted = plot_rows(report_with(v, []))
    assert rows[:3] == ["t95", "t96", "t97"]
    assert {"t95", "t96", "t97"} <= highlighted and {"t2", "t5"} <= highlighted
    assert len(rows) == PLOT_ROWS and len(set(rows)) == len(rows)


def test_the_timeline_is_drawn(tmp_path: Path) -> None:
    moves = [move("a", 1, 0, P.AWAITING_LLM), move("a", 1, 1, P.EXECUTING_TOOLS),
             move("a", 2, 3, P.AWAITING_LLM), move("a", 2, 4, P.DONE)]  # fmt: skip
    out = tmp_path / "t.png"
    kills = [(2.0, "host host0"), (2.01, "freeze host1")]
    plot_timeline(moves, kills, [("a", 3.0)], 1000.0, out, sample=["a"], title="t", highlight={"a"})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_a_rival_resume_counts_as_a_fault_only_when_it_took_turns_over() -> None:
    assert "concurrent_resume" in parse_targets("all", embedded=False)
    assert Fault(1.0, ChaosTarget.CONCURRENT_RESUME, "host0", None, {"t1": 2}).landed
    assert not Fault(1.0, ChaosTarget.CONCURRENT_RESUME, "host0", None, {}).landed
    assert not Fault(1.0, ChaosTarget.HOST, "-", None, note="skipped: no host", skipped=True).landed
    assert Fault(1.0, ChaosTarget.REDIS, "redis-server", None).landed
    assert Fault(1.0, ChaosTarget.POWER_LOSS, "redis-server", None).landed
    assert "power_loss" not in parse_targets("all", embedded=False)
    with pytest.raises(ConfigError, match="restart the embedded server"):
        parse_targets("host,power_loss", embedded=False)


def test_a_redis_failover_needs_the_local_redis_cluster() -> None:
    assert "redis_failover" not in parse_targets("all", embedded=True, nodes=True)
    assert "redis_failover" in parse_targets("all", embedded=False, cluster=True)
    with pytest.raises(ConfigError, match="--redis-cluster"):
        parse_targets("host,redis_failover", embedded=True)
    assert Fault(1.0, ChaosTarget.REDIS_FAILOVER, "primary :7000", None).landed
    assert not Fault(
        1.0, ChaosTarget.REDIS_FAILOVER, "-", None, note="skipped", skipped=True
    ).landed
