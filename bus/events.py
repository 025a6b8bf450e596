"""What travels on the bus, and its wire form (flat string fields of a Redis Streams entry).

Every entry read from the bus is validated here; a malformed one raises :class:`BadBusEntry`
and is moved to the dead-letter stream by the reader instead of stopping anybody.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, get_args

from bus.errors import PhaselineError
from bus.messages import ToolStatus, storable
from bus.outcomes import Action, EngineProblem, Outcome, Problem, SaveReason
from bus.phase import Transition, TurnPhase


class BadBusEntry(PhaselineError):
    """A bus entry that is not a valid phaseline event."""


class Status(StrEnum):
    """Kinds of :class:`StatusEvent`."""

    IDLE_SOFT = "idle_soft"
    """The turn has been idle past the watchdog's soft timeout; nothing was done to it."""
    HARD_IDLE_TIMEOUT = "hard_idle_timeout"
    """The watchdog cancelled the turn's model call; the recovery policy aborts the turn."""


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """A report about a turn that changes nothing (e.g. the watchdog's ``idle_soft``)."""

    turn_id: str
    """The turn concerned."""
    epoch: int
    """Owner epoch the report is about."""
    status: Status
    """Kind of report."""
    label: str
    """A line a person can read."""
    at_ms: int
    """Unix milliseconds of the report."""


BusEvent = Transition | StatusEvent
"""What the shard buses carry: the events watchdogs and other consumer groups act on."""


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text of a model reply, as it streams (a reply that was not streamed comes whole).

    Advisory: what streamed before a crash is lost, and the resumed turn's new model call
    streams its own text after a :class:`Restarted` marker."""

    turn_id: str
    """The turn speaking."""
    epoch: int
    """Owner epoch that streamed it."""
    text: str
    """The next piece of the reply."""
    at_ms: int
    """Unix milliseconds."""


@dataclass(frozen=True, slots=True)
class ToolCalled:
    """A tool call of the batch the turn is about to run."""

    turn_id: str
    """The turn calling."""
    epoch: int
    """Owner epoch that runs the batch."""
    call_id: str
    """The model's id for the call."""
    name: str
    """Tool name."""
    arguments: str
    """The arguments as canonical JSON, cut to :data:`LIVE_TEXT_LIMIT` characters."""
    at_ms: int
    """Unix milliseconds."""
    call_key: str = ""
    """Its stable key in the tool ledger (what the tool gets as its idempotency key); empty
    for a call that was never journaled (skipped)."""
    idempotent: bool = False
    """Whether the tool may run twice: caught in flight by a crash, an idempotent call is run
    again, any other is reported ``outcome_unknown``."""


class ToolWait(StrEnum):
    """Why a tool call of a running batch cannot start yet."""

    TOOL_LIMIT = "tool_limit"
    """Its tool's ``max_concurrency`` calls run already (on Ray: per worker of its pool)."""
    THREADS = "threads"
    """Every thread this process gives sync tools is busy (``[tools] threads``)."""

    @property
    def label(self) -> str:
        """What a person reads of it."""
        if self is ToolWait.TOOL_LIMIT:
            return "its tool runs as many calls at once as it may (max_concurrency)"
        return "every thread for sync tools is busy ([tools] threads)"


@dataclass(frozen=True, slots=True)
class ToolWaiting:
    """A tool call that waits before it runs, or (``over``) that runs now after waiting:
    until then a watcher shows it waiting, not running."""

    turn_id: str
    """The turn calling."""
    epoch: int
    """Owner epoch that runs the batch."""
    call_id: str
    """The model's id for the call."""
    name: str
    """Tool name."""
    waits_for: ToolWait
    """What it waits for."""
    at_ms: int
    """Unix milliseconds."""
    over: bool = False
    """False: it starts waiting; True: its wait is over and it runs now."""

    def line(self) -> str:
        """One line a person reads of it."""
        if self.over:
            return f"{self.name} runs now (it waited: {self.waits_for.label})"
        return f"{self.name} waits: {self.waits_for.label}"


