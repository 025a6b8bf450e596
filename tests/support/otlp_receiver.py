"""A local OTLP/HTTP trace receiver for the tests: it takes what the official exporter sends
(``POST /v1/traces``, an ``ExportTraceServiceRequest`` in protobuf, gzip or not), decodes it
with the official protobuf definitions (``opentelemetry-proto``) and keeps the spans."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int
    links: tuple[int, ...]
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status_code: int
    events: tuple[str, ...] = field(default=())


class Receiver:
    """The spans received so far (thread-safe)."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.url = ""

    def add(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        name=s.name, trace_id=int.from_bytes(s.trace_id, "big"),
                        span_id=int.from_bytes(s.span_id, "big"),
                        parent_id=int.from_bytes(s.parent_span_id or b"\0", "big"),
                        links=tuple(int.from_bytes(link.span_id, "big") for link in s.links),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        resource=resource, status_code=s.status.code,
                        events=tuple(e.name for e in s.events),
                    ))  # fmt: skip
        with self._lock:
            self._spans += got

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver on a free port of 127.0.0.1; ``.url`` is its base URL."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            receiver.add(request)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *_args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
