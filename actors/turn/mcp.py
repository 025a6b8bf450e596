"""MCP servers as an agent declares them, and the ledger rule for their tools. Pure.

An agent lists the MCP servers whose tools it may call (:class:`MCPServer`); each server's
tools are offered to the model as ``<server>__<tool>`` with the schemas the server lists.
Whether a call may be re-run after a crash comes from the tool's MCP annotations
(:func:`mcp_idempotent`): only a tool the server marks ``idempotentHint`` or ``readOnlyHint``
is; anything else, no annotations or ``destructiveHint``, is treated as not idempotent, so a
call caught in flight is ``outcome_unknown`` and never re-run. The agent can override either
way, per tool. ``actors.engine.tools.mcp`` holds the client sessions that run the calls.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MCP_SEPARATOR", "MCPServer", "MCPToolInfo", "mcp_idempotent"]

#: Between a server's name and its tool's name in what the model calls.
MCP_SEPARATOR = "__"

_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


@dataclass(frozen=True, slots=True)
class MCPServer:
    """One MCP server an agent's tools come from: a stdio command or a streamable HTTP URL.

    ``env`` and ``headers`` may hold secrets: they are passed to the server and nowhere else
    (the repr shows their names only)."""

    name: str
    """Prefix of its tools' names (``<name>__<tool>``); 1-32 of ``[A-Za-z0-9_-]``."""
    command: str | None = None
    """Executable of a stdio server (with ``args``, ``env``, ``cwd``)."""
    args: tuple[str, ...] = ()
    """Its command-line arguments."""
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Extra environment of the server process (merged over a safe default set)."""
    cwd: str | None = None
    """Working directory of the server process."""
    url: str | None = None
    """Endpoint of a streamable HTTP server (with ``headers``), instead of ``command``."""
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    """HTTP headers sent with every request (e.g. ``Authorization``)."""
    idempotent: Mapping[str, bool] = field(default_factory=dict)
    """Per-tool override of the annotation rule (tool name as the server lists it)."""
    timeout_s: float = 30.0
    """Per-call timeout of its tools."""
    max_concurrency: int = 16
    """Calls of one of its tools running at once in one process."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray resources its calls need (they run on the ToolWorker pool of that shape)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name) or MCP_SEPARATOR in self.name:
            raise ValueError(
                f"MCP server name {self.name!r}: use 1-32 of [A-Za-z0-9_-], without '__'"
            )
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name}: give exactly one of command and url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name}: url must be http(s)")
        if not self.timeout_s > 0 or self.max_concurrency < 1:
            raise ValueError(f"MCP server {self.name}: timeout_s > 0 and max_concurrency >= 1")

    def __repr__(self) -> str:
        where = f"command={self.command!r}" if self.command else f"url={self.url!r}"
        secrets = sorted(self.env) + sorted(self.headers)
        return f"MCPServer(name={self.name!r}, {where}, secrets={secrets})"

    def tool_name(self, tool: str) -> str:
        """What the model calls the server's tool ``tool``."""
        return f"{self.name}{MCP_SEPARATOR}{tool}"


@dataclass(frozen=True, slots=True)
class MCPToolInfo:
    """A tool as an MCP server listed it: what crosses from a ToolWorker to a host."""

    server: str
    """The :attr:`MCPServer.name` it belongs to."""
    name: str
    """Its name on the server."""
    description: str
    """What the server says it does."""
    parameters: Mapping[str, Any]
    """Its input JSON schema."""
    read_only: bool | None
    """The ``readOnlyHint`` annotation (None: not given)."""
    idempotent_hint: bool | None
    """The ``idempotentHint`` annotation (None: not given)."""
    destructive: bool | None
    """The ``destructiveHint`` annotation (None: not given)."""


def mcp_idempotent(info: MCPToolInfo, override: Mapping[str, bool]) -> bool:
    """Whether a call of this tool may be re-run after a crash: the agent's override, else
    true only if the server says the tool is idempotent or read-only."""
    if info.name in override:
        return override[info.name]
    return info.idempotent_hint is True or info.read_only is True
