"""decide_recovery as a table: every rule, and the order between them."""

from __future__ import annotations

import pytest

from actors.turn.recovery import Situation, decide_recovery
from bus.outcomes import Action, Outcome, OutcomeKind, Problem, RecordProblem, SuspendCause

Pr = Problem
A = Action
RL = "rate_limited"

CASES = [
    # (situation, action, cause, backoff)
    (Situation(Pr.HARD_IDLE_TIMEOUT), A.ABORT, "hard_idle_timeout", 0),
    # rule 1 beats everything, even a loop stop with nudges left
    (Situation(Pr.HARD_IDLE_TIMEOUT, loop_stop=True), A.ABORT, "hard_idle_timeout", 0),
    (Situation(Pr.CONTEXT_LENGTH), A.COMPACT, "context_length", 0),
    # compaction only once; then context-length is not nudgeable: abort
    (Situation(Pr.CONTEXT_LENGTH, reactive_compacted=True), A.ABORT, "context_length", 0),
    # rule 2 before rule 4
    (Situation(Pr.CONTEXT_LENGTH, loop_stop=True), A.COMPACT, "context_length", 0),
    (Situation(Pr.RETRYABLE, retry_attempts=0), A.RETRY, "retryable", 1),
    (Situation(Pr.RETRYABLE, retry_attempts=1), A.RETRY, "retryable", 2),
    (Situation(Pr.RETRYABLE, retry_attempts=2), A.RETRY, "retryable", 4),
    (Situation(Pr.RETRYABLE, retry_attempts=3), A.ABORT, "retryable", 0),
    # rule 3 before rule 4
    (Situation(Pr.RETRYABLE, loop_stop=True), A.RETRY, "retryable", 1),
    # out of retries, a loop stop still force-stops (rule 4 before 6)
    (Situation(Pr.RETRYABLE, retry_attempts=3, loop_stop=True), A.FORCE_STOP, "loop", 0),
    (Situation(Pr.LOOP, loop_stop=True), A.FORCE_STOP, "loop", 0),
    # rule 4 before rule 5: a stop is not nudged even with nudges left
    (Situation(Pr.LOOP, loop_stop=True, nudges=0), A.FORCE_STOP, "loop", 0),
    (Situation(Pr.LOOP, nudges=0), A.NUDGE, "loop", 0),
    (Situation(Pr.LOOP, nudges=2), A.NUDGE, "loop", 0),
    (Situation(Pr.LOOP, nudges=3), A.ABORT, "loop", 0),
    (Situation(Pr.EMPTY_REPLY, nudges=0), A.NUDGE, "empty_reply", 0),
    (Situation(Pr.EMPTY_REPLY, nudges=3), A.ABORT, "empty_reply", 0),
    (Situation(Pr.OVERSIZED_REPLY, nudges=2), A.NUDGE, "oversized_reply", 0),
    (Situation(Pr.OVERSIZED_REPLY, nudges=3), A.ABORT, "oversized_reply", 0),
    (Situation(Pr.FATAL), A.ABORT, "fatal", 0),
    # a tool call cut by the caller's cap: asked again once at once (with more room), no
    # transient attempt spent, never a compaction; a second cut aborts as truncated
    (Situation(Pr.TRUNCATED), A.RETRY, "truncated", 0),
    (Situation(Pr.TRUNCATED, retry_attempts=3), A.RETRY, "truncated", 0),
    (Situation(Pr.TRUNCATED, cut_retries=1), A.ABORT, "truncated", 0),
    (Situation(Pr.FATAL, nudges=0), A.ABORT, "fatal", 0),
    # rule 2: a rate limit waits as asked, spends no attempt, beats everything but rule 1
    (Situation(Pr.RATE_LIMITED, retry_after_s=7.5), A.WAIT, "rate_limited", 7.5),
    (Situation(Pr.RATE_LIMITED, retry_after_s=2, retry_attempts=3), A.WAIT, "rate_limited", 2),
    (Situation(Pr.RATE_LIMITED, retry_after_s=2, loop_stop=True), A.WAIT, "rate_limited", 2),
    # no wait named: 1 s doubling, times 0.5-1.0 (jitter 1.0 here), at most 60 s
    (Situation(Pr.RATE_LIMITED, rate_limit_waits=0), A.WAIT, "rate_limited", 1),
    (Situation(Pr.RATE_LIMITED, rate_limit_waits=3, jitter=0.0), A.WAIT, "rate_limited", 4),
    (Situation(Pr.RATE_LIMITED, rate_limit_waits=12), A.WAIT, "rate_limited", 60),
    # never past the call's cap, and past it an abort
    (Situation(Pr.RATE_LIMITED, retry_after_s=900, rate_limit_waited_s=500), A.WAIT, RL, 100),
    (Situation(Pr.RATE_LIMITED, retry_after_s=1, rate_limit_waited_s=600), A.ABORT, RL, 0),
]


@pytest.mark.parametrize(("situation", "action", "cause", "backoff"), CASES)
def test_decide_recovery(situation: Situation, action: Action, cause: str, backoff: float) -> None:
    d = decide_recovery(situation)
    assert (d.action, d.cause, d.backoff_s) == (action, cause, backoff)


def test_every_problem_the_policy_can_abort_for_has_an_outcome() -> None:
    # the two a store refusal ends a turn with, not the recovery policy
    assert {Outcome.aborted_by(p) for p in Problem} == {o for o in Outcome if o.aborted} - {
        Outcome.ABORTED_RECORD_TOO_LARGE,
        Outcome.ABORTED_UNSTORABLE,
    }
    assert all(Outcome.aborted_by(p).cause is p for p in Problem)


def test_an_outcome_is_a_kind_and_a_cause() -> None:
    assert (Outcome.ANSWERED.kind, Outcome.ANSWERED.cause) == (OutcomeKind.ANSWERED, None)
    assert Outcome.ABORTED_UNSTORABLE.cause is RecordProblem.UNSTORABLE
    assert Outcome.SUSPENDED_FAILING.kind is OutcomeKind.SUSPENDED
    assert Outcome.SUSPENDED_FAILING.cause is SuspendCause.FAILING
    assert Outcome.CANCELLED.kind is OutcomeKind.CANCELLED and not Outcome.CANCELLED.aborted


def test_every_action_is_reachable() -> None:
    assert {a for _, a, _, _ in CASES} == set(Action) - {Action.CONTINUE}  # the engine's
