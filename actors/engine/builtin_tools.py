"""The built-in tools of DESIGN §5: ``echo`` and ``sleep`` (idempotent) and
``counter_increment`` (not idempotent: its side effect is a Redis counter per call key, so a
duplicate can be counted from outside)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec


def _delay(args: Mapping[str, Any]) -> float:
    value = args.get("delay_ms", 0)
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"delay_ms must be a non-negative integer, got {value!r}")
    return value / 1000


async def _echo(args: Mapping[str, Any], ctx: ToolContext) -> str:
    await asyncio.sleep(_delay(args))
    return str(args.get("text", ""))


async def _sleep(args: Mapping[str, Any], ctx: ToolContext) -> str:
    delay = _delay(args)
    await asyncio.sleep(delay)
    return f"slept {int(delay * 1000)} ms"


async def _counter_increment(args: Mapping[str, Any], ctx: ToolContext) -> str:
    await asyncio.sleep(_delay(args))
    if ctx.effects is None:
        raise RuntimeError("counter_increment needs a side-effect store")
    count = await ctx.effects.increment(ctx.turn_id, ctx.call_key)
    return f"count={count}"


BUILTIN_TOOLS = ToolRegistry(
    [
        ToolSpec("echo", _echo, idempotent=True),
        ToolSpec("sleep", _sleep, idempotent=True),
        ToolSpec("counter_increment", _counter_increment, idempotent=False),
    ]
)
