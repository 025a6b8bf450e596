from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.turn.watchdog import HardCancel, SoftIdle, WatchdogRules, WatchdogSettings
from bus.phase import Transition, TurnPhase

P = TurnPhase


def move(dst: P, at: float, seq: int, turn: str = "t1", epoch: int = 1) -> Transition:
    return Transition(turn, epoch, seq, P.SETUP, dst, int(at * 1000))


def test_soft_fires_once_per_transition_and_only_reports() -> None:
    rules = WatchdogRules(WatchdogSettings(soft_idle_s=90))
    rules.observe(move(P.AWAITING_LLM, 0, 1))
    assert rules.tick(89.9) == []
    (fired,) = rules.tick(90.0)
    assert isinstance(fired, SoftIdle)
    assert fired.turn_id == "t1" and fired.idle_s == 90.0
    assert "waiting for the model (1m 30s)" in fired.label
    assert rules.tick(500.0) == []  # once per transition


def test_a_transition_rearms() -> None:
    rules = WatchdogRules(WatchdogSettings(soft_idle_s=10))
    rules.observe(move(P.AWAITING_LLM, 0, 1))
    assert len(rules.tick(10)) == 1
    rules.observe(move(P.EXECUTING_TOOLS, 11, 2))
    assert rules.tick(100) == []  # not an idle phase
    rules.observe(move(P.AWAITING_LLM, 100, 3))
    assert rules.tick(105) == []
    assert len(rules.tick(110)) == 1


def test_stale_or_duplicate_transitions_are_ignored() -> None:
    rules = WatchdogRules(WatchdogSettings(soft_idle_s=10))
    rules.observe(move(P.AWAITING_LLM, 0, 5))
    rules.observe(move(P.AWAITING_LLM, 8, 4))  # older seq: does not re-arm
    assert len(rules.tick(10)) == 1


def test_hard_cancels_the_idle_turn_with_its_epoch() -> None:
    rules = WatchdogRules(WatchdogSettings(soft_idle_s=5, hard_idle_s=20))
    rules.observe(move(P.FORCE_STOP, 0, 1, epoch=2))
    assert [type(a) for a in rules.tick(5)] == [SoftIdle]
    assert rules.tick(19) == []
    assert rules.tick(20) == [HardCancel("t1", 2)]
    assert rules.tick(40) == []


def test_hard_zero_is_off_and_done_forgets() -> None:
    rules = WatchdogRules(WatchdogSettings(soft_idle_s=0, hard_idle_s=0))
    rules.observe(move(P.AWAITING_LLM, 0, 1))
    assert rules.tick(10_000) == []
    rules.observe(move(P.DONE, 1, 2))
    assert rules.watched() == 0


def test_non_idle_phases_are_never_timed() -> None:
    rules = WatchdogRules(WatchdogSettings(soft_idle_s=1, hard_idle_s=2))
    for seq, phase in enumerate([P.EXECUTING_TOOLS, P.RETRYING_LLM, P.AWAITING_APPROVAL], 1):
        rules.observe(move(phase, 0, seq))
        assert rules.tick(1000) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"soft_idle_s": -1},
        {"hard_idle_s": -0.5},
        {"tick_s": 0},
        {"soft_idle_s": 90, "hard_idle_s": 30},
    ],
)
def test_config_is_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        WatchdogSettings(**bad)


def test_hard_without_soft_is_allowed() -> None:
    assert WatchdogSettings(soft_idle_s=0, hard_idle_s=5).hard_idle_s == 5
