"""The views beside a Ray deployment: the console attached to it (its hosts, its turns live), and
the traces its hosts export, one per turn, linked across a host SIGKILLed mid-turn."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from ray.cluster_utils import Cluster

from actors.cluster.runtime import Runtime
from actors.engine.models.scripted import scripted_turn
from actors.engine.telemetry import incarnation_span_id, turn_trace_id
from tests.cluster.test_ray_runtime import checkpoints_written, scenario, settings
from tests.support.console_server import serving
from tests.support.otlp_receiver import Receiver, receiving
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


@pytest.fixture
async def runtime(redis_url: str, namespace: str, receiver: Receiver) -> AsyncIterator[Runtime]:
    traced = {"endpoint": receiver.url, "export_delay_ms": 50}
    rt = await Runtime.start(settings(namespace, telemetry=traced), redis_url=redis_url, hosts=2)
    try:
        yield rt
    finally:
        await rt.shutdown()


def _read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return str(reply.read().decode())


async def test_the_console_beside_a_deployment_shows_its_hosts_and_turns(
    runtime: Runtime, redis_url: str, namespace: str, ray_cluster: Cluster
) -> None:
    ids = ["view-1", "view-2"]
    await runtime.submit(*scripted_turn(scenario(rounds=2)), ids)
    await runtime.wait(ids, timeout=120)
    with serving(redis_url, namespace, ray_address=ray_cluster.address) as url:
        deployment = await asyncio.to_thread(_read, f"{url}/deployment")
        turns = await asyncio.to_thread(_read, f"{url}/turns")
        turn = await asyncio.to_thread(_read, f"{url}/turns/view-1")
    assert "attached to its deployment" in deployment
    assert "<td>host0</td>" in deployment and "<td>host1</td>" in deployment
    assert "checkpoints/s" in deployment
    assert "view-1" in turns and "view-2" in turns
    assert "finished: answered" in turn


async def test_a_host_killed_mid_turn_leaves_one_trace_per_turn_linked_across_the_kill(
    runtime: Runtime, real_client: aioredis.Redis, receiver: Receiver
) -> None:
    ids = [f"trace-{i}" for i in range(6)]
    await runtime.submit(*scripted_turn(scenario(rounds=4, llm_latency_ms=600)), ids)
    await checkpoints_written(real_client, runtime.dep.keys, len(ids))
    victim = next(t for t in ids if runtime.dep.slot_of(t) == 0)
    first = incarnation_span_id(victim, 1)

    async def first_calls_exported() -> bool:
        return any(s.parent_id == first for s in receiver.spans())

    await eventually(first_calls_exported, timeout=30, what="calls of the first incarnation")
    await runtime.kill_host(0, signal.SIGKILL)
    finals = await runtime.wait(ids, timeout=180)
    assert finals[victim].epoch >= 2 and not finals[victim].in_progress

    async def resumed_span() -> bool:
        wanted = incarnation_span_id(victim, finals[victim].epoch)
        return any(s.span_id == wanted for s in receiver.spans())

    await eventually(resumed_span, timeout=30, what="the resumed incarnation's span")
    spans = [s for s in receiver.spans() if s.trace_id == turn_trace_id(victim)]
    (last,) = [s for s in spans if s.span_id == incarnation_span_id(victim, finals[victim].epoch)]
    assert last.links == (incarnation_span_id(victim, finals[victim].epoch - 1),)
    assert last.attributes["phaseline.outcome"] == "answered"
    assert any(s.parent_id == first for s in spans)  # calls exported before the kill
    assert any(s.parent_id == last.span_id and s.name.startswith("chat ") for s in spans)
    assert os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") is None  # from [telemetry] alone
