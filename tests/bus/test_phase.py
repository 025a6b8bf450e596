from __future__ import annotations

import pytest

from bus.errors import IllegalTransition
from bus.phase import ALLOWED, TRANSIENTS, PhaseTracker, Transition, TurnPhase, counts_as_idle

P = TurnPhase


def test_ten_phases_with_their_wire_values() -> None:
    assert [p.value for p in P] == [
        "init", "setup", "awaiting_llm", "retrying_llm", "compacting", "awaiting_approval",
        "executing_tools", "injecting_message", "force_stop", "done",
    ]  # fmt: skip
    assert set(ALLOWED) == set(P)


def test_only_awaiting_llm_and_force_stop_count_as_idle() -> None:
    assert {p for p in P if counts_as_idle(p)} == {P.AWAITING_LLM, P.FORCE_STOP}


def test_happy_path_bumps_seq_and_publishes_every_move() -> None:
    seen: list[Transition] = []
    clock = iter(range(100))
    t = PhaseTracker(
        "t1", epoch=3, strict=True, clock=lambda: float(next(clock)), listener=seen.append
    )
    for dst in (P.SETUP, P.AWAITING_LLM, P.EXECUTING_TOOLS, P.AWAITING_LLM, P.DONE):
        t.to(dst)
    assert t.seq == 5
    assert [(e.src, e.dst, e.seq, e.epoch) for e in seen] == [
        (P.INIT, P.SETUP, 1, 3), (P.SETUP, P.AWAITING_LLM, 2, 3),
        (P.AWAITING_LLM, P.EXECUTING_TOOLS, 3, 3), (P.EXECUTING_TOOLS, P.AWAITING_LLM, 4, 3),
        (P.AWAITING_LLM, P.DONE, 5, 3),
    ]  # fmt: skip
    assert t.entered_at == 5.0


@pytest.mark.parametrize(
    ("src_path", "bad"),
    [
        ((), P.AWAITING_LLM),  # init -> awaiting_llm skips setup
        ((P.SETUP,), P.EXECUTING_TOOLS),
        ((P.SETUP, P.AWAITING_LLM, P.DONE), P.SETUP),  # nothing leaves done
        ((P.SETUP, P.AWAITING_LLM, P.RETRYING_LLM), P.EXECUTING_TOOLS),
        ((P.SETUP, P.AWAITING_LLM), P.AWAITING_APPROVAL),  # approvals only from tools
    ],
)
def test_strict_mode_raises_on_illegal_transition(src_path: tuple[P, ...], bad: P) -> None:
    t = PhaseTracker("t1", strict=True)
    for p in src_path:
        t.to(p)
    with pytest.raises(IllegalTransition, match=f"-> {bad.value}"):
        t.to(bad)
    assert t.phase is (src_path[-1] if src_path else P.INIT)


def test_lenient_mode_logs_counts_and_moves(caplog: pytest.LogCaptureFixture) -> None:
    t = PhaseTracker("t1", strict=False)
    t.to(P.EXECUTING_TOOLS)
    assert t.illegal_count == 1
    assert t.phase is P.EXECUTING_TOOLS
    assert "illegal transition init -> executing_tools" in caplog.text


@pytest.mark.parametrize("transient", sorted(TRANSIENTS))
def test_transients_restore_the_phase_they_interrupted(transient: P) -> None:
    t = PhaseTracker("t1", strict=True)
    t.to(P.SETUP)
    t.to(P.AWAITING_LLM)
    host = P.EXECUTING_TOOLS if transient is P.AWAITING_APPROVAL else P.AWAITING_LLM
    if host is P.EXECUTING_TOOLS:
        t.to(host)
    t.to(transient)
    assert t.interrupted is host
    back = t.restore()
    assert (back.src, back.dst) == (transient, host)
    assert t.phase is host and t.interrupted is None


def test_restore_outside_a_transient_is_illegal() -> None:
    t = PhaseTracker("t1", strict=True)
    t.to(P.SETUP)
    with pytest.raises(IllegalTransition):
        t.restore()


def test_transients_do_not_nest_and_can_end_the_turn() -> None:
    t = PhaseTracker("t1", strict=True)
    for p in (P.SETUP, P.AWAITING_LLM, P.EXECUTING_TOOLS, P.AWAITING_APPROVAL):
        t.to(p)
    with pytest.raises(IllegalTransition):
        t.to(P.INJECTING_MESSAGE)
    t.to(P.DONE)
    assert t.phase is P.DONE and t.interrupted is None
