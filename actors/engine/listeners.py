"""Who hears a turn's transitions and live events in one process: the caller's own listeners,
the live streams in Redis (what ``phaseline watch`` and the console read), and the trace
exporter when ``[telemetry]`` is on. The engine calls one callable per kind; this fans out.

Listeners are called inside the turn loop and must not block: the publisher buffers and
flushes in the background, the tracer hands ended spans to its batch exporter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from actors.engine.settings.config import Settings
from actors.engine.settings.extras import Extra, needs
from bus.events import LiveEvent
from bus.phase import Transition
from store.redis.connection import StoreClient
from store.views.streams import BufferedPublisher, RedisBus

if TYPE_CHECKING:
    from actors.engine.telemetry import TurnTracer

__all__ = ["Listeners"]


@dataclass(slots=True)
class Listeners:
    """The listeners of one engine."""

    transitions: list[Callable[[Transition], None]] = field(default_factory=list)
    """Called with every phase transition."""
    events: list[Callable[[LiveEvent], None]] = field(default_factory=list)
    """Called with every live event."""
    publisher: BufferedPublisher | None = None
    """The live streams' publisher, when this process publishes."""
    tracer: TurnTracer | None = None
    """The trace exporter, when telemetry is on."""

    @classmethod
    def of(
        cls,
        client: StoreClient,
        settings: Settings,
        *,
        on_transition: Callable[[Transition], None] | None = None,
        on_event: Callable[[LiveEvent], None] | None = None,
        publish: bool = True,
    ) -> Listeners:
        """The caller's listeners, plus the live streams (``publish``; a Ray host brings its
        own publisher) and the tracer of ``settings.telemetry``."""
        out = cls()
        if on_transition is not None:
            out.transitions.append(on_transition)
        if on_event is not None:
            out.events.append(on_event)
        if publish:
            keys = settings.redis.key_layout()
            out.publisher = BufferedPublisher(RedisBus(client, keys, live=settings.events.live()))
            out.transitions.append(out.publisher.add)
            out.events.append(out.publisher.add)
        if settings.telemetry.enabled:
            with needs(Extra.OTEL, "[telemetry] (an OTLP endpoint is set)"):
                from actors.engine.telemetry import TurnTracer
            out.tracer = TurnTracer.of(settings.telemetry)
        if out.tracer is not None:
            out.transitions.append(out.tracer.on_transition)
            out.events.append(out.tracer.on_event)
        return out

    def on_transition(self) -> Callable[[Transition], None] | None:
        """The one callable the engine calls per transition (None: nobody listens)."""
        return _fan_out(self.transitions)

    def on_event(self) -> Callable[[LiveEvent], None] | None:
        """The one callable the engine calls per live event (None: nobody listens)."""
        return _fan_out(self.events)

    async def aclose(self) -> None:
        """Publish what is buffered and export what the tracer holds (end of a run)."""
        if self.publisher is not None:
            await self.publisher.flush()
        if self.tracer is not None:
            self.tracer.flush()


T = TypeVar("T")


def _fan_out(listeners: list[Callable[[T], None]]) -> Callable[[T], None] | None:
    if not listeners:
        return None
    if len(listeners) == 1:
        return listeners[0]

    def each(item: T) -> None:
        for listener in listeners:
            listener(item)

    return each