@dataclass(frozen=True, slots=True)
class ToolReturned:
    """The result of one tool call, as the model will read it."""

    turn_id: str
    """The turn."""
    epoch: int
    """Owner epoch that ran the batch."""
    call_id: str
    """The model's id for the call."""
    name: str
    """Tool name."""
    status: ToolStatus
    """How it came out, as the model reads it (``ok``, ``error``, ``outcome_unknown`` ...)."""
    output: str
    """What the model reads, cut to :data:`LIVE_TEXT_LIMIT` characters."""
    at_ms: int
    """Unix milliseconds."""


@dataclass(frozen=True, slots=True)
class ModelReplied:
    """A model call ended: with a reply, or with an error the recovery policy then acts on.
    What a trace's model-call span and the console's timeline are made of."""

    turn_id: str
    """The turn calling."""
    epoch: int
    """Owner epoch that made the call."""
    system: str
    """Who serves the model (``openai`` for an OpenAI-compatible endpoint, ``phaseline`` for
    the scripted model)."""
    model: str
    """The model asked for."""
    started_ms: int
    """When the call started (unix ms; admission waits included)."""
    at_ms: int
    """When it ended (unix ms)."""
    finish_reason: str = ""
    """Why the reply stopped (``stop``, ``tool_calls``, ``length``); empty on an error."""
    prompt_tokens: int = 0
    """Prompt tokens the endpoint reported (0: none reported)."""
    completion_tokens: int = 0
    """Reply tokens the endpoint reported."""
    cached_tokens: int = 0
    """Prompt tokens served from the endpoint's cache."""
    error: str = ""
    """The problem the call ended with (a :class:`~bus.outcomes.Problem` value), if any."""


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """A checkpoint of the turn is durable in Redis."""

    turn_id: str
    """The turn."""
    epoch: int
    """Owner epoch that wrote it."""
    seq: int
    """Its checkpoint number."""
    reason: SaveReason
    """Why it was written (after a tool batch, a compaction, before a force stop, final)."""
    messages: int
    """Messages of the transcript it holds."""
    at_ms: int
    """Unix milliseconds."""


@dataclass(frozen=True, slots=True)
class Restarted:
    """A new owner took the turn over from its last checkpoint (after a crash, a freeze or a
    handover): whatever streamed after that checkpoint is gone, and what follows is the
    resumed turn's own."""

    turn_id: str
    """The turn."""
    epoch: int
    """The new owner's epoch."""
    resumed_from: SaveReason | None
    """Why the checkpoint it resumed from was written (``submitted``: the turn had none yet
    and starts over; None: not known)."""
    messages: int
    """Messages of that checkpoint: where the transcript picks up."""
    at_ms: int
    """Unix milliseconds."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The turn's final record is stored: the last event of a turn."""

    turn_id: str
    """The turn."""
    epoch: int
    """Owner epoch that finished it."""
    outcome: Outcome | None
    """The record's outcome (None only for a record of a build that stored none)."""
    answer: str
    """Text of the last assistant message (empty if there is none)."""
    at_ms: int
    """Unix milliseconds."""
    error: str = ""
    """The error an aborted turn ended with, one line (empty for any other outcome)."""


@dataclass(frozen=True, slots=True)
class Recovering:
    """The recovery policy acted on a problem of the turn: a retry and its cause, a wait, a
    compaction, a nudge, a force stop, an abort. What a watcher needs to see why a turn pauses
    or ends."""

    turn_id: str
    """The turn."""
    epoch: int
    """Owner epoch that acted."""
    problem: Problem | EngineProblem
    """What went wrong: a model call's or reply's problem, or one the engine met."""
    action: Action
    """What is done about it (``retry``, ``wait``, ``compact``, ``nudge``, ``force_stop``,
    ``abort``, ``continue``)."""
    detail: str
    """A line a person can read: the endpoint's error, the skipped call, the nudge's text."""
    at_ms: int
    """Unix milliseconds."""


LiveEvent = (
    TextDelta
    | ToolCalled
    | ToolWaiting
    | ToolReturned
    | ModelReplied
    | Checkpointed
    | Restarted
    | Finished
    | Recovering
)
"""Events only a watcher reads (never the shard buses): see ``store.views.streams`` for their
per-turn stream."""

WatchEvent = BusEvent | LiveEvent
"""Everything ``Runtime.watch`` yields."""

#: Characters of tool arguments and results a live event carries (the record has them whole).
LIVE_TEXT_LIMIT = 2000


