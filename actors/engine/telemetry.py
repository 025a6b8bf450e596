"""OpenTelemetry traces of turns, made from the same events the console and ``watch`` read.

One trace per turn: its id is derived from the turn id, so every incarnation of the turn
(each process that ran it between crashes) lands in the same trace without anything stored.
Each incarnation is a span, ``turn <id>``, whose span id is derived from the turn id and its
epoch; a resumed incarnation (epoch ``e``) links to the span of epoch ``e - 1``, so a trace
viewer shows the story across a SIGKILL: the first incarnation's model and tool calls under
its span id, the second's under its own, and the link between them. A killed process never
ends its incarnation span (it is lost with the process); the calls it had exported before the
kill keep their parent id, and the next incarnation links to it.

Children of an incarnation: a span per model call (``chat <model>``, with the GenAI semantic
conventions' attributes: provider, operation, request model, finish reasons, token usage, the
error type) built from :class:`~bus.events.ModelReplied`, and a span per tool call
(``execute_tool <name>``: call id, ledger key, status, idempotency, ``outcome_unknown``) from
:class:`~bus.events.ToolCalled` to :class:`~bus.events.ToolReturned`. Checkpoints, recovery
actions and resumes are events on the incarnation span. Message contents, tool arguments and
results are attributes only with ``[telemetry] capture_content``; nothing else carries text a
user or a tool produced, and no attribute ever holds a URL, a key or a header.

Exported with the official SDK: a ``BatchSpanProcessor`` and the OTLP/HTTP exporter.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from actors.engine.settings.config import TelemetrySettings
from bus.events import (
    Checkpointed,
    Finished,
    LiveEvent,
    ModelReplied,
    Recovering,
    Restarted,
    TextDelta,
    ToolCalled,
    ToolReturned,
)
from bus.phase import Transition

__all__ = ["TurnTracer", "incarnation_span_id", "turn_trace_id"]

log = logging.getLogger(__name__)

_MS = 1_000_000  # nanoseconds in a millisecond


def _digest(text: str, size: int) -> int:
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:size], "big")
    return value or 1  # 0 is the invalid id


def turn_trace_id(turn_id: str) -> int:
    """The trace id of every span of the turn."""
    return _digest(f"phaseline.turn/{turn_id}", 16)


def incarnation_span_id(turn_id: str, epoch: int) -> int:
    """The span id of the turn's incarnation at ``epoch``."""
    return _digest(f"phaseline.turn/{turn_id}/{epoch}", 8)


_FIXED: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "phaseline_span_ids", default=None
)


class _Ids(IdGenerator):
    """Random ids, except for an incarnation span, whose ids are derived (``_FIXED``)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        fixed = _FIXED.get()
        return fixed[1] if fixed is not None else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        fixed = _FIXED.get()
        return fixed[0] if fixed is not None else self._random.generate_trace_id()


@functools.cache
def _provider(cfg: TelemetrySettings) -> TracerProvider:
    """One provider per process and settings (Ray hosts make theirs on first use)."""
    service = os.environ.get("OTEL_SERVICE_NAME") or cfg.service_name
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}), id_generator=_Ids()
    )
    exporter = (
        OTLPSpanExporter(endpoint=cfg.endpoint.rstrip("/") + "/v1/traces")
        if cfg.endpoint
        else OTLPSpanExporter()  # the standard OTEL_EXPORTER_OTLP_* variables
    )
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=cfg.export_delay_ms)
    )
    return provider


@dataclass(slots=True)
class _Incarnation:
    span: Span
    text: list[str] = field(default_factory=list)
    """Reply text streamed since the last model call ended (``capture_content`` only)."""
    calls: dict[str, ToolCalled] = field(default_factory=dict)
    """Tool calls started and not returned, by the model's call id."""


