"""How a turn ends and why its records are written: the words every layer shares about a
turn's course (the loop decides them, the store keeps them, events, reports and views show
them).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ANSWER_OUTCOMES",
    "Action",
    "EngineProblem",
    "Outcome",
    "OutcomeKind",
    "Problem",
    "RecordProblem",
    "SaveReason",
    "SuspendCause",
]


class Problem(StrEnum):
    """What went wrong with a model call or reply: what the recovery policy
    (``actors.turn.recovery.decide_recovery``) decides about."""

    HARD_IDLE_TIMEOUT = "hard_idle_timeout"
    """The watchdog cancelled the model call."""
    CONTEXT_LENGTH = "context_length"
    """The transcript does not fit the model."""
    RATE_LIMITED = "rate_limited"
    """The endpoint refused the call for its rate limit."""
    RETRYABLE = "retryable"
    """Transient model failure."""
    FATAL = "fatal"
    """Model failure that will not go away."""
    TRUNCATED = "truncated"
    """A reply with tool calls was cut by the caller's ``max_tokens`` cap."""
    EMPTY_REPLY = "empty_reply"
    """The model answered nothing."""
    OVERSIZED_REPLY = "oversized_reply"
    """A reply over the loop's size limit for one reply (``[checkpoint]
    max_model_reply_bytes``); it was not kept."""
    LOOP = "loop"
    """The model repeats its tool calls."""


class Action(StrEnum):
    """What is done about a problem (the recovery policy's decisions, and the engine's)."""

    ABORT = "abort"
    """End the turn now, saving what it has."""
    COMPACT = "compact"
    """Compact the transcript, checkpoint, call the model again."""
    RETRY = "retry"
    """Back off in ``retrying_llm``, then call again."""
    WAIT = "wait"
    """Wait in ``retrying_llm`` as long as the endpoint's rate limit asks, then call again
    (spends no retry attempt)."""
    FORCE_STOP = "force_stop"
    """Checkpoint, enter ``force_stop``, one tool-less wrap-up call, done."""
    NUDGE = "nudge"
    """Append a system-injected user message and call again."""
    CONTINUE = "continue"
    """Go on as it is (the engine's answer to an agent that changed under a resumed turn; the
    policy never decides it)."""


class EngineProblem(StrEnum):
    """What the engine running a turn met, beside the model's problems (:class:`Problem`)."""

    AGENT_CHANGED = "agent_changed"
    """The turn resumed under a different agent than it started with."""
    RUN_FAILED = "run_failed"
    """A run of the turn ended in an unexpected error (a bug) on a host that stayed alive."""


class OutcomeKind(StrEnum):
    """How a turn ended, without the cause."""

    ANSWERED = "answered"
    """The model gave its final answer."""
    FORCE_STOPPED = "force_stopped"
    """Stopped by the loop detector; the model wrapped up without tools."""
    BUDGET_EXHAUSTED = "budget_exhausted"
    """Stopped by its agent's token budget; the model wrapped up without tools."""
    TRUNCATED = "truncated"
    """The final answer was cut by the agent's ``max_tokens`` cap and kept as it came."""
    ABORTED = "aborted"
    """Ended for a problem (:class:`Problem`) or because its record could not be stored
    (:class:`RecordProblem`)."""
    CANCELLED = "cancelled"
    """Cancelled by an operator."""
    SUSPENDED = "suspended"
    """Parked for a person (:class:`SuspendCause`); ``phaseline resume TURN`` goes on."""


class RecordProblem(StrEnum):
    """Why a turn's next record could not be stored (the turn ends on its last one)."""

    UNSTORABLE = "unstorable"
    """A value no encoder takes."""
    RECORD_TOO_LARGE = "record_too_large"
    """Over ``[checkpoint] max_record_bytes``."""


class SuspendCause(StrEnum):
    """Why a turn was parked."""

    POISON = "poison"
    """Its hosts kept dying with it (the poison-turn policy)."""
    AGENT_CHANGED = "agent_changed"
    """It resumed under a different agent and the deployment says to ask first."""
    FAILING = "failing"
    """Its runs kept failing with an unexpected error on a live host."""
    AGENT_UNAVAILABLE = "agent_unavailable"
    """Its agent could not be loaded on the hosts that tried."""


