"""OpenAI's Responses API through the real ``openai`` SDK against the scripted endpoint's
``/v1/responses`` (background mode kept, as OpenAI does): turns answer with tools, streamed or
polled; a process SIGKILLed while its turns' background responses generate is resumed, and the
resumed turns follow those responses instead of asking again, counted at the endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.agents import load_agent
from actors.engine.cancel import Cancelled, request_cancel
from actors.engine.models.generations import GenerationAsk, generation_id, pack_ask
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.llm import LLMRequest
from actors.turn.settings import LoopSettings
from bus.messages import Message
from bus.outcomes import Outcome
from store.domain.effects import EffectCounters
from store.keys import KeyLayout
from store.records import TurnInput
from tests.support.polling import eventually
from tests.support.processes import spawn_run

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)
STREAMED = "actors.harness.http_agents:http_responses"
POLLED = "actors.harness.http_agents:http_responses_polled"


@pytest.fixture(autouse=True)
def endpoint(openai_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OPENAI_BASE_URL", openai_server)
    return openai_server


def stats_of(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/_stats", timeout=5) as reply:
        return dict(json.loads(reply.read()))


def script(**kw: Any) -> TurnInput:
    spec = {"rounds": 2, "tool": "bump", "quote": False, **kw}
    return TurnInput(message=f"#script {json.dumps(spec)}\nCount, please.")


@pytest.mark.parametrize("agent", [STREAMED, POLLED])
async def test_a_turn_on_the_responses_api_answers_with_its_tools(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str, agent: str
) -> None:
    before = stats_of(endpoint)
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    tid = f"resp-{agent.rsplit('_', 1)[-1]}"
    stats = await engine.run_new(agent, script(), [tid])
    final = await engine.store.load(tid)
    seen = stats_of(endpoint)
    assert stats.outcomes == {"answered": 1}
    assert final.answer == "read 2 tool results"
    calls = [c for m in final.messages for c in m.tool_calls]
    assert [c.name for c in calls] == ["bump", "bump"]
    results = [m.tool_result.output for m in final.messages if m.tool_result is not None]
    assert results == ["count=1", "count=1"]
    c = final.counters
    created = seen.get("responses_created", 0) - before.get("responses_created", 0)
    assert c.model_calls == created == 3 and c.tokens.completion_tokens > 0
    assert c.generations_adopted == 0 and c.generations_repaid == 0
    # each response's id was noted for the turn: the last call's is there
    noted = await real_client.get(keys.response(tid))
    assert noted is not None and b" resp_" in noted


async def test_a_process_killed_mid_generation_is_resumed_onto_its_background_responses(
    redis_url: str, real_client: aioredis.Redis, namespace: str, endpoint: str
) -> None:
    """Each model call takes 3 s at the endpoint. The process running two turns is SIGKILLed
    while both first generations run there; resumed here, each turn follows its response
    (retrieved, not created again): requests for generations = the turns' model calls, each
    turn's first call adopted, every ``bump`` once."""
    keys = KeyLayout(namespace, shards=16)  # the CLI's default shard count
    ids = ["bg-t000000", "bg-t000001"]
    before = stats_of(endpoint)
    turn_input = script(latency_ms=3000, sample=True)
    child = spawn_run(redis_url, namespace, STREAMED, turn_input.message, turns=2, run_id="bg")
    try:

        async def both_generating() -> bool:
            assert child.poll() is None, child.stderr.read() if child.stderr else "exited"
            noted = [await real_client.get(keys.response(t)) for t in ids]
            return all(noted)

        await eventually(both_generating, timeout=60, what="both turns' responses noted")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    created_at_kill = stats_of(endpoint)["responses_created"] - before.get("responses_created", 0)
    assert created_at_kill == 2  # the kill came mid-generation: no answer was read yet
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    stats = await engine.resume_all()
    assert stats.resumed == 2
    seen = stats_of(endpoint)
    created = seen["responses_created"] - before.get("responses_created", 0)
    retrieved = seen.get("responses_retrieved", 0) - before.get("responses_retrieved", 0)
    effects = EffectCounters(real_client, keys)
    calls = 0
    for tid in ids:
        final = await engine.store.load(tid)
        c = final.counters
        assert c.outcome == "answered" and c.resume_attempts == 1, (tid, c)
        assert c.generations_adopted == 1 and c.generations_repaid == 0, (tid, c)
        assert all(n == 1 for n in (await effects.counts(tid)).values()), tid
        assert len(await effects.counts(tid)) == 2, tid
        calls += c.model_calls
        assert final.answer == "read 2 tool results"
        first: Message = next(m for m in final.messages if m.role == "assistant")
        assert first.tool_calls  # the followed reply asked for its call
    assert created == calls == 6, (created, calls)  # 3 each; none asked for twice
    assert retrieved == 2


async def test_a_response_the_provider_no_longer_has_is_asked_for_again_and_counted(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    """The turn's first call finds an id noted for it that the provider does not know (it
    expired there): 404, so the call is asked for again and counted repaid; the turn answers."""
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    first = await engine.run_new(STREAMED, script(), ["gone-ref"])  # what its first call is
    assert first.outcomes == {"answered": 1}
    ref = await engine.store.load("gone-ref")
    request = LLMRequest(
        turn_id="gone",
        messages=ref.messages[: ref.baseline],
        tools_enabled=True,
        attempt=0,
        tools=tuple(load_agent(STREAMED).tools),
    )
    spec = await engine.store.load_spec("gone-ref")
    name = generation_id(pack_ask(GenerationAsk.of(request, spec.input, ref.baseline)))
    await real_client.set(keys.response("gone"), f"{name} resp_expired")
    before = stats_of(endpoint)
    await engine.run_new(STREAMED, script(), ["gone"])
    final = await engine.store.load("gone")
    seen = stats_of(endpoint)
    assert final.counters.outcome == "answered"
    assert final.counters.generations_repaid == 1 and final.counters.generations_adopted == 0
    assert seen["responses_created"] - before["responses_created"] == 3


async def test_a_cancel_ends_the_background_response_at_the_provider(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    """A background response does not stop when its stream is closed: an operator's cancel of
    the turn cancels it at the provider (the endpoint counts the cancel)."""
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    record = await engine.submit(STREAMED, script(latency_ms=30_000), "bg-cancel")
    running = asyncio.ensure_future(
        engine.start(record, await engine.store.load_spec(record.turn_id))
    )
    before = stats_of(endpoint).get("responses_cancelled", 0)

    async def generating() -> bool:
        return await real_client.get(keys.response("bg-cancel")) is not None

    await eventually(generating, timeout=10, what="the turn's first response noted")
    done = await request_cancel(engine.store, engine.inbox, "bg-cancel", "stop", by="ops")
    assert done is Cancelled.REQUESTED and engine.cancel("bg-cancel")
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.outcome == Outcome.CANCELLED

    async def cancelled_there() -> bool:
        return bool(stats_of(endpoint).get("responses_cancelled", 0) - before == 1)

    await eventually(cancelled_there, timeout=10, what="the response cancelled at the endpoint")