def encode_event(event: WatchEvent) -> dict[str, str | int]:
    if isinstance(event, Transition):
        return {
            "kind": "transition",
            "turn_id": event.turn_id,
            "epoch": event.epoch,
            "seq": event.seq,
            "src": event.src.value,
            "dst": event.dst.value,
            "at_ms": event.at_ms,
        }
    if isinstance(event, StatusEvent):
        return {
            "kind": "status",
            "turn_id": event.turn_id,
            "epoch": event.epoch,
            "status": event.status.value,
            "label": event.label,
            "at_ms": event.at_ms,
        }
    fields: dict[str, str | int] = {"kind": _KIND_OF[type(event)]}
    for name in event.__slots__:
        value = getattr(event, name)
        if isinstance(value, str):  # a model's or a tool's text, as it streams: made storable
            fields[name] = storable(value)
        else:
            fields[name] = "" if value is None else int(value) if isinstance(value, bool) else value
    return fields


_KINDS: dict[str, type[LiveEvent]] = {
    "text": TextDelta,
    "tool_call": ToolCalled,
    "tool_wait": ToolWaiting,
    "tool_result": ToolReturned,
    "model": ModelReplied,
    "checkpoint": Checkpointed,
    "restarted": Restarted,
    "finished": Finished,
    "recovering": Recovering,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}
#: Fields an entry written by an older build may lack (their defaults then).
_OPTIONAL_FIELDS = frozenset({"error", "call_key", "idempotent"})
_TOOL_STATUSES = frozenset(get_args(ToolStatus))


def _tool_status(value: str) -> str:
    if value not in _TOOL_STATUSES:
        raise ValueError(f"{value!r} is not a tool status")
    return value


def _problem(value: str) -> Problem | EngineProblem:
    return Problem(value) if value in Problem.__members__.values() else EngineProblem(value)


def _flag(value: str) -> bool:
    return {"1": True, "0": False}[value]


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda value: None if value == "" else parse(value)


#: How each typed field of a live event is read back from its string (the rest are str).
_FIELD_TYPES: dict[str, Callable[[str], Any]] = {
    "epoch": int,
    "at_ms": int,
    "messages": int,
    "seq": int,
    "started_ms": int,
    "prompt_tokens": int,
    "completion_tokens": int,
    "cached_tokens": int,
    "idempotent": _flag,
    "over": _flag,
    "waits_for": ToolWait,
    "reason": SaveReason,
    "status": _tool_status,
    "resumed_from": _or_none(SaveReason),
    "outcome": _or_none(Outcome),
    "problem": _problem,
    "action": Action,
}


def _s(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_event(fields: Mapping[bytes, bytes] | Mapping[str, str | int]) -> WatchEvent:
    """Validate one entry's fields (as read, or as encoded); :class:`BadBusEntry` says why."""
    try:
        f = {_s(k): _s(v) for k, v in fields.items()}
        kind = f["kind"]
        if kind == "transition":
            return Transition(
                turn_id=f["turn_id"],
                epoch=int(f["epoch"]),
                seq=int(f["seq"]),
                src=TurnPhase(f["src"]),
                dst=TurnPhase(f["dst"]),
                at_ms=int(f["at_ms"]),
            )
        if kind == "status":
            return StatusEvent(
                turn_id=f["turn_id"],
                epoch=int(f["epoch"]),
                status=Status(f["status"]),
                label=f["label"],
                at_ms=int(f["at_ms"]),
            )
        cls = _KINDS.get(kind)
        if cls is None:
            raise BadBusEntry(f"unknown event kind {kind!r}")
        values = {
            n: _FIELD_TYPES.get(n, str)(f[n])
            for n in cls.__slots__
            if n in f or n not in _OPTIONAL_FIELDS  # written by a build that lacked them
        }
        return cls(**values)
    except (KeyError, ValueError, TypeError, UnicodeDecodeError, AttributeError) as exc:
        raise BadBusEntry(f"malformed bus entry {dict(fields)!r}: {exc!r}") from exc


def decode_bus_event(fields: Mapping[bytes, bytes] | Mapping[str, str | int]) -> BusEvent:
    """:func:`decode_event` for a shard bus, which carries transitions and status events only."""
    event = decode_event(fields)
    if not isinstance(event, Transition | StatusEvent):
        raise BadBusEntry(f"a {type(event).__name__} does not belong on a shard bus")
    return event
