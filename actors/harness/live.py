"""A turn's live events in a terminal (``phaseline watch``, ``phaseline chat``), drawn with rich.

Text streams inline as it arrives; tool calls, results, watchdog notes, restarts and what the
recovery policy does (a retry and its cause, a skipped call, a nudge, an abort and why) get a
line each. Phase transitions are shown when asked (``watch`` does, ``chat`` shows only the ones
a person would wonder about: retries, compaction, waiting for approval).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from bus.events import (
    Checkpointed,
    Finished,
    Recovering,
    Restarted,
    StatusEvent,
    TextDelta,
    ToolCalled,
    ToolReturned,
    ToolWaiting,
    WatchEvent,
)
from bus.outcomes import Action, Outcome
from bus.phase import Transition, TurnPhase

#: Characters of tool arguments and results printed on a line.
SHOWN = 160

#: Phases ``chat`` mentions: the ones that explain a pause.
NOTABLE = frozenset({TurnPhase.RETRYING_LLM, TurnPhase.COMPACTING, TurnPhase.AWAITING_APPROVAL})


def _cut(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= SHOWN else line[: SHOWN - 1] + "…"


class LiveView:
    """Prints one turn's events as they come."""

    def __init__(self, console: Console, *, phases: bool = False) -> None:
        self.console = console
        self.phases = phases
        self.finished: Finished | None = None
        """The last event, once seen."""
        self._mid_text = False
        self._spoke = False

    def show(self, event: WatchEvent) -> None:
        if isinstance(event, TextDelta):
            self.console.print(escape(event.text), end="", highlight=False, soft_wrap=True)
            self._mid_text = self._spoke = True
            return
        line = self._line(event)
        if line is None:
            return
        if self._mid_text:
            self.console.print()
            self._mid_text = False
        self.console.print(line, highlight=False)

    def _line(self, event: WatchEvent) -> str | None:
        if isinstance(event, Transition):
            if self.phases or event.dst in NOTABLE:
                return f"[dim]· {event.dst.value}"
            return None
        if isinstance(event, StatusEvent):
            return f"[yellow]… {escape(event.label)}"
        if isinstance(event, Checkpointed):
            return f"[dim]· checkpoint {event.seq} ({event.reason})" if self.phases else None
        if isinstance(event, ToolCalled):
            return f"[cyan]  ⚙ {escape(event.name)}({escape(_cut(event.arguments))})"
        if isinstance(event, ToolWaiting):
            return f"[{'dim' if event.over else 'yellow'}]  ⏳ {escape(event.line())}"
        if isinstance(event, ToolReturned):
            colour = {"ok": "green", "skipped": "yellow"}.get(event.status, "red")
            return f"[{colour}]  ↳ {event.status}: {escape(_cut(event.output))}"
        if isinstance(event, Recovering):
            colour = "red" if event.action is Action.ABORT else "yellow"
            return f"[{colour}]! {event.problem}: {event.action}: {escape(_cut(event.detail))}"
        if isinstance(event, Restarted):
            return (
                f"[bold red]↻ resumed by a new owner (epoch {event.epoch}) from its "
                f"{event.resumed_from or 'last'} checkpoint of {event.messages} messages; text "
                "streamed "
                "after that checkpoint was lost with its host"
            )
        if not isinstance(event, Finished):  # a TextDelta: shown above
            return None
        self.finished = event
        if not self._spoke and event.answer:  # its stream was gone: the record's answer
            self.console.print(escape(event.answer), highlight=False, soft_wrap=True)
        if event.outcome is Outcome.ANSWERED:
            return "[dim]· answered"
        why = f": {escape(event.error)}" if event.error else ""
        return f"[bold red]· turn ended {event.outcome}{why}"
