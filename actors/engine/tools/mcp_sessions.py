"""MCP client sessions of this process: the part of MCP support that holds the official SDK.

Imported on first use by :func:`actors.engine.tools.mcp.hub` only: the SDK takes about 0.4 s of CPU
to import, and every Ray actor process (hosts, checkpoint actors, tool workers) would pay it at
start whether or not an agent of its deployment uses MCP.

Each process that runs tool calls (a ToolWorker on Ray, or the engine of ``phaseline run
--in-process``) holds one session per (agent, server) in its hub, started on first use in
a task of its own (the SDK's transports live in anyio task groups, which must be left by the
task that entered them). A session whose server process died or whose connection dropped is
noticed by its task ending, or by a call failing with ``CONNECTION_CLOSED``, and replaced on the
next call; a start that fails is retried with backoff (0.5 s doubling to 30 s), the call
waiting for it, and a server whose last 3 starts failed is *down*: its calls fail at once with a
clear error (:class:`~bus.errors.ToolUnavailable`: the call never started) until its next start
is due. A call that was in flight on a dead session
raises :class:`~bus.errors.ToolExecutorLost`, which the runners treat like a dead worker: an
idempotent tool is re-run, any other is ``outcome_unknown``.

The call key travels in the request's ``_meta`` as ``phaseline/call_key``, for the server to
deduplicate with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, CallToolResult, RequestParamsMeta, TextContent

from actors.turn.mcp import MCPServer, MCPToolInfo
from bus.errors import ToolError, ToolExecutorLost, ToolUnavailable

__all__ = ["CALL_KEY_META", "MCPHub", "MCPToolFailed", "ServerState"]

log = logging.getLogger(__name__)

#: The ``_meta`` field a call's idempotency key travels in.
CALL_KEY_META = "phaseline/call_key"

#: Backoff between attempts to start a server that would not start.
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


def _transport(server: MCPServer) -> StdioServerParameters | Any:
    if server.command is not None:
        command = shutil.which(server.command) or server.command
        return StdioServerParameters(
            command=command, args=list(server.args), env=dict(server.env) or None, cwd=server.cwd
        )
    assert server.url is not None
    http = httpx2.AsyncClient(headers=dict(server.headers), timeout=server.timeout_s)
    return streamable_http_client(server.url, http_client=http)


class _StartAgain(Exception):
    """A start failed but the server is not known to be down yet: wait, then try again."""


#: Consecutive failed starts after which a server is *down*: calls fail at once until its
#: next start is due, instead of waiting for it.
DOWN_AFTER = 3


class _Session:
    """One server's client session, kept open by a task of its own."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.client: Client | None = None
        self.starts = 0
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[Client] | None = None
        self._closing = asyncio.Event()
        self._not_before = 0.0
        self._lock = asyncio.Lock()

    @property
    def state(self) -> str:
        if self.client is not None:
            return "connected"
        return "backing off" if self.failures else "idle"

    async def get(self) -> Client:
        """The open session, or a new one. While the server is known to be down (its last
        :data:`DOWN_AFTER` starts failed) a call fails at once with
        :class:`~bus.errors.ToolUnavailable` until its next start is due; before that, a call
        waits out the backoff and tries again (a crashed server is simply restarted)."""
        while True:
            async with self._lock:
                if self.client is not None and self._task is not None and not self._task.done():
                    return self.client
                wait = self._not_before - time.monotonic()
                if wait <= 0:
                    try:
                        return await self._start()
                    except _StartAgain:
                        continue
                if self.failures >= DOWN_AFTER:
                    raise ToolUnavailable(
                        f"MCP server {self.server.name} is down (next start in {wait:.1f} s)"
                    )
            await asyncio.sleep(wait)  # the backoff before the next start

    async def _start(self) -> Client:
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        closing = asyncio.Event()
        self._ready, self._closing = ready, closing
        self._task = asyncio.ensure_future(self._hold(ready, closing))
        try:
            client = await asyncio.wait_for(asyncio.shield(ready), self.server.timeout_s)
        except Exception as exc:
            closing.set()
            self.failures += 1
            delay = BACKOFF_S[min(self.failures, len(BACKOFF_S)) - 1]
            self._not_before = time.monotonic() + delay
            if self.failures >= DOWN_AFTER:
                raise ToolUnavailable(
                    f"MCP server {self.server.name} did not start: {type(exc).__name__}: {exc}"
                ) from None
            log.warning("MCP server %s did not start (%r); retrying", self.server.name, exc)
            raise _StartAgain() from None
        self.client = client
        self.failures = 0
        self.starts += 1
        return client

    async def _hold(self, ready: asyncio.Future[Client], closing: asyncio.Event) -> None:
        try:
            async with Client(_transport(self.server), read_timeout_seconds=None) as client:
                ready.set_result(client)
                await closing.wait()
        except Exception as exc:  # a start that failed, or a transport that died
            if not ready.done():
                ready.set_exception(exc)
            log.info("MCP server %s: session ended: %r", self.server.name, exc)
        finally:
            if self._ready is ready:
                self.client = None

    def drop(self, client: Client) -> None:
        """Forget the session ``client`` belongs to, if it is still the current one (a late
        failure on an old session must not close its successor): the next call starts anew."""
        if self.client is client:
            self.client = None
            self._closing.set()


