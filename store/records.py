"""Record schemas: what a turn's durable state looks like, validated on every read.

All models are frozen: a snapshot handed to the store cannot change under it. Unknown fields
are rejected so a record written by a newer build fails loudly instead of losing data.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bus.events import Finished
from bus.phase import TurnPhase

log = logging.getLogger(__name__)

#: Version of the checkpoint record layout. Bump on any incompatible change; readers
#: quarantine records whose schema they do not know. 3: the record names its agent; 2: the
#: transcript is content-addressed (store.transcript); 1 (the whole transcript inline). All
#: three are read.
SCHEMA_VERSION = 3

#: Failed loads of a turn's agent, in a row, after which the turn is suspended.
AGENT_FAILURES_TO_SUSPEND = 3
#: Runs of a turn in a row that end in an unexpected error on a live host (no checkpoint
#: between them), after which the turn is suspended (``suspended:failing``).
RUN_FAILURES_TO_SUSPEND = 3

#: Largest epoch and seq a record may carry: the save script compares them as Lua numbers
#: (doubles), exact only up to 2^53. A record past it is quarantined on read.
MAX_FENCE = 2**53 - 1

Role = Literal["system", "user", "assistant", "tool"]
ToolStatus = Literal["ok", "error", "denied", "timeout", "outcome_unknown", "skipped"]
Source = Literal["prompt", "llm", "tool", "inbox", "system"]
LedgerState = Literal["prepared", "dispatched", "committed", "failed", "outcome_unknown"]


class Outcome(StrEnum):
    """How a turn ended, as its final record says. The value is what the record stores and
    what reports count; ``aborted:<problem>`` names the recovery problem that ended it."""

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
    def aborted(self) -> bool:
        """Ended by the recovery policy rather than by an answer."""
        return self.value.startswith("aborted:")

    @property
    def suspended(self) -> bool:
        """Parked, not ended: ``phaseline resume TURN`` runs it again."""
        return self.value.startswith("suspended:")


#: The outcomes of a turn that ended with the model's own text: answered, wrapped up after a
#: stop or a budget, or an answer cut by the caller's cap. Members compare equal to their string
#: values, so an event's ``outcome`` string is found here too.
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


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: A lone UTF-16 surrogate: a Python string may hold one (``os.fsdecode`` of a non-UTF-8 file
#: name, a JSON ``\ud800`` escape, a non-UTF-8 byte in argv), UTF-8 (and so msgpack) cannot.
_SURROGATE = re.compile("[\ud800-\udfff]")
#: What stands for each one in stored text.
REPLACEMENT = "\ufffd"


def storable(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (nested in lists and dicts too)
    replaced by U+FFFD, so it can be encoded; anything else as it is."""
    if isinstance(value, str):
        if _SURROGATE.search(value) is None:
            return value
        log.warning("replaced %d unencodable character(s) (lone surrogates) with U+FFFD",
                    len(_SURROGATE.findall(value)))  # fmt: skip
        return _SURROGATE.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(storable(v) for v in value)
    return value


class _Text(_Frozen):
    """A value holding text from outside (a model, a tool, a user): made storable when it is
    built, at the boundary, so no text that UTF-8 cannot hold reaches a record or Redis."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        return storable(data) if isinstance(data, dict) else data


class ToolCall(_Text):
    """One tool invocation requested by the model."""

    id: str
    """Model-assigned call id; tool results refer to it."""
    name: str
    """Registered tool name."""
    args: dict[str, Any] = Field(default_factory=dict)
    """JSON-like arguments; canonicalised (sorted keys) when hashed into the call key."""

    def arguments_json(self) -> str:
        """The arguments as canonical JSON (what the call key hashes)."""
        return canonical_json(self.args)


def canonical_json(value: Any) -> str:
    """One spelling of a JSON value: sorted keys, no spaces, unicode kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ToolResult(_Text):
    """The outcome of one tool call, as the model will read it."""

    call_id: str
    """The :attr:`ToolCall.id` this answers."""
    name: str
    """Tool name, repeated for readability of stored transcripts."""
    status: ToolStatus
    """``ok``, or why there is no real output (``outcome_unknown``: in flight at a crash)."""
    output: str = ""
    """Text the model sees."""