class TurnTracer:
    """Turns the engine's transitions and live events into spans (see the module)."""

    def __init__(self, provider: TracerProvider, *, capture_content: bool = False) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("phaseline")
        self.capture_content = capture_content
        self._open: dict[tuple[str, int], _Incarnation] = {}

    @classmethod
    def of(cls, cfg: TelemetrySettings) -> TurnTracer | None:
        """The tracer ``cfg`` asks for; None when telemetry is off."""
        if not cfg.enabled:
            return None
        return cls(_provider(cfg), capture_content=cfg.capture_content)

    # -- incarnations ----------------------------------------------------------------------

    def _incarnation(self, turn_id: str, epoch: int, at_ms: int) -> _Incarnation:
        key = (turn_id, epoch)
        found = self._open.get(key)
        if found is not None:
            return found
        trace_id = turn_trace_id(turn_id)
        links = []
        if epoch > 1:
            before = SpanContext(
                trace_id,
                incarnation_span_id(turn_id, epoch - 1),
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            links.append(Link(before, {"phaseline.link": "previous incarnation"}))
        token = _FIXED.set((trace_id, incarnation_span_id(turn_id, epoch)))
        try:
            span = self.tracer.start_span(
                f"turn {turn_id}",
                context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root span
                kind=SpanKind.INTERNAL,
                links=links,
                start_time=at_ms * _MS,
                attributes={"phaseline.turn_id": turn_id, "phaseline.epoch": epoch},
            )
        finally:
            _FIXED.reset(token)
        found = self._open[key] = _Incarnation(span)
        return found

    def _end(self, turn_id: str, epoch: int, at_ms: int, outcome: str) -> None:
        inc = self._open.pop((turn_id, epoch), None)
        if inc is None:
            return
        inc.span.set_attribute("phaseline.outcome", outcome)
        inc.span.end(end_time=at_ms * _MS)

    def run_ended(self, turn_id: str, epoch: int, at_ms: int, how: str) -> None:
        """This process's run of the turn stopped (``how``: its outcome, or why it stopped
        without ending the turn: fenced, interrupted, released, ...)."""
        self._end(turn_id, epoch, at_ms, how)

    # -- listeners --------------------------------------------------------------------------

    def on_transition(self, event: Transition) -> None:
        self._incarnation(event.turn_id, event.epoch, event.at_ms)

    def on_event(self, event: LiveEvent) -> None:
        inc = self._incarnation(event.turn_id, event.epoch, event.at_ms)
        if isinstance(event, TextDelta):
            if self.capture_content:
                inc.text.append(event.text)
        elif isinstance(event, ModelReplied):
            self._model_span(inc, event)
        elif isinstance(event, ToolCalled):
            inc.calls[event.call_id] = event
        elif isinstance(event, ToolReturned):
            self._tool_span(inc, inc.calls.pop(event.call_id, None), event)
        elif isinstance(event, Checkpointed):
            inc.span.add_event(
                "checkpoint",
                {
                    "phaseline.seq": event.seq,
                    "phaseline.reason": event.reason.value,
                    "phaseline.messages": event.messages,
                },
                timestamp=event.at_ms * _MS,
            )
        elif isinstance(event, Recovering):
            inc.span.add_event(
                "recovery",
                {"phaseline.problem": event.problem.value, "phaseline.action": event.action.value},
                timestamp=event.at_ms * _MS,
            )
        elif isinstance(event, Restarted):
            inc.span.set_attribute(
                "phaseline.resumed_from", event.resumed_from.value if event.resumed_from else ""
            )
            inc.span.add_event(
                "resumed", {"phaseline.messages": event.messages}, timestamp=event.at_ms * _MS
            )
        elif isinstance(event, Finished):
            if event.outcome is not None and event.outcome.aborted:
                inc.span.set_status(Status(StatusCode.ERROR, event.outcome.value))
            self._end(event.turn_id, event.epoch, event.at_ms, str(event.outcome or "final"))

    def _model_span(self, inc: _Incarnation, e: ModelReplied) -> None:
        attributes: dict[str, str | int | list[str]] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.system": e.system,
            "gen_ai.provider.name": e.system,
            "gen_ai.request.model": e.model,
            "phaseline.turn_id": e.turn_id,
            "phaseline.epoch": e.epoch,
        }
        if e.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [e.finish_reason]
        if e.prompt_tokens or e.completion_tokens:
            attributes["gen_ai.usage.input_tokens"] = e.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = e.completion_tokens
        if e.cached_tokens:
            attributes["gen_ai.usage.cache_read.input_tokens"] = e.cached_tokens
        if self.capture_content and inc.text:
            reply = "".join(inc.text)
            attributes["gen_ai.output.messages"] = json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": reply}]}]
            )
        inc.text.clear()
        span = self.tracer.start_span(
            f"chat {e.model}",
            context=trace.set_span_in_context(inc.span),
            kind=SpanKind.CLIENT,
            start_time=e.started_ms * _MS,
            attributes=attributes,
        )
        if e.error:
            span.set_attribute("error.type", e.error)
            span.set_status(Status(StatusCode.ERROR, e.error))
        span.end(end_time=e.at_ms * _MS)

    def _tool_span(self, inc: _Incarnation, called: ToolCalled | None, e: ToolReturned) -> None:
        attributes: dict[str, str | int | bool] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": e.name,
            "gen_ai.tool.call.id": e.call_id,
            "phaseline.tool.status": e.status,
            "phaseline.tool.outcome_unknown": e.status == "outcome_unknown",
        }
        if called is not None:
            attributes["phaseline.tool.call_key"] = called.call_key
            attributes["phaseline.tool.idempotent"] = called.idempotent
            if self.capture_content:
                attributes["gen_ai.tool.call.arguments"] = called.arguments
        if self.capture_content:
            attributes["gen_ai.tool.call.result"] = e.output
        started = called.at_ms if called is not None else e.at_ms
        span = self.tracer.start_span(
            f"execute_tool {e.name}",
            context=trace.set_span_in_context(inc.span),
            kind=SpanKind.INTERNAL,
            start_time=started * _MS,
            attributes=attributes,
        )
        if e.status not in ("ok", "skipped"):
            span.set_status(Status(StatusCode.ERROR, e.status))
        span.end(end_time=e.at_ms * _MS)

    def flush(self) -> None:
        """Send what the batch holds now (the end of a CLI run)."""
        self.provider.force_flush()
