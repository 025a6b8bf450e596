"""An HTTP agent on the Ray runtime: the OpenAI-compatible client and a Python tool with a side
effect, in TurnActors and ToolWorkers that are SIGKILLed mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.cluster.runtime import Runtime
from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.events import Finished, Restarted, ToolReturned, WatchEvent
from store.domain.effects import EffectCounters
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnInput
from tests.support.agents import unencodable_input
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")

AGENT = "tests.support.agents:http_bump"
LIMITED = "tests.support.agents:http_limited"
SCRIPT = {"rounds": 4, "tool": "bump", "latency_ms": 150}


async def collect(events: AsyncIterator[WatchEvent]) -> list[WatchEvent]:
    return [e async for e in events]


def texts(record: CheckpointRecord) -> list[tuple[str, str, tuple[Any, ...], str]]:
    return [
        (m.role, m.text, tuple((c.id, c.name, c.args) for c in m.tool_calls),
         m.tool_result.output if m.tool_result else "")
        for m in record.messages
    ]  # fmt: skip


async def test_http_turns_survive_killed_hosts_and_tool_workers(
    redis_url: str, namespace: str, real_client: aioredis.Redis
) -> None:
    turn_input = TurnInput(message=f"#script {json.dumps(SCRIPT)}\nCount, please.")
    reference = TurnEngine(
        real_client,
        KeyLayout(f"{namespace}r", 4),
        EngineSettings(watchdog=None, loop=LoopSettings(checkpoint_min_interval_s=0)),
    )
    await reference.run_new(AGENT, turn_input, ["ref"])
    expected = texts(await reference.store.load("ref"))

    settings = Settings.model_validate({
        "redis": {"namespace": namespace},
        "checkpoint": {"min_interval_s": 0},
        "supervisor": {"ping_interval_s": 0.2, "ping_timeout_s": 2.0},
    })  # fmt: skip
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=2)
    try:
        ids = [f"http{i:02d}" for i in range(16)]
        assert await rt.submit(AGENT, turn_input, ids) == ids

        async def moving() -> bool:
            tools = 0
            async for _ in real_client.scan_iter(f"{namespace}:*:tools:*"):
                tools += 1
            return tools >= 8

        await eventually(moving, timeout=60, what="tool calls under way")
        slot = rt.dep.slot_of(ids[0])
        early = [
            tid
            for tid in ids
            if rt.dep.slot_of(tid) == slot
            and (r := await rt.store.load(tid)).in_progress
            and r.counters.tool_batches <= 1
        ]
        assert early, "no turn of the victim's slot is early in its run"
        watcher = asyncio.ensure_future(collect(rt.watch(early[0])))
        await rt.kill_host(slot)
        worker = rt.tool_worker("default", 0)
        assert worker is not None
        os.kill((await worker.hello()).pid, signal.SIGKILL)
        finals = await rt.wait(ids, timeout=180)
        seen = await asyncio.wait_for(watcher, 60)
    finally:
        await rt.shutdown()
    # The watcher, attached before the kill, saw the turn resumed by a new owner and finish.
    restarts = [e for e in seen if isinstance(e, Restarted)]
    assert restarts and all(r.epoch > 1 for r in restarts)
    assert isinstance(seen[-1], Finished) and seen[-1].outcome == "answered"
    assert seen[-1].answer == finals[early[0]].answer
    after = seen[seen.index(restarts[-1]) :]
    assert any(isinstance(e, ToolReturned) for e in after)
    effects = EffectCounters(real_client, rt.dep.keys)
    unknown = 0
    for tid, final in finals.items():
        assert final.counters.outcome == "answered", tid
        got = texts(final)
        assert len(got) == len(expected), tid
        # The fault-free turn, message for message, but for a call caught in flight by a kill:
        # it is reported outcome_unknown (never re-run), and the answer quotes that.
        for (role, text, calls, output), want in zip(got[2:-1], expected[2:-1], strict=True):
            if output != want[3]:
                assert role == "tool" and "will not be re-run" in output, (tid, output)
                unknown += 1
            else:
                assert (role, text, calls) == want[:3], tid
        assert all(n == 1 for n in (await effects.counts(tid)).values()), tid  # never twice


def _limit(base_url: str, **spec: Any) -> dict[str, Any]:
    """Set the test endpoint's limit (none: lift it)."""
    url = base_url.removesuffix("/v1") + "/_limit"
    req = urllib.request.Request(url, json.dumps(spec).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as reply:
        return dict(json.loads(reply.read()))


def _stats(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/_stats", timeout=5) as reply:
        return dict(json.loads(reply.read()))


async def test_two_hosts_keep_to_one_declared_limit(
    redis_url: str, namespace: str, openai_server: str
) -> None:
    """20 turns on 2 hosts against an endpoint limited to 600 requests a minute, 5 at once, by
    an agent that declares it: both hosts admit their calls through the one limiter in Redis,
    so the endpoint refuses at most 10 % of what it accepts, and every turn answers."""
    _limit(openai_server, rpm=600, burst=5, headers=True)
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=2)
    try:
        ids = [f"lim{i:02d}" for i in range(20)]
        script = {"rounds": 2, "tool": "add", "quote": False}
        await rt.submit(LIMITED, TurnInput(message=f"#script {json.dumps(script)}\nAdd."), ids)
        finals = await rt.wait(ids, timeout=180)
        assert {rt.dep.slot_of(t) for t in ids} == {0, 1}  # both hosts had turns
    finally:
        await rt.shutdown()
        seen = _stats(openai_server)
        _limit(openai_server)
    assert {f.counters.outcome for f in finals.values()} == {"answered"}
    assert seen["accepted"] >= 60 and seen["refused"] <= 0.1 * seen["accepted"], seen


async def test_text_utf8_cannot_hold_is_made_storable_on_ray(
    redis_url: str, namespace: str
) -> None:
    """Before text was made storable, one such turn on Ray made 3,959 model requests in a
    minute. Here it answers, with U+FFFD where the input, the tool and the model had lone
    surrogates."""
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    try:
        await rt.submit("tests.support.agents:http_files", unencodable_input(), ["sur"])
        (final,) = (await rt.wait(["sur"], timeout=120)).values()
    finally:
        await rt.shutdown()
    assert final.counters.outcome == "answered" and final.epoch == 1, final.counters.last_error
    assert final.answer == "done \ufffd"
    assert [m.tool_result.output for m in final.messages if m.tool_result] == ["report-\ufffd.txt"]
