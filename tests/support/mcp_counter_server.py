"""An MCP server for the tests, written with the SDK's server API (``MCPServer``).

Tools: ``bump`` (no annotations but ``destructiveHint``: not idempotent; each run appends
``bump <call key> <pid>`` to ``$PHASELINE_MCP_LOG``, so a duplicate run shows as a key twice;
``$PHASELINE_MCP_BUMP_MS`` delays it), ``slow`` (``readOnlyHint``: sleeps), ``echo``
(``idempotentHint``), ``plain`` (no annotations) and ``fail`` (answers ``isError``). It appends
``start - <pid>`` when it starts, and ``auth <header> <pid>`` for the ``Authorization`` header of
an HTTP request. Run: ``python -m tests.support.mcp_counter_server`` (stdio) or ``... http PORT``.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

server = MCPServer("phaseline-test")


def _log(line: str) -> None:
    path = os.environ.get("PHASELINE_MCP_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{line} {os.getpid()}\n")


def _key(ctx: Context) -> str:
    meta = ctx.request_context.meta or {}
    headers = ctx.headers or {}
    if "authorization" in headers:
        _log(f"auth {headers['authorization'].replace(' ', '_')}")
    return str(meta.get("phaseline/call_key", "-"))


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
async def bump(n: int, ctx: Context) -> str:
    """Count one side effect.

    Args:
        n: Echoed back.
    """
    key = _key(ctx)
    await asyncio.sleep(float(os.environ.get("PHASELINE_MCP_BUMP_MS", "0")) / 1000)
    _log(f"bump {key}")
    return f"bumped {n}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def slow(ms: int, ctx: Context) -> str:
    """Sleep, then say so.

    Args:
        ms: Milliseconds to sleep.
    """
    _key(ctx)
    await asyncio.sleep(ms / 1000)
    return f"slept {ms}"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True))
def echo(text: str) -> str:
    """Say it back."""
    return text


@server.tool()
def plain(x: int) -> str:
    """No annotations at all."""
    return str(x)


@server.tool()
def fail(why: str) -> str:
    """Fail on purpose."""
    raise ToolError(f"failed: {why}")


def main() -> None:
    _log("start -")
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()


if __name__ == "__main__":
    main()
