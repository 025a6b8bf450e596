"""The recovery policy: one pure function, first match wins, the order is the policy.

1. hard idle timeout                                   -> abort
2. the endpoint's rate limit, waited less than the
   per-call cap                                        -> wait as long as it asked
3. context-length error, not yet reactively compacted  -> compact, then retry
4. a reply with tool calls cut by the caller's
   ``max_tokens`` cap, not yet retried                 -> retry at once with twice the room
5. retryable model error, attempts < 3                 -> retry after 1 s, 2 s, 4 s
6. the loop detector says stop                         -> force stop
7. a behaviour problem (empty or oversized reply,
   suspected loop),
   nudges < 3                                          -> nudge and continue
8. anything else                                       -> abort

Rule 2 comes right after the watchdog's: a rate-limit refusal is no fault of the call or the
transcript, only a turn to wait, so it never spends the transient-error attempts of rule 5 and
never aborts a turn within its cap (``LoopSettings.rate_limit_max_wait_s``, minutes by
default). The wait is what the endpoint asked (``retry-after`` and its kin), else an
exponential backoff with jitter (1 s doubling to 60 s, times 0.5-1.0), never past the cap;
past the cap the turn aborts ``rate_limited``.

Rule 7 applies to problems a message to the model can fix; a fatal error, a retryable error
out of attempts or a second context-length error fall through to abort (docs/DECISIONS.md).
A reply cut by the caller's cap is not a context-length error (only the endpoint's own error
means the transcript is too long): a cut *text* reply never reaches this policy, the loop keeps
it as the answer (outcome ``truncated``); a cut tool call cannot be run (its arguments may be
cut), so it is asked again once with room to finish (rule 4), and a second cut ends the turn
``aborted:truncated``. Every model call of a turn, the force stop's wrap-up included, goes
through this one policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.outcomes import Action, Problem

MAX_RETRIES = 3
MAX_NUDGES = 3
MAX_CUT_RETRIES = 1
#: Longest backoff between two rate-limit refusals that named no wait of their own.
MAX_RATE_BACKOFF_S = 60.0

#: Every nudge starts with this, so a transcript reader (or the scripted model) can tell one.
NUDGE_PREFIX = "[nudge]"


@dataclass(frozen=True, slots=True)
class Situation:
    """Everything the policy may look at."""

    problem: Problem
    """What went wrong."""
    reactive_compacted: bool = False
    """A reactive compaction already happened this turn."""
    retry_attempts: int = 0
    """Retries already spent on the current call."""
    loop_stop: bool = False
    """The loop detector says stop."""
    nudges: int = 0
    """Nudges already sent this turn."""
    cut_retries: int = 0
    """Retries already spent on a cut tool-call reply of the current call."""
    retry_after_s: float | None = None
    """How long the endpoint asked to wait (a rate-limit refusal; None: it did not say)."""
    rate_limit_waits: int = 0
    """Rate-limit waits already spent on the current call."""
    rate_limit_waited_s: float = 0.0
    """Seconds already waited on the current call's rate limit."""
    rate_limit_max_wait_s: float = 600.0
    """Cap on those seconds; past it a rate-limited call aborts the turn."""
    jitter: float = 1.0
    """A number in [0, 1] drawn by the caller: spreads the backoff of turns refused together
    (the policy itself stays a pure function)."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    """What to do."""
    cause: Problem
    """Why, for logs and the turn's outcome (``aborted:<problem>``)."""
    backoff_s: float = 0.0
    """Seconds to wait in ``retrying_llm`` (RETRY only)."""
    more_room: bool = False
    """Ask again with twice the reply's token cap (RETRY of a cut reply only)."""


_NUDGEABLE = frozenset({Problem.EMPTY_REPLY, Problem.OVERSIZED_REPLY, Problem.LOOP})


def decide_recovery(s: Situation) -> Decision:
    if s.problem is Problem.HARD_IDLE_TIMEOUT:
        return Decision(Action.ABORT, s.problem)
    if s.problem is Problem.RATE_LIMITED and s.rate_limit_waited_s < s.rate_limit_max_wait_s:
        return Decision(Action.WAIT, s.problem, backoff_s=rate_limit_wait_s(s))
    if s.problem is Problem.CONTEXT_LENGTH and not s.reactive_compacted:
        return Decision(Action.COMPACT, s.problem)
    if s.problem is Problem.TRUNCATED and s.cut_retries < MAX_CUT_RETRIES:
        return Decision(Action.RETRY, s.problem, more_room=True)
    if s.problem is Problem.RETRYABLE and s.retry_attempts < MAX_RETRIES:
        return Decision(Action.RETRY, s.problem, backoff_s=float(2**s.retry_attempts))
    if s.loop_stop:
        return Decision(Action.FORCE_STOP, Problem.LOOP)
    if s.problem in _NUDGEABLE and s.nudges < MAX_NUDGES:
        return Decision(Action.NUDGE, s.problem)
    return Decision(Action.ABORT, s.problem)


def rate_limit_wait_s(s: Situation) -> float:
    """Rule 2's wait: what the endpoint asked, else a jittered exponential backoff; never past
    the call's remaining cap."""
    if s.retry_after_s is not None:
        wait = s.retry_after_s
    else:
        wait = min(MAX_RATE_BACKOFF_S, float(2**s.rate_limit_waits)) * (0.5 + 0.5 * s.jitter)
    return max(0.0, min(wait, s.rate_limit_max_wait_s - s.rate_limit_waited_s))


def nudge_text(problem: Problem, detail: str = "") -> str:
    """What the model is told; ``detail`` says what was wrong (an oversized reply's size)."""
    if problem is Problem.LOOP:
        return (
            f"{NUDGE_PREFIX} You are repeating the same tool calls. Try a different approach "
            "or give your final answer."
        )
    if problem is Problem.OVERSIZED_REPLY:
        return (
            f"{NUDGE_PREFIX} Your last reply was not kept: {detail}. Reply with less: "
            "summarise, or do the work in smaller steps."
        )
    return f"{NUDGE_PREFIX} Your last reply was empty. Please continue the task."
