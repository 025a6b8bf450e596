"""Agents on the HTTP model path, for the scripted endpoint (:mod:`actors.harness.model_endpoint`)
or any OpenAI-compatible one ``OPENAI_BASE_URL`` names: what the chaos runs on that path and the
model benchmarks run, by import path (``actors.harness.http_agents:http_bump``)."""

from __future__ import annotations

import dataclasses

from actors.engine.models.openai_chat import OpenAIChat
from actors.engine.models.openai_responses import OpenAIResponses
from actors.turn.agent import Agent
from actors.turn.llm import ModelLimits
from actors.turn.tools import ToolContext, ToolRegistry, tool

__all__ = [
    "TEST_KEY_ENV",
    "add",
    "bump",
    "http_agent",
    "http_bump",
    "http_json",
    "http_limited_bench",
    "http_responses",
    "http_responses_polled",
    "http_stream",
]

#: The environment variable the HTTP agents read their API key from (a local endpoint needs
#: none; the scripted one records what it was sent).
TEST_KEY_ENV = "PHASELINE_TEST_OPENAI_KEY"


@tool(idempotent=True)
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


@tool(idempotent=False)
async def bump(ctx: ToolContext, a: int, b: int = 0) -> str:
    """Count this call's side effect once per run of it (a duplicate shows as a count of 2).

    Args:
        a: Ignored.
        b: Ignored.
    """
    if ctx.effects is None:
        raise RuntimeError("bump needs a side-effect store")
    return f"count={await ctx.effects.increment(ctx.turn_id, ctx.call_key)}"


#: Streams its replies; adds numbers with ``add``.
http_stream = Agent(
    model=OpenAIChat(model="test-model", api_key_env=TEST_KEY_ENV, timeout_s=20),
    tools=ToolRegistry([add]),
    system_prompt="You add numbers with the add tool.",
    model_name="test-model",
)
#: The same, each reply one JSON answer.
http_json = dataclasses.replace(
    http_stream, model=OpenAIChat(model="test-model", api_key_env=TEST_KEY_ENV, stream=False)
)
#: Calls ``bump``, not idempotent: a duplicate run shows in its counter, counted from outside.
http_bump = dataclasses.replace(http_stream, tools=ToolRegistry([add, bump]))
#: :data:`http_bump` on OpenAI's Responses API, background responses followed after a crash.
http_responses = dataclasses.replace(
    http_bump,
    model=OpenAIResponses(model="test-model", api_key_env=TEST_KEY_ENV, timeout_s=20),
)
#: The same without streaming: a background response polled until it ends.
http_responses_polled = dataclasses.replace(
    http_responses,
    model=OpenAIResponses(model="test-model", api_key_env=TEST_KEY_ENV, stream=False),
)


def http_agent(model: str, **kw: object) -> Agent:
    """``http_stream`` on a model name of its own: what an endpoint is remembered by (e.g. that
    it cannot stream tool calls) stays with that name, away from the other agents."""
    chat = OpenAIChat(model=model, api_key_env=TEST_KEY_ENV, timeout_s=20, **kw)  # type: ignore[arg-type]
    return dataclasses.replace(http_stream, model=chat, model_name=model)


#: The limit of scripts/rate_limit_bench.py's endpoint, declared: 600 a minute, 100 at once.
http_limited_bench = http_agent(
    "limited-bench", stream=False, limits=ModelLimits(requests_per_minute=600, burst=100)
)
