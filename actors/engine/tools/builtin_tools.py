"""The built-in tools of DESIGN §5: ``echo`` and ``sleep`` (idempotent), ``counter_increment``
and ``send`` (not idempotent: each run's side effect is a Redis counter per call key, so a
duplicate can be counted from outside; ``counter_increment`` waits then acts, ``send`` acts then
waits, as a message sent before a slow acknowledgement, so a crash during its wait leaves a real
effect behind a call in flight). They are the scripted agent's tools; every one takes the
scripted model's arguments (``text``, ``delay_ms``)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from pydantic import Field

from actors.turn.tools import ToolContext, ToolRegistry, tool

Delay = Annotated[int, Field(ge=0, le=3_600_000)]


@tool(idempotent=True)
async def echo(text: str = "", delay_ms: Delay = 0) -> str:
    """Answer with the text given.

    Args:
        text: What to answer with.
        delay_ms: Milliseconds to wait first.
    """
    await asyncio.sleep(delay_ms / 1000)
    return text


@tool(idempotent=True)
async def sleep(text: str = "", delay_ms: Delay = 0) -> str:
    """Wait, then say how long.

    Args:
        text: Ignored.
        delay_ms: Milliseconds to wait.
    """
    await asyncio.sleep(delay_ms / 1000)
    return f"slept {delay_ms} ms"


@tool(idempotent=False)
async def counter_increment(ctx: ToolContext, text: str = "", delay_ms: Delay = 0) -> str:
    """Increment the side-effect counter of this call, once per run of the call.

    Args:
        text: Ignored.
        delay_ms: Milliseconds to wait first.
    """
    await asyncio.sleep(delay_ms / 1000)
    if ctx.effects is None:
        raise RuntimeError("counter_increment needs a side-effect store")
    count = await ctx.effects.increment(ctx.turn_id, ctx.call_key)
    return f"count={count}"


@tool(idempotent=False)
async def send(ctx: ToolContext, text: str = "", delay_ms: Delay = 0) -> str:
    """Send a note: its effect happens at once, then the call waits for the acknowledgement.

    Args:
        text: The note.
        delay_ms: Milliseconds the acknowledgement takes.
    """
    if ctx.effects is None:
        raise RuntimeError("send needs a side-effect store")
    count = await ctx.effects.increment(ctx.turn_id, ctx.call_key)
    await asyncio.sleep(delay_ms / 1000)
    return f"sent {text[:16]!r} (run {count})"


BUILTIN_TOOLS = ToolRegistry([echo, sleep, counter_increment, send])
