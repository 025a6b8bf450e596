"""Bad input a chaos run throws at a deployment (``--targets bad_input``): turns of an agent
whose tools raise what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``, a bare
``BaseException``, a ``CancelledError`` nobody asked for, ``sys.exit`` in a sync tool's thread).
Each call must fail alone and the turn answer: no host, ToolWorker or process may go down."""

from __future__ import annotations

import asyncio
import sys

from actors.engine.tools.builtin_tools import echo
from actors.turn.agent import Agent
from actors.turn.llm import LLMReply, LLMRequest
from actors.turn.tools import ToolRegistry, tool
from bus.messages import Message, ToolCall

__all__ = ["RAISER", "RAISING", "raiser"]


@tool
async def exits(code: int = 3) -> str:
    """Raise SystemExit, as a tool calling sys.exit would.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


@tool
async def interrupts() -> str:
    """Raise KeyboardInterrupt."""
    raise KeyboardInterrupt


@tool
async def raises_base() -> str:
    """Raise a bare BaseException."""
    raise BaseException("bare")


@tool
async def cancels_itself() -> str:
    """Raise CancelledError though nobody cancelled it."""
    raise asyncio.CancelledError


@tool
def exits_in_a_thread() -> str:
    """A sync tool (run in a thread) that calls sys.exit."""
    sys.exit(4)


#: The raising tools, in the order the model calls them (after one good ``echo``).
RAISING = ("exits", "interrupts", "raises_base", "cancels_itself", "exits_in_a_thread")


class RaisingModel:
    """Asks once for a batch of one good call and every raising one, then answers with what
    it read."""

    async def complete(self, request: LLMRequest) -> LLMReply:
        results = [m.tool_result for m in request.messages if m.tool_result is not None]
        if not results:
            calls = (
                ToolCall(id="c0", name="echo", args={"text": "fine"}),
                *(ToolCall(id=f"c{i + 1}", name=n, args={}) for i, n in enumerate(RAISING)),
            )
            return LLMReply(Message(role="assistant", text="calling", tool_calls=calls))
        text = " | ".join(f"{r.name} {r.status}: {r.output}" for r in results)
        return LLMReply(Message(role="assistant", text=text))


raiser = Agent(
    model=lambda _ctx: RaisingModel(),
    tools=ToolRegistry([echo, exits, interrupts, raises_base, cancels_itself, exits_in_a_thread]),
)
"""The agent of the bad-input turns."""

#: Its import path.
RAISER = "actors.harness.bad_tools:raiser"
