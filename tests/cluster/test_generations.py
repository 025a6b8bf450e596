"""Generations on Ray whose model workers are SIGKILLed mid-generation: with Chat Completions
each lost generation is asked again and counted repaid; with background responses the
endpoint kept, the restarted workers follow them. Requests are counted at the model endpoint
(the scripted OpenAI-compatible server), from outside the runtime. Every TurnActor SIGKILLed
mid-generation is tests/cluster/test_generations_llama.py's, against llama.cpp's server."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.cluster.refs import ModelWorkerRef
from actors.cluster.runtime import Runtime
from actors.engine.settings.config import Settings
from store.records import CheckpointRecord, TurnInput
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")

AGENT = "tests.support.agents:http_bump"
RESPONSES = "actors.harness.http_agents:http_responses"
#: Every answer of the endpoint takes 1 s: generations a kill can land in (each test kills
#: once every turn's first request is at the endpoint, none answered).
SCRIPT = {"rounds": 2, "tool": "bump", "latency_ms": 1000, "quote": False}


def _stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/_stats", timeout=5) as reply:
        return dict(json.loads(reply.read()))


def generation_settings(namespace: str) -> Settings:
    """A deployment whose model calls run on 2 model workers, its saves not debounced and its
    hosts pinged often (a killed host is replaced within a second or two)."""
    return Settings.model_validate(
        {
            "redis": {"namespace": namespace},
            "checkpoint": {"min_interval_s": 0},
            "supervisor": {"ping_interval_s": 0.2, "ping_timeout_s": 2.0},
            "models": {"remote": True, "workers": 2},
        }
    )


async def _asked(base_url: str, before: int, n: int) -> None:
    """Wait until the endpoint has received ``n`` requests since ``before`` (with 2 s to
    answer each, none is answered yet)."""

    async def asked() -> bool:
        return bool(_stats(base_url)["requests"] - before >= n)

    await eventually(asked, timeout=60, what=f"{n} model calls at the endpoint")


def _calls(finals: dict[str, CheckpointRecord]) -> int:
    return sum(f.counters.model_calls for f in finals.values())


async def test_a_model_worker_killed_mid_generation_is_asked_again_and_counted(
    redis_url: str, namespace: str, openai_server: str
) -> None:
    turn_input = TurnInput(message=f"#script {json.dumps(SCRIPT)}\nCount, please.")
    rt = await Runtime.start(generation_settings(namespace), redis_url=redis_url, hosts=2)
    try:
        before = _stats(openai_server)["requests"]
        ids = [f"mw{i:02d}" for i in range(8)]
        await rt.submit(AGENT, turn_input, ids)
        await _asked(openai_server, before, len(ids))
        for i in range(rt.dep.settings.models.workers):  # every generation in flight is lost
            worker = ModelWorkerRef.named(rt.dep.model_worker_name(i))
            assert worker is not None
            os.kill((await worker.hello()).pid, signal.SIGKILL)
        finals = await rt.wait(ids, timeout=180)
    finally:
        await rt.shutdown()
    asked = _stats(openai_server)["requests"] - before
    assert all(f.counters.outcome == "answered" for f in finals.values()), finals
    repaid = sum(f.counters.generations_repaid for f in finals.values())
    assert repaid >= len(ids)
    assert asked == _calls(finals) + repaid, (asked, _calls(finals), repaid)


async def test_model_workers_killed_mid_response_follow_the_responses_the_endpoint_kept(
    redis_url: str, namespace: str, openai_server: str, real_client: aioredis.Redis
) -> None:
    """The same kill with the agent on OpenAI's Responses API (background responses, kept by
    the endpoint): the restarted workers follow the responses noted for each call instead of
    asking again, so nothing is repaid and responses created = model calls."""
    turn_input = TurnInput(message=f"#script {json.dumps(SCRIPT)}\nCount, please.")
    rt = await Runtime.start(generation_settings(namespace), redis_url=redis_url, hosts=2)
    try:
        before = _stats(openai_server).get("responses_created", 0)
        ids = [f"rw{i:02d}" for i in range(8)]
        await rt.submit(RESPONSES, turn_input, ids)

        async def noted() -> bool:  # each turn's first response generating, its id noted
            return all([await real_client.get(rt.dep.keys.response(t)) for t in ids])

        await eventually(noted, timeout=60, what="every turn's response noted")
        for i in range(rt.dep.settings.models.workers):
            worker = ModelWorkerRef.named(rt.dep.model_worker_name(i))
            assert worker is not None
            os.kill((await worker.hello()).pid, signal.SIGKILL)
        finals = await rt.wait(ids, timeout=180)
    finally:
        await rt.shutdown()
    created = _stats(openai_server)["responses_created"] - before
    assert all(f.counters.outcome == "answered" for f in finals.values()), finals
    assert sum(f.counters.generations_repaid for f in finals.values()) == 0
    assert sum(f.counters.generations_adopted for f in finals.values()) >= len(ids)
    assert created == _calls(finals), (created, _calls(finals))