class Outcome(StrEnum):
    """How a turn ended, as its final record says: a kind and, for an aborted or suspended
    turn, its cause (:attr:`kind`, :attr:`cause`). The value is what the record stores and
    what reports count (``aborted:<cause>``, ``suspended:<cause>``); the tables below are
    checked complete when this module loads."""

    ANSWERED = "answered"
    """The model gave its final answer."""
    FORCE_STOPPED = "force_stopped"
    """The loop detector stopped the turn; the model wrapped up without tools."""
    BUDGET_EXHAUSTED = "budget_exhausted"
    """The turn reached its agent's token budget; the model wrapped up without tools."""
    TRUNCATED = "truncated"
    """The final answer was cut by the agent's own ``max_tokens`` cap; it is kept as it came
    (a text reply is usable, cut or not; raise the cap to get it whole)."""
    ABORTED_HARD_IDLE_TIMEOUT = "aborted:hard_idle_timeout"
    """The watchdog cancelled a model call that went silent past the hard timeout."""
    ABORTED_CONTEXT_LENGTH = "aborted:context_length"
    """The transcript still did not fit after a reactive compaction (or could not shrink)."""
    ABORTED_RATE_LIMITED = "aborted:rate_limited"
    """The endpoint's rate limit outlasted the per-call cap on waiting for it."""
    ABORTED_RETRYABLE = "aborted:retryable"
    """A transient model error outlasted its retries."""
    ABORTED_FATAL = "aborted:fatal"
    """The model failed in a way retrying cannot fix."""
    ABORTED_EMPTY_REPLY = "aborted:empty_reply"
    """The model kept answering nothing after its nudges."""
    ABORTED_OVERSIZED_REPLY = "aborted:oversized_reply"
    """The model's replies stayed over the size limit for one reply after its nudges."""
    ABORTED_LOOP = "aborted:loop"
    """The model kept repeating its tool calls after its nudges."""
    ABORTED_TRUNCATED = "aborted:truncated"
    """A reply with tool calls was cut by the ``max_tokens`` cap again after one retry with
    twice the room: its calls' arguments cannot be trusted, so none was run."""
    ABORTED_UNSTORABLE = "aborted:unstorable"
    """The record could not be encoded (a value no encoder takes); it ends on its last
    record."""
    ABORTED_RECORD_TOO_LARGE = "aborted:record_too_large"
    """The transcript outgrew ``[checkpoint] max_record_bytes``; it ends on its last record."""
    CANCELLED = "cancelled"
    """An operator cancelled the turn (``phaseline cancel``); it ended at its next boundary,
    its in-flight model call cancelled and its tools in flight finished and journaled."""
    SUSPENDED_POISON = "suspended:poison"
    """Parked by the poison-turn policy: not in progress, but ``phaseline resume TURN`` runs
    it again."""
    SUSPENDED_AGENT_CHANGED = "suspended:agent_changed"
    """Parked because it resumed under a different agent (its fingerprint changed) and the
    deployment says to ask first (``[loop] on_agent_change = "suspend"``)."""
    SUSPENDED_FAILING = "suspended:failing"
    """Parked because its runs kept ending in an unexpected error (a bug in the agent's code
    or phaseline's; ``last_error`` has it) on a host that stayed alive, backing off between
    tries: ``phaseline resume TURN`` runs it again after a fix."""
    SUSPENDED_AGENT_UNAVAILABLE = "suspended:agent_unavailable"
    """Parked because its agent could not be loaded on the hosts that tried (a module or an
    environment variable missing there; ``last_error`` says which, where): ``phaseline resume
    TURN`` runs it again after a fix."""

    @property
    def kind(self) -> OutcomeKind:
        """answered, aborted, suspended, ... (without the cause)."""
        return _KIND[self]

    @property
    def cause(self) -> Problem | RecordProblem | SuspendCause | None:
        """Why an aborted or suspended turn ended so (None for the other kinds)."""
        return _CAUSE.get(self)

    @property
    def aborted(self) -> bool:
        """Ended by the recovery policy (or its record) rather than by an answer."""
        return self.kind is OutcomeKind.ABORTED

    @property
    def suspended(self) -> bool:
        """Parked, not ended: ``phaseline resume TURN`` runs it again."""
        return self.kind is OutcomeKind.SUSPENDED

    @classmethod
    def aborted_by(cls, cause: Problem | RecordProblem) -> Outcome:
        """The outcome of a turn ended for ``cause``."""
        return _ABORTED_BY[cause]


#: The outcomes of a turn that ended with the model's own text: answered, wrapped up after a
#: stop or a budget, or an answer cut by the caller's cap.
ANSWER_OUTCOMES = frozenset(
    {Outcome.ANSWERED, Outcome.FORCE_STOPPED, Outcome.TRUNCATED, Outcome.BUDGET_EXHAUSTED}
)


class SaveReason(StrEnum):
    """Why a record was written (the record's ``reason`` field)."""

    SUBMITTED = "submitted"
    """The first record of a turn, written at submission."""
    RESUME = "resume"
    """A new owner's claim (epoch bumped); the turn restarts from the checkpoint before it."""
    TOOL_BATCH = "tool_batch"
    """A tool batch completed."""
    COMPACTION = "compaction"
    """A reactive compaction succeeded."""
    FORCE_STOP = "force_stop"
    """About to enter ``force_stop``; a resume goes straight to the wrap-up call."""
    FINAL = "final"
    """The turn reached ``done``."""
    SUSPENDED = "suspended"
    """The poison-turn policy parked the turn, or its agent could not be loaded."""
    AGENT_UNAVAILABLE = "agent_unavailable"
    """A host could not load the turn's agent; the record counts it and keeps the error."""
    UNSUSPENDED = "unsuspended"
    """An operator reopened a suspended turn (``phaseline resume TURN``)."""


def _split(outcome: Outcome) -> tuple[OutcomeKind, Problem | RecordProblem | SuspendCause | None]:
    kind, _, cause = outcome.value.partition(":")
    if not cause:
        return OutcomeKind(kind), None
    if kind == OutcomeKind.SUSPENDED:
        return OutcomeKind.SUSPENDED, SuspendCause(cause)
    if cause in RecordProblem.__members__.values():
        return OutcomeKind(kind), RecordProblem(cause)
    return OutcomeKind(kind), Problem(cause)


# Read once from the values, here: an outcome whose value names no kind or cause, or a cause
# without its outcome, fails the import, not a turn that happens to end so.
_KIND = {o: _split(o)[0] for o in Outcome}
_CAUSE = {o: c for o in Outcome if (c := _split(o)[1]) is not None}
_ABORTED_BY: dict[Problem | RecordProblem, Outcome] = {
    c: o for o, c in _CAUSE.items() if not isinstance(c, SuspendCause)
}
_missing = (set(Problem) | set(RecordProblem)) - set(_ABORTED_BY)
_unused = set(SuspendCause) - set(_CAUSE.values())
if _missing or _unused:
    raise RuntimeError(f"outcomes missing for {sorted(_missing | _unused)}")
