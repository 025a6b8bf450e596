"""An agent's MCP tools: their specs, the names the model sees, and this process's sessions.

The sessions themselves (the official SDK's clients, their restarts and backoff) live in
:mod:`actors.engine.tools.mcp_sessions`, imported the first time :func:`hub` is called: a process
whose agents use no MCP server never imports the SDK (about 0.4 s of CPU at every Ray actor's
start otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from actors.turn.mcp import MCP_SEPARATOR, MCPServer, MCPToolInfo, mcp_idempotent
from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec
from bus.errors import ConfigError, ToolExecutorLost, ToolUnavailable

if TYPE_CHECKING:
    from actors.engine.tools.mcp_sessions import MCPHub, ServerState

__all__ = ["hub", "hub_states", "mcp_registry", "mcp_spec", "mcp_target", "merged"]

log = logging.getLogger(__name__)

_HUB: MCPHub | None = None


def hub() -> MCPHub:
    """The MCP sessions of this process (the SDK is imported here, on first use). A function,
    not a module global that other modules import: Ray pickles an actor class's methods by
    value, and a live hub (tasks, sessions) in their globals cannot be pickled."""
    global _HUB
    if _HUB is None:
        from actors.engine.tools.mcp_sessions import MCPHub  # the SDK: only where MCP is used

        _HUB = MCPHub()
    return _HUB


def hub_states() -> list[ServerState]:
    """How this process's MCP sessions are doing; none (and no SDK import) before the first
    MCP tool was listed or called here."""
    return [] if _HUB is None else _HUB.states()


def mcp_spec(agent: str, server: MCPServer, info: MCPToolInfo) -> ToolSpec:
    """The tool spec of one MCP tool; its calls run through this process's :func:`hub`."""

    async def call(args: Mapping[str, Any], ctx: ToolContext) -> str:
        return await hub().call(agent, server, info.name, args, ctx.call_key)

    return ToolSpec(
        name=server.tool_name(info.name),
        fn=call,
        idempotent=mcp_idempotent(info, server.idempotent),
        timeout_s=server.timeout_s,
        max_concurrency=server.max_concurrency,
        resources=dict(server.resources),
        description=info.description,
        parameters=info.parameters,
    )


def mcp_target(servers: tuple[MCPServer, ...], name: str) -> tuple[MCPServer, str] | None:
    """The server and server-side tool name a model-facing tool name stands for, if any."""
    prefix, sep, tool = name.partition(MCP_SEPARATOR)
    if not sep or not tool:
        return None
    server = next((s for s in servers if s.name == prefix), None)
    return None if server is None else (server, tool)


def merged(agent: str, base: ToolRegistry, specs: list[ToolSpec]) -> ToolRegistry:
    """The agent's Python tools and its MCP tools; a name clash is a :class:`ConfigError`.
    Without MCP tools, ``base`` itself."""
    if not specs:
        return base
    names = [s.name for s in base] + [s.name for s in specs]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ConfigError(f"agent {agent}: tool names {clash} are given twice")
    return ToolRegistry([*base, *specs])


async def mcp_registry(
    agent: str, base: ToolRegistry, servers: tuple[MCPServer, ...]
) -> ToolRegistry:
    """The agent's tools with its MCP servers' tools listed through :func:`hub`. A server that
    cannot be listed now contributes nothing (its calls fail as unknown tools) and is asked
    again next time."""
    specs: list[ToolSpec] = []
    for server in servers:
        try:
            infos = await hub().list_tools(agent, server)
        except (ToolExecutorLost, ToolUnavailable) as exc:
            log.error("agent %s: %s; its tools are left out for now", agent, exc)
            continue
        specs.extend(mcp_spec(agent, server, info) for info in infos)
    return merged(agent, base, specs)
