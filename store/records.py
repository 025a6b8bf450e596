"""Record schemas: what a turn's durable state looks like, validated on every read.

All models are frozen (:class:`~bus.messages.FrozenModel`): a snapshot handed to the store
cannot change under it. Unknown fields are rejected so a record written by a newer build fails
loudly instead of losing data. The words they are made of (messages, outcomes, save reasons)
are the bus's, shared with every layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from bus.events import Finished
from bus.messages import FrozenModel, Message, Source, TextModel, ToolResult, Usage
from bus.outcomes import Outcome, SaveReason
from bus.phase import TurnPhase

log = logging.getLogger(__name__)

#: Version of the checkpoint record layout. Bump on any incompatible change; readers
#: quarantine records whose schema they do not know. 3: the record names its agent; 2: the
#: transcript is content-addressed (store.write.transcript); 1 (the whole transcript inline). All
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

LedgerState = Literal["prepared", "dispatched", "committed", "failed", "outcome_unknown"]


class MessageMeta(FrozenModel):
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
    call_key: str | None = None
    """On a tool result: the call's ledger key (its idempotency key downstream), so a side
    effect counted from outside can be matched with the result the model read."""


class TurnError(TextModel):
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


class Counters(FrozenModel):
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
    tokens: Usage = Usage()  # frozen, so shared: a factory ran at every exclude_defaults dump
    """Tokens of the turn's model calls, summed from each reply's usage as the reply arrives,
    also of replies the loop threw away (an empty one, one whose tool call was cut) since they
    were paid for. A call whose reply was lost with its host is not counted (see
    ``unmetered_calls``)."""
    unmetered_calls: int = 0
    """Model calls whose tokens are not in ``tokens``: the endpoint reported no usage. Calls
    lost with a host are not counted here: each of ``resume_attempts`` stands for the calls its
    lost incarnation made after its last checkpoint (usually one), whose usage is unknown."""
    session_prior: Usage = Usage()
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
    model_calls: int = 0
    """Model calls the turn's durable history made (every attempt, a failed one too), across
    incarnations: carried by every checkpoint and journaled reply. A call whose incarnation
    died before anything durable followed it is not in here; a model endpoint that counts
    what it answered tells those apart (the chaos report's ``calls_repaid``)."""
    replies_adopted: int = 0
    """Journaled replies a resume continued from instead of asking the model again."""
    replies_lost: int = 0
    """Journaled replies refused on resume (undecodable, or from an epoch not the record's):
    their calls were reported to the model as lost, and it was asked again."""
    generations_adopted: int = 0
    """Model calls in flight at a crash whose generation (on a model worker) a resume
    adopted: neither asked for nor paid again."""
    generations_repaid: int = 0
    """Generations lost with the model worker that ran them, asked for again (paid twice;
    the lost one's tokens are not in ``tokens``)."""

    def calls_line(self) -> str:
        """The turn's model calls for a person, with the replies a resume did not pay again."""
        line = f"{self.model_calls:,}"
        if self.replies_adopted:
            line += (
                f"; {self.replies_adopted} journaled replies continued from after a crash "
                "(not asked again)"
            )
        if self.replies_lost:
            line += f"; {self.replies_lost} journaled replies refused on resume (model told)"
        if self.generations_adopted:
            line += f"; {self.generations_adopted} generations adopted after a crash (not repaid)"
        if self.generations_repaid:
            line += f"; {self.generations_repaid} generations lost with their worker and repaid"
        return line

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


class CheckpointRecord(FrozenModel):
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
            outcome=outcome,
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
SCRIPTED_AGENT = "actors.engine.models.scripted:agent"


class TurnInput(TextModel):
    """What the user gave the turn."""

    message: str
    """The user message that opens the turn."""
    context: dict[str, Any] = Field(default_factory=dict)
    """Extra JSON-like context for the agent (the scripted agent reads its scenario here)."""


class TurnSpec(FrozenModel):
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


class LedgerEntry(FrozenModel):
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


class ReplyJournal(FrozenModel):
    """A model reply that asked for tools, made durable before the first of its calls is
    dispatched (written by the ledger's claim of its batch, fenced on the owner's epoch).

    It extends the last checkpoint the writer knew stored by everything the turn took in since
    (the reply, and before it any batch, inbox message or nudge a debounced save left out): a
    resume whose record still is that checkpoint continues from here, without asking the model
    again, and runs the same calls under the same keys (``actors.engine.resume``)."""

    epoch: int = Field(ge=1)
    """The owner incarnation that journaled it (never newer than the record's epoch)."""
    batch: int = Field(ge=0)
    """The tool batch the reply's calls are (``Counters.tool_batches`` when it arrived)."""
    base_len: int = Field(ge=0)
    """Messages of the checkpoint it extends."""
    base_last_id: str = ""
    """Id of that checkpoint's last message ("" if it had none): with ``base_len``, what tells
    this checkpoint from a later one (a claim changes neither)."""
    messages: tuple[Message, ...] = Field(min_length=1)
    """What the turn took in since that checkpoint, the reply last."""
    meta: tuple[MessageMeta, ...]
    """Meta of ``messages``, index-aligned."""
    counters: Counters
    """The turn's counters when the reply arrived (its tokens metered, its call counted)."""

    @model_validator(mode="after")
    def _check_shape(self) -> ReplyJournal:
        if len(self.meta) != len(self.messages):
            raise ValueError(f"{len(self.meta)} meta for {len(self.messages)} messages")
        if not self.messages[-1].tool_calls:
            raise ValueError("the journaled reply asks for no tool call")
        return self

    @property
    def reply(self) -> Message:
        """The model's reply whose calls the batch runs."""
        return self.messages[-1]

    def extends(self, record: CheckpointRecord) -> bool:
        """Whether this journal continues ``record``'s transcript (a later checkpoint already
        holds the reply, and then this journal is spent)."""
        last = record.meta[-1].message_id if record.meta else ""
        return len(record.messages) == self.base_len and last == self.base_last_id


#: Counters a claim (a new owner's fencing write) changes: a journaled reply's own copies of
#: them are older than the claimed record's, so an adopting owner keeps the record's.
CLAIM_COUNTERS = (
    "resume_attempts",
    "stalled_resumes",
    "isolated_deaths",
    "outcome",
    "agent_failures",
    "agent_fingerprint",
    "agent_changes",
)


@dataclass(frozen=True, slots=True)
class Settle:
    """The outcome of a call this process dispatched, journaled with the save that follows
    its batch (``checkpoint_save.lua``) instead of in a round trip of its own. Unfenced, like
    every outcome of a dispatched call (it is true whoever owns the turn now): a
    compare-and-set from the dispatch this process wrote, so it never overwrites what a
    successor settled."""

    call_key: str
    """The call's ledger key."""
    dispatched: bytes
    """The ``dispatched`` entry this process wrote (the compare-and-set's expected bytes)."""
    settled: bytes
    """The packed entry with the call's outcome."""


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
    inbox_len: int | None = None
    """Entries in the turn's inbox when the save landed (None: not told). A loop whose inbox
    offset is there has nothing new to read at its next boundary."""


class QueuedTurn(FrozenModel):
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


class Approval(TextModel):
    """A tool call's approval: asked, then decided (``store.domain.approvals``). Kept after the
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


class InboxItem(TextModel):
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
