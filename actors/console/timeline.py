"""A turn's story as the console shows it: one row per event of its live stream.

The rows are made from the same events ``phaseline watch`` prints (``bus.events``), read from
the turn's live stream (``KeyLayout.live``): transitions, checkpoints, model calls, tool calls
and results, waits and retries with their causes, resumes with their epochs, the end. Streamed
text is not a row (the transcript shows what was kept).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from bus.events import (
    BadBusEntry,
    Checkpointed,
    Finished,
    ModelReplied,
    Recovering,
    Restarted,
    StatusEvent,
    TextDelta,
    ToolCalled,
    ToolReturned,
    ToolWaiting,
    WatchEvent,
    decode_event,
)
from bus.outcomes import ANSWER_OUTCOMES, Action
from bus.phase import Transition, TurnPhase
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.stream_reads import read_range

__all__ = ["Row", "Timeline", "Tone", "read_timeline", "row_of"]

#: Characters of an argument list, an output or a detail a row shows.
DETAIL = 240


class Tone(StrEnum):
    """How a row is coloured."""

    PLAIN = "plain"
    """Progress: transitions, calls that went well."""
    GOOD = "good"
    """Durable progress: a checkpoint, an answer."""
    WARN = "warn"
    """A wait, a retry, a nudge, a soft idle report."""
    BAD = "bad"
    """A failed call, an abort, a resume after a lost host."""


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the timeline."""

    at_ms: int
    """When it happened (unix ms)."""
    epoch: int
    """The incarnation it happened in."""
    kind: str
    """What it is: ``phase``, ``checkpoint``, ``model``, ``tool``, ``result``, ``recovery``,
    ``status``, ``resume``, ``end``."""
    text: str
    """What a person reads."""
    tone: Tone
    """How it is coloured."""

    def wire(self) -> dict[str, Any]:
        """As JSON for the live page."""
        return asdict(self)


def _cut(value: str) -> str:
    return value if len(value) <= DETAIL else value[: DETAIL - 1] + "…"


def _model_row(e: ModelReplied) -> Row:
    took = f"{(e.at_ms - e.started_ms) / 1000:.2f} s"
    if e.error:
        return Row(e.at_ms, e.epoch, "model", f"{e.model}: {e.error} after {took}", Tone.BAD)
    tokens = f"{e.prompt_tokens}+{e.completion_tokens} tokens" if e.prompt_tokens else "no usage"
    line = f"{e.model}: {e.finish_reason or 'reply'} in {took}, {tokens}"
    return Row(e.at_ms, e.epoch, "model", line, Tone.PLAIN)


def _end_row(e: Finished) -> Row:
    good = e.outcome in ANSWER_OUTCOMES
    line = f"finished: {e.outcome or 'final'}" + (f" ({_cut(e.error)})" if e.error else "")
    return Row(e.at_ms, e.epoch, "end", line, Tone.GOOD if good else Tone.BAD)


def row_of(event: WatchEvent) -> Row | None:
    """The row of one event (None for streamed text)."""
    if isinstance(event, Transition):
        line = f"{event.src.value} → {event.dst.value}"
        return Row(event.at_ms, event.epoch, "phase", line, Tone.PLAIN)
    if isinstance(event, Checkpointed):
        line = f"checkpoint {event.seq} ({event.reason}), {event.messages} messages"
        return Row(event.at_ms, event.epoch, "checkpoint", line, Tone.GOOD)
    if isinstance(event, ModelReplied):
        return _model_row(event)
    if isinstance(event, ToolCalled):
        rule = "idempotent" if event.idempotent else "runs at most once"
        line = f"{event.name}({_cut(event.arguments)}) [{rule}]"
        return Row(event.at_ms, event.epoch, "tool", line, Tone.PLAIN)
    if isinstance(event, ToolWaiting):
        return Row(
            event.at_ms, event.epoch, "tool", event.line(), Tone.PLAIN if event.over else Tone.WARN
        )
    if isinstance(event, ToolReturned):
        tone = {"ok": Tone.PLAIN, "skipped": Tone.WARN, "denied": Tone.WARN}.get(
            event.status, Tone.BAD
        )
        line = f"{event.name} → {event.status}: {_cut(event.output)}"
        return Row(event.at_ms, event.epoch, "result", line, tone)
    if isinstance(event, Recovering):
        tone = Tone.BAD if event.action is Action.ABORT else Tone.WARN
        line = f"{event.action} after {event.problem}: {_cut(event.detail)}"
        return Row(event.at_ms, event.epoch, "recovery", line, tone)
    if isinstance(event, StatusEvent):
        return Row(event.at_ms, event.epoch, "status", event.label, Tone.WARN)
    if isinstance(event, Restarted):
        line = (
            f"resumed at epoch {event.epoch} from its {event.resumed_from or 'last'} "
            f"checkpoint of {event.messages} messages"
        )
        return Row(event.at_ms, event.epoch, "resume", line, Tone.BAD)
    if isinstance(event, Finished):
        return _end_row(event)
    assert isinstance(event, TextDelta)
    return None


@dataclass(frozen=True, slots=True)
class Timeline:
    """What a turn's live stream holds, as the page shows it."""

    rows: list[Row]
    """Its rows, oldest first."""
    last_id: str
    """The id of its last entry: where a live page goes on from (``0-0``: none)."""
    phase: TurnPhase | None
    """The phase its last transition entered (a record holds the phase of its checkpoint:
    a turn waiting for an approval has none since); None: no transition kept."""


async def read_timeline(
    client: StoreClient, keys: KeyLayout, turn_id: str, *, limit: int = 2000
) -> Timeline:
    """The timeline of what the turn's live stream still holds (its newest ``limit``
    entries)."""
    entries = await read_range(client, keys.live(turn_id), newest=limit)
    rows: list[Row] = []
    phase = None
    for _entry_id, fields in entries:
        try:
            event = decode_event(fields)
        except BadBusEntry:
            continue  # advisory: a malformed entry is left out, the page shows the rest
        if isinstance(event, Transition):
            phase = event.dst
        row = row_of(event)
        if row is not None:
            rows.append(row)
    return Timeline(rows, entries[-1][0] if entries else "0-0", phase)