class Message(_Text):
    """One transcript entry. Equality of transcripts is equality of these, message for message."""

    role: Role
    """Who speaks."""
    text: str = ""
    """Plain text content (may be empty for a pure tool-call message)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls requested by an assistant message."""
    tool_result: ToolResult | None = None
    """Set on ``tool`` messages only."""

    @model_validator(mode="after")
    def _check_shape(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        if (self.role == "tool") != (self.tool_result is not None):
            raise ValueError("tool messages, and only they, carry a tool result")
        return self


class Usage(_Frozen):
    """Tokens one model call used, as the endpoint reported them."""

    prompt_tokens: int = Field(default=0, ge=0)
    """Tokens of the request."""
    completion_tokens: int = Field(default=0, ge=0)
    """Tokens of the reply."""
    cached_tokens: int = Field(default=0, ge=0)
    """Of the request's tokens, those the endpoint served from its prompt cache (when it
    says)."""

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Usage) -> Usage:
        """Both calls' tokens together."""
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
        )


class MessageMeta(_Frozen):
    """Bookkeeping beside a message (index-aligned), never shown to the model."""

    source: Source
    """Where the message came from."""
    message_id: str
    """Stable id (inbox messages keep the id they were injected with)."""
    at_ms: int
    """Unix milliseconds when the message entered the transcript."""
    system_injected: bool = False
    """True for nudges and other messages the runtime wrote on the user's behalf."""
    usage: Usage | None = None
    """On model replies from an endpoint that reports it: the tokens the call used."""
    approval: Approval | None = None
    """On the result of a call that needed approval: the decision (who, when, why)."""


class TurnError(_Text):
    """The last model or tool error of a turn, as a person needs it to see why it failed.
    Never a key or a header: only what the endpoint or tool said, cut short."""

    source: Literal["model", "tool", "agent", "host"]
    """Who failed: the model endpoint, a tool call, loading the agent on a host, or the host
    running the turn (an unexpected error: a bug)."""
    kind: str
    """The recovery problem for a model error (``retryable``, ``fatal``, ``context_length``,
    ``truncated`` ...), the result status for a tool error (``error``, ``timeout`` ...)."""
    message: str = Field(max_length=500)
    """What the endpoint or tool said (at most 500 characters)."""
    status: int | None = None
    """HTTP status of the endpoint's answer, when there was one."""
    code: str | None = None
    """The provider's error code, when it gave one."""
    request_id: str | None = None
    """The endpoint's id of the request, when it gave one."""
    tool: str | None = None
    """The tool, for a tool error."""
    attempt: int = 0
    """Retries already spent on that model call when it failed."""
    at_ms: int = 0
    """Unix milliseconds of the error."""

    def line(self) -> str:
        """One line for a terminal or a summary."""
        who = f"tool {self.tool}" if self.tool else self.source
        parts = [f"{who} {self.kind}"]
        if self.status is not None:
            parts.append(f"HTTP {self.status}")
        if self.code:
            parts.append(self.code)
        text = f"{' '.join(parts)}: {self.message}"
        return text + (f" (request {self.request_id})" if self.request_id else "")


