"""The recovery policy: one pure function, first match wins, the order is the policy.

1. hard idle timeout                                   -> abort
2. context-length error, not yet reactively compacted  -> compact, then retry
3. a reply with tool calls cut by the caller's
   ``max_tokens`` cap, not yet retried                 -> retry at once with twice the room
4. retryable model error, attempts < 3                 -> retry after 1 s, 2 s, 4 s
5. the loop detector says stop                         -> force stop
6. a behaviour problem (empty reply, suspected loop),
   nudges < 3                                          -> nudge and continue
7. anything else                                       -> abort

Rule 6 applies to problems a message to the model can fix; a fatal error, a retryable error
out of attempts or a second context-length error fall through to abort (docs/ARCHITECTURE.md).
A reply cut by the caller's cap is not a context-length error (only the endpoint's own error
means the transcript is too long): a cut *text* reply never reaches this policy, the loop keeps
it as the answer (outcome ``truncated``); a cut tool call cannot be run (its arguments may be
cut), so it is asked again once with room to finish (rule 3), and a second cut ends the turn
``aborted:truncated``. Every model call of a turn, the force stop's wrap-up included, goes
through this one policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MAX_RETRIES = 3
MAX_NUDGES = 3
MAX_CUT_RETRIES = 1

#: Every nudge starts with this, so a transcript reader (or the scripted model) can tell one.
NUDGE_PREFIX = "[nudge]"


class Problem(StrEnum):
    HARD_IDLE_TIMEOUT = "hard_idle_timeout"
    """The watchdog cancelled the model call."""
    CONTEXT_LENGTH = "context_length"
    """The transcript does not fit the model."""
    RETRYABLE = "retryable"
    """Transient model failure."""
    FATAL = "fatal"
    """Model failure that will not go away."""
    TRUNCATED = "truncated"
    """A reply with tool calls was cut by the caller's ``max_tokens`` cap."""
    EMPTY_REPLY = "empty_reply"
    """The model answered nothing."""
    LOOP = "loop"
    """The model repeats its tool calls."""


class Action(StrEnum):
    ABORT = "abort"
    """End the turn now, saving what it has."""
    COMPACT = "compact"
    """Compact the transcript, checkpoint, call the model again."""
    RETRY = "retry"
    """Back off in ``retrying_llm``, then call again."""
    FORCE_STOP = "force_stop"
    """Checkpoint, enter ``force_stop``, one tool-less wrap-up call, done."""
    NUDGE = "nudge"
    """Append a system-injected user message and call again."""


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


_NUDGEABLE = frozenset({Problem.EMPTY_REPLY, Problem.LOOP})


def decide_recovery(s: Situation) -> Decision:
    if s.problem is Problem.HARD_IDLE_TIMEOUT:
        return Decision(Action.ABORT, s.problem)
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


def nudge_text(problem: Problem) -> str:
    if problem is Problem.LOOP:
        return (
            f"{NUDGE_PREFIX} You are repeating the same tool calls. Try a different approach "
            "or give your final answer."
        )
    return f"{NUDGE_PREFIX} Your last reply was empty. Please continue the task."
