"""Pure parts of the chaos harness: target parsing, recovery latency, the timeline picture."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.chaos import TARGETS, Fault, parse_targets, recoveries
from actors.timeline import plot_timeline
from bus.errors import ConfigError
from bus.phase import Transition, TurnPhase

P = TurnPhase


def test_targets_are_validated() -> None:
    assert parse_targets("all", embedded=True) == TARGETS
    assert "redis" not in parse_targets("all", embedded=False)  # needs the embedded server
    assert parse_targets("host, tool", embedded=False) == ("host", "tool")
    with pytest.raises(ConfigError, match="unknown chaos targets"):
        parse_targets("host,gremlin", embedded=True)
    with pytest.raises(ConfigError, match="embedded"):
        parse_targets("redis", embedded=False)


def move(turn: str, epoch: int, at_s: float, dst: P = P.AWAITING_LLM) -> Transition:
    return Transition(turn, epoch, 1, P.SETUP, dst, int((1000 + at_s) * 1000))


def test_recovery_latency_is_kill_to_first_move_under_a_newer_epoch() -> None:
    fault = Fault(at_s=10.0, target="host", victim="host0", pid=1, affected={"a": 1, "b": 2})
    moves = [
        move("a", 1, 9.0), move("a", 1, 10.5),  # the dead owner's moves do not count
        move("a", 2, 12.0), move("a", 2, 13.0),
        move("b", 3, 10.25),
    ]  # fmt: skip
    got = {t: round(ms) for t, _, ms in recoveries(moves, [fault], t0_unix=1000.0)}
    assert got == {"a": 2000, "b": 250}


def test_the_timeline_is_drawn(tmp_path: Path) -> None:
    moves = [move("a", 1, 0, P.AWAITING_LLM), move("a", 1, 1, P.EXECUTING_TOOLS),
             move("a", 2, 3, P.AWAITING_LLM), move("a", 2, 4, P.DONE)]  # fmt: skip
    out = tmp_path / "t.png"
    plot_timeline(moves, [(2.0, "host")], [("a", 3.0)], 1000.0, out, sample=["a"], title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_a_rival_resume_counts_as_a_fault_only_when_it_took_turns_over() -> None:
    assert "concurrent_resume" in parse_targets("all", embedded=False)
    assert Fault(1.0, "concurrent_resume", "host0", None, {"t1": 2}).landed
    assert not Fault(1.0, "concurrent_resume", "host0", None, {}).landed
    assert not Fault(1.0, "host", "-", None, note="skipped").landed
    assert Fault(1.0, "redis", "redis-server", None).landed
    assert Fault(1.0, "power_loss", "redis-server", None).landed
    assert "power_loss" not in parse_targets("all", embedded=False)
    with pytest.raises(ConfigError, match="restart the embedded server"):
        parse_targets("host,power_loss", embedded=False)