class Counters(_Frozen):
    """Small per-turn counters that recovery decisions depend on, so they survive a crash."""

    retry_attempts: int = 0
    """Retries spent on the current model call (reset when a call succeeds)."""
    nudges: int = 0
    """Nudges sent this turn (capped at 3 by the recovery policy)."""
    reactive_compacted: bool = False
    """A context-length error already triggered a compaction this turn."""
    resume_attempts: int = 0
    """How many times the turn was resumed after losing its host."""
    stalled_resumes: int = 0
    """Resumes in a row with no checkpoint saved between them (the last write was the claim).
    The resume budget counts these, not ``resume_attempts``: a turn that keeps losing its host
    at the same point is isolated (``actors.turn.poison``), one that progresses between losses is
    not."""
    isolated_deaths: tuple[str, ...] = ()
    """The step (``phase@position``) at which each death of the isolation host happened while
    this turn ran alone on it: the evidence the poison-turn policy suspends a turn on."""
    tool_batches: int = 0
    """Tool batches executed; numbers the next batch so its call keys are stable on replay."""
    inbox_offset: int = 0
    """How many inbox entries the transcript already contains (exactly-once injection)."""
    outcome: Outcome | None = None
    """None while running; how the turn ended once it did (or was suspended)."""
    cut_retries: int = 0
    """Retries of the current model call whose reply with tool calls was cut by the caller's
    ``max_tokens`` cap (reset when a call succeeds)."""
    tokens: Usage = Field(default_factory=lambda: Usage())
    """Tokens of the turn's model calls, summed from each reply's usage as the reply arrives,
    also of replies the loop threw away (an empty one, one whose tool call was cut) since they
    were paid for. A call whose reply was lost with its host is not counted (see
    ``unmetered_calls``)."""
    unmetered_calls: int = 0
    """Model calls whose tokens are not in ``tokens``: the endpoint reported no usage. Calls
    lost with a host are not counted here: each of ``resume_attempts`` stands for the calls its
    lost incarnation made after its last checkpoint (usually one), whose usage is unknown."""
    session_prior: Usage = Field(default_factory=lambda: Usage())
    """Tokens of the session's earlier turns, fixed when this turn opened (so the session's
    total is this plus ``tokens``, and its budget holds across turns and crashes)."""
    rate_limit_waits: int = 0
    """Rate-limit waits of the current model call (reset when a call succeeds)."""
    rate_limit_waited_ms: int = 0
    """Milliseconds the current model call has waited on the endpoint's rate limit (reset when
    a call succeeds); capped by ``LoopSettings.rate_limit_max_wait_s``."""
    cancel_reason: str | None = None
    """Why an operator cancelled the turn (its outcome is then ``cancelled``)."""
    agent_fingerprint: str = ""
    """The fingerprint of the agent the turn runs with (``actors.engine.agents``), set when it
    first starts: a resume under another one is an upgrade mid-turn."""
    agent_changes: tuple[str, ...] = ()
    """Each change of agent the turn went on through: ``<old> -> <new> at epoch <n>``."""
    agent_failures: int = 0
    """Hosts in a row that could not load the turn's agent; at
    :data:`AGENT_FAILURES_TO_SUSPEND` the turn is suspended (reset by a successful start)."""
    last_error: TurnError | None = None
    """The last model or tool error of the turn: kept so that ``inspect``, ``watch``, ``chat``
    and a run's summary can say why a turn failed, not just that it did."""

    def tokens_line(self) -> str:
        """The turn's tokens for a person: the turn's, the session's, what is not counted."""
        t = self.tokens
        line = (
            f"{t.total:,} (prompt {t.prompt_tokens:,}, {t.cached_tokens:,} of them cached; "
            f"completion {t.completion_tokens:,})"
        )
        if self.session_prior.total:
            line += f"; session {self.session_prior.total + t.total:,}"
        if self.unmetered_calls:
            line += f"; {self.unmetered_calls} calls reported no usage"
        if self.resume_attempts:
            line += (
                f"; not counted: the calls of {self.resume_attempts} incarnations lost with "
                "their hosts after their last checkpoint"
            )
        return line

    @field_validator("outcome", mode="before")
    @classmethod
    def _running_is_none(cls, value: object) -> object:
        return None if value == "" else value  # records written before the enum stored ""


class CheckpointRecord(_Frozen):
    """The checkpoint hash of DESIGN §3, one per turn; every field is written on every save."""

    schema_version: int = Field(default=SCHEMA_VERSION, alias="schema")
    """Layout the record was read from (a save always writes :data:`SCHEMA_VERSION`)."""
    turn_id: str
    """The turn."""
    session_id: str
    """Conversation the turn belongs to."""
    agent: str = ""
    """The agent's import path (``pkg.mod:agent``); empty in records of schema 1 and 2."""
    epoch: int = Field(ge=1, le=MAX_FENCE)
    """Owner incarnation; the fencing token. A resume bumps it (at most :data:`MAX_FENCE`)."""
    seq: int = Field(ge=0, le=MAX_FENCE)
    """Checkpoint number, strictly increasing across every save of the turn."""
    phase: TurnPhase
    """Phase at the time of the save."""
    in_progress: bool
    """True until the final save."""
    reason: SaveReason
    """Why this save happened."""
    messages: tuple[Message, ...]
    """The whole canonical transcript, baseline included (never a diff)."""
    meta: tuple[MessageMeta, ...]
    """Index-aligned with :attr:`messages`."""
    baseline: int = Field(ge=0)
    """Number of pre-turn messages at the head of :attr:`messages`."""
    counters: Counters
    """Recovery counters."""
    updated_at: int
    """Unix milliseconds of the save."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _check_alignment(self) -> CheckpointRecord:
        if len(self.meta) != len(self.messages):
            raise ValueError(f"meta has {len(self.meta)} entries for {len(self.messages)} messages")
        if self.baseline > len(self.messages):
            raise ValueError(f"baseline {self.baseline} exceeds {len(self.messages)} messages")
        return self

    @property
    def answer(self) -> str:
        """Text of the last assistant message (empty if there is none)."""
        return next((m.text for m in reversed(self.messages) if m.role == "assistant"), "")

    def finished_event(self) -> Finished:
        """The live event a final record stands for."""
        outcome = self.counters.outcome
        return Finished(
            turn_id=self.turn_id,
            epoch=self.epoch,
            outcome="" if outcome is None else outcome.value,
            answer=self.answer,
            at_ms=self.updated_at,
            error=self._why(),
        )

    def _why(self) -> str:
        """Why the turn ended without an answer: its error (aborted, or suspended because its
        agent would not load), or the reason it was cancelled; "" otherwise."""
        c = self.counters
        if c.outcome is Outcome.CANCELLED:
            return f"cancelled: {c.cancel_reason or 'no reason given'}"
        ended_badly = c.outcome is not None and (c.outcome.aborted or c.outcome.suspended)
        return c.last_error.line() if c.last_error is not None and ended_badly else ""


#: Import path of the scripted agent: what specs written before agents existed ran.
SCRIPTED_AGENT = "actors.engine.scripted:agent"


class TurnInput(_Text):
    """What the user gave the turn."""

    message: str
    """The user message that opens the turn."""
    context: dict[str, Any] = Field(default_factory=dict)
    """Extra JSON-like context for the agent (the scripted agent reads its scenario here)."""


class TurnSpec(_Frozen):
    """What a turn was asked to do; written once at submission so any host can resume it."""

    turn_id: str
    """The turn."""
    session_id: str
    """Conversation the turn belongs to."""
    agent: str
    """Import path of the agent (``"pkg.module:name"``) every host imports to run the turn."""
    input: TurnInput
    """The user's input."""
    created_at: int
    """Unix milliseconds of submission."""

    @model_validator(mode="before")
    @classmethod
    def _from_scenario_spec(cls, data: Any) -> Any:
        """Specs written before agents existed carried a scenario: the scripted agent's."""
        if isinstance(data, dict) and "scenario" in data and "agent" not in data:
            data = dict(data)
            scenario = data.pop("scenario")
            # The message only opens the first record, written at submission already.
            message = scenario.get("prompt", "") if isinstance(scenario, dict) else ""
            data["agent"] = SCRIPTED_AGENT
            data["input"] = {"message": message, "context": {"scenario": scenario}}
        return data


