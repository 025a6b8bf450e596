"""A model provider's bad days, in front of a real endpoint: the chaos target ``provider``.

:class:`ProviderProxy` listens on a loopback port and forwards each HTTP request to the
model endpoint behind it (an OpenAI-compatible base URL), one connection per request, after a
latency drawn from a log-normal distribution (a provider's answer time varies, with a long
tail). :meth:`ProviderProxy.storm` opens a window of one :class:`ProviderFault`, as providers
have them:

* ``429``: every request is refused with ``rate_limit_exceeded``, ``retry-after`` and
  ``retry-after-ms`` (the end of the storm);
* ``529``: Anthropic's ``overloaded_error``; ``5xx``: 500, 502 or 503 at random;
* ``drop``: a reply is cut mid-way, its head and part of its body sent, then the connection
  reset (a stream dropped mid-reply);
* ``hang``: the request is read and never answered, until the client gives up;
* ``dead``: connections are reset as they come (the endpoint is down).

Each request a window hit is counted per fault in :attr:`ProviderProxy.landed`, which is what
the chaos report says landed. Raw asyncio on a :class:`~actors.harness.tcp_proxy.ProxyLoop`: a
proxy that parsed and re-encoded JSON or SSE would hide what it is there to break.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from actors.harness.tcp_proxy import CHUNK, ProxyLoop
from bus.errors import ConfigError

__all__ = ["Latency", "ProviderFault", "ProviderProxy"]

#: How long a hung request is held at most when its client never gives up.
HANG_MAX_S = 600.0


class ProviderFault(StrEnum):
    """What a storm does to the requests it meets."""

    RATE_LIMIT = "429"
    """Refused for the rate limit, with when to come back."""
    OVERLOADED = "529"
    """Refused as overloaded (Anthropic's 529)."""
    SERVER_ERROR = "5xx"
    """500, 502 or 503."""
    DROP = "drop"
    """The reply cut mid-way, the connection reset."""
    HANG = "hang"
    """No answer until the client gives up."""
    DEAD = "dead"
    """The connection reset at once."""


@dataclass(frozen=True, slots=True)
class Latency:
    """How long the provider takes before it answers a forwarded request."""

    median_ms: float = 0.0
    """Half of the requests wait less (0: none waits)."""
    sigma: float = 0.5
    """Spread of the log-normal (0.5: one request in twenty waits over 2.3x the median)."""

    def draw(self, rng: random.Random) -> float:
        """Seconds to wait."""
        if self.median_ms <= 0:
            return 0.0
        return min(60.0, self.median_ms * math.exp(rng.gauss(0.0, self.sigma)) / 1000)


@dataclass(slots=True)
class _Storm:
    fault: ProviderFault
    until: float


class ProviderProxy:
    """Forwards to ``upstream`` (a base URL such as ``http://127.0.0.1:8000/v1``) with faults."""

    def __init__(
        self, loop: ProxyLoop, upstream: str, *, latency: Latency = Latency(), seed: int = 0
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(
                f"the provider target forwards plain HTTP to a local endpoint; {upstream!r} is "
                "not one (set OPENAI_BASE_URL to http://HOST:PORT/v1)"
            )
        self._loop = loop
        self._upstream = (parts.hostname, parts.port or 80)
        self._path = parts.path.rstrip("/")
        self.latency = latency
        self._rng = random.Random(seed)
        self._storm: _Storm | None = None
        self.landed: Counter[ProviderFault] = Counter()
        """Requests each fault hit, over the proxy's life."""
        self.forwarded = 0
        """Requests forwarded whole."""
        self.upstream = 0
        """Requests sent on to the endpoint, answered whole or not (a client that went away
        mid-answer still cost the endpoint its request)."""
        self._server = loop.run(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        """What a client uses instead of the upstream's base URL."""
        return f"http://127.0.0.1:{self.port}{self._path}"

    def storm(self, fault: ProviderFault, seconds: float) -> None:
        """Every request of the next ``seconds`` meets ``fault``."""
        self._storm = _Storm(fault, time.monotonic() + seconds)

    def calm(self) -> None:
        """End the storm now."""
        self._storm = None

    def close(self) -> None:
        self._loop.run(self._close())

    async def _close(self) -> None:
        self._server.close()

    def _fault_now(self) -> tuple[ProviderFault | None, float]:
        storm = self._storm
        if storm is None:
            return None, 0.0
        left = storm.until - time.monotonic()
        if left <= 0:
            self._storm = None
            return None, 0.0
        return storm.fault, left

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            fault, left = self._fault_now()
            if fault is ProviderFault.DEAD:
                self.landed[fault] += 1
                return
            head, body = await _read_request(reader)
            if head is None:
                return
            fault, left = self._fault_now()  # the storm may have begun while it was sent
            if fault is not None:
                self.landed[fault] += 1
            if fault is ProviderFault.HANG:
                await _until_gone(reader)
                return
            if fault in (
                ProviderFault.RATE_LIMIT,
                ProviderFault.OVERLOADED,
                ProviderFault.SERVER_ERROR,
            ):
                writer.write(self._refusal(fault, left))
                await writer.drain()
                return
            await asyncio.sleep(self.latency.draw(self._rng))
            await self._forward(head, body, writer, cut=fault is ProviderFault.DROP)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away, or spoke something else: nothing to answer
        finally:
            writer.transport.abort()

    def _refusal(self, fault: ProviderFault, left_s: float) -> bytes:
        if fault is ProviderFault.RATE_LIMIT:
            wait_ms = max(1, math.ceil(left_s * 1000))
            error = {
                "message": "Rate limit reached for requests",
                "type": "requests",
                "code": "rate_limit_exceeded",
                "param": None,
            }
            extra = [
                ("retry-after", str(math.ceil(wait_ms / 1000))),
                ("retry-after-ms", str(wait_ms)),
            ]
            return _response(429, "Too Many Requests", {"error": error}, extra)
        if fault is ProviderFault.OVERLOADED:
            error = {"type": "overloaded_error", "message": "Overloaded"}
            return _response(529, "Site Overloaded", {"type": "error", "error": error})
        status = self._rng.choice((500, 502, 503))
        error = {
            "message": "The server had an error",
            "type": "server_error",
            "code": None,
            "param": None,
        }
        return _response(status, "Server Error", {"error": error})

    async def _forward(
        self, head: bytes, body: bytes, writer: asyncio.StreamWriter, *, cut: bool
    ) -> None:
        """Send the request upstream on a connection of its own and relay the answer; with
        ``cut``, only its head and part of its body, then reset."""
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        try:
            up_writer.write(_closing(head) + body)
            await up_writer.drain()
            self.upstream += 1
            answer_head = await up_reader.readuntil(b"\r\n\r\n")
            writer.write(_closing(answer_head))
            while True:
                data = await up_reader.read(CHUNK)
                if not data:
                    break
                if cut:  # half of what the first read brought, then the reset
                    writer.write(data[: max(1, len(data) // 2)])
                    await writer.drain()
                    return
                writer.write(data)
                await writer.drain()
            self.forwarded += 1
        finally:
            up_writer.transport.abort()


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes | None, bytes]:
    """The request's head (through its blank line) and its body (``content-length`` long);
    None at once if the client sent nothing. A head past the reader's limit (64 KiB) raises
    :class:`asyncio.LimitOverrunError`."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None, b""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return head, await reader.readexactly(length) if length else b""


def _closing(head: bytes) -> bytes:
    """An HTTP head with ``connection: close`` instead of what it said: one request per
    connection, so a reply ends when its connection does."""
    lines = [
        line
        for line in head.rstrip(b"\r\n").split(b"\r\n")
        if line.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([*lines, b"connection: close"]) + b"\r\n\r\n"


def _response(
    status: int, reason: str, payload: object, extra: list[tuple[str, str]] | None = None
) -> bytes:
    body = json.dumps(payload).encode()
    lines = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        f"x-request-id: chaos-{random.getrandbits(32):08x}",
    ]
    lines += [f"{k}: {v}" for k, v in extra or ()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _until_gone(reader: asyncio.StreamReader) -> None:
    """Hold a request until its client closes the connection (or :data:`HANG_MAX_S`)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(reader.read(), HANG_MAX_S)