@dataclass(frozen=True, slots=True)
class ServerState:
    """How one MCP session of this process is doing (``phaseline status``, ``hello``)."""

    agent: str
    """Import path of the agent it serves."""
    server: str
    """Server name."""
    state: str
    """``connected``, ``idle`` (not started yet, or ended) or ``backing off``."""
    starts: int
    """Sessions started so far."""


class MCPHub:
    """The MCP sessions of this process, one per (agent path, server name)."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[str, str], _Session] = {}
        self._listed: dict[tuple[str, str], tuple[MCPToolInfo, ...]] = {}

    def _session(self, agent: str, server: MCPServer) -> _Session:
        key = (agent, server.name)
        if key not in self._sessions:
            self._sessions[key] = _Session(server)
        return self._sessions[key]

    def states(self) -> list[ServerState]:
        return [
            ServerState(agent, name, s.state, s.starts)
            for (agent, name), s in sorted(self._sessions.items())
        ]

    async def list_tools(self, agent: str, server: MCPServer) -> tuple[MCPToolInfo, ...]:
        """The server's tools (listed once per process; cached after the first success)."""
        key = (agent, server.name)
        if key in self._listed:
            return self._listed[key]
        session = self._session(agent, server)
        client = await session.get()
        try:
            listing = await asyncio.wait_for(client.list_tools(), server.timeout_s)
        except (MCPError, OSError, TimeoutError) as exc:
            session.drop(client)
            raise ToolUnavailable(f"MCP server {server.name}: list_tools failed: {exc}") from exc
        infos = tuple(_info(server.name, t) for t in listing.tools)
        self._listed[key] = infos
        return infos

    async def call(
        self, agent: str, server: MCPServer, tool: str, args: Mapping[str, Any], call_key: str
    ) -> str:
        """Run one tool call; its result text. An ``isError`` result raises
        :class:`MCPToolFailed` (the model reads it as an error); a dead session raises
        :class:`ToolExecutorLost`."""
        session = self._session(agent, server)
        client = await session.get()
        try:
            meta = cast(RequestParamsMeta, {CALL_KEY_META: call_key})
            result = await client.call_tool(tool, dict(args), meta=meta)
        except MCPError as exc:
            if exc.code == CONNECTION_CLOSED:
                session.drop(client)
                raise ToolExecutorLost(
                    f"MCP server {server.name} went away during {tool}"
                ) from None
            raise MCPToolFailed(f"{server.name}: {exc}") from None
        except (OSError, EOFError) as exc:
            session.drop(client)
            raise ToolExecutorLost(f"MCP server {server.name}: {exc}") from None
        text = _text_of(result)
        if result.is_error:
            raise MCPToolFailed(text or f"{tool} failed")
        return text


class MCPToolFailed(ToolError):
    """An MCP tool answered ``isError`` (or the server refused the call): the model reads it."""


def _info(server: str, tool: Any) -> MCPToolInfo:
    notes = tool.annotations
    return MCPToolInfo(
        server=server,
        name=tool.name,
        description=tool.description or "",
        parameters=dict(tool.input_schema),
        read_only=None if notes is None else notes.read_only_hint,
        idempotent_hint=None if notes is None else notes.idempotent_hint,
        destructive=None if notes is None else notes.destructive_hint,
    )


def _text_of(result: CallToolResult) -> str:
    """What the model reads: the text blocks, else the structured content as JSON."""
    texts = [c.text for c in result.content if isinstance(c, TextContent)]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, sort_keys=True)
    kinds = sorted({type(c).__name__ for c in result.content})
    return f"[{', '.join(kinds) or 'no content'}]"