class LedgerEntry(_Frozen):
    """One tool call's journal entry: ``prepared -> dispatched -> committed | failed``."""

    state: LedgerState
    """Where the call got to. ``dispatched`` at resume means it was in flight at the crash."""
    name: str
    """Tool name."""
    result: ToolResult | None = None
    """Set once committed or failed; reused instead of re-running the tool."""
    updated_at: int = 0
    """Unix milliseconds of the last state change."""
    epoch: int = Field(default=0, ge=0)
    """Owner epoch that wrote this state (0: written before any owner decided, or unfenced)."""
    writer: str = ""
    """Random id of the write, unique per dispatch: two owners racing in the same millisecond
    never write identical bytes, so the compare-and-set tells a replay of one's own write
    (a retried request) from a rival's."""


@dataclass(frozen=True, slots=True)
class SaveAck:
    """Proof that a record is durable in Redis."""

    turn_id: str
    """The turn saved."""
    epoch: int
    """Epoch written."""
    seq: int
    """Checkpoint number written."""
    event_id: str
    """Id of the checkpoint event in the shard's events stream."""


class QueuedTurn(_Frozen):
    """A session's next turn, waiting for the one that runs to end (``submit --if-busy
    queue``): opened, in order, when the session is free."""

    agent: str
    """The agent's import path."""
    input: TurnInput
    """The turn's input."""
    at_ms: int
    """Unix milliseconds it was queued."""
    by: str = ""
    """Who queued it."""


class Approval(_Text):
    """A tool call's approval: asked, then decided (``store.approvals``). Kept after the
    decision, so who decided, when and why stays with the turn."""

    state: Literal["pending", "approve", "deny"]
    """Waiting, approved or denied."""
    tool: str = ""
    """The tool called."""
    args: str = ""
    """Its arguments as canonical JSON (cut at 2,000 characters)."""
    asked_at_ms: int = 0
    """Unix milliseconds of the request."""
    decided_at_ms: int = 0
    """Unix milliseconds of the decision (0 while pending)."""
    by: str = ""
    """Who decided (``user@host``, or ``timeout`` when the cap decided)."""
    reason: str = ""
    """Why, if they said."""

    def note(self) -> str:
        """The decision for a person and for the model."""
        verb = {"approve": "approved", "deny": "denied", "pending": "waiting"}[self.state]
        who = f" by {self.by}" if self.by else ""
        return f"{verb}{who}" + (f": {self.reason}" if self.reason else "")


class InboxItem(_Text):
    """One injected message, or a request to cancel the turn."""

    message_id: str
    """Caller-visible id; kept in the message meta."""
    text: str
    """The user's words (for a cancel: its reason)."""
    at_ms: int
    """Unix milliseconds of injection."""
    cancel: bool = False
    """A cancel request (``phaseline cancel``): the turn ends ``cancelled`` at the boundary
    that reads it, also in an incarnation that resumes after a crash."""
    by: str = ""
    """Who sent it (user@host), when the sender said."""
