"""Generations that outlive their host against llama.cpp's own C++ server (``llama-server``,
serving requests concurrently): 40 turns on 2 Ray hosts whose generations take seconds, every
TurnActor SIGKILLed while they stream, and in another run every ModelWorker. Requests are
counted by a pass-through proxy in front of the server and tokens by the server itself
(``/metrics``), both outside the runtime."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from actors.cluster.deployment import HostRoute
from actors.cluster.refs import ModelWorkerRef
from actors.cluster.runtime import Runtime
from actors.engine.models import local_model
from actors.harness.provider_proxy import ProviderProxy
from actors.harness.tcp_proxy import ProxyLoop
from bus.events import Restarted, TextDelta, WatchEvent
from bus.outcomes import Outcome
from store.records import CheckpointRecord, TurnInput
from tests.cluster.test_generations import generation_settings
from tests.conftest import _free_port, _wait_until_listening
from tests.support.polling import eventually, wait_until

pytestmark = pytest.mark.usefixtures("ray_cluster")

AGENT = "tests.support.agents:llama_writer"
#: How a turn of it ends: answered, or cut at its ``max_tokens`` (SmolLM2 rarely stops first).
ANSWERS = {Outcome.ANSWERED, Outcome.TRUNCATED}
TURNS = 40


@pytest.fixture(scope="module")
def cpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server with 8 slots (``scripts/build_llama_server`` built it; bootstrap does)."""
    assert local_model.cpp_server() is not None, (
        "llama-server is not built: scripts/build_llama_server"
    )
    port = _free_port()
    log = tmp_path_factory.mktemp("llama-cpp") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            local_model.cpp_command(port, parallel=8, n_ctx=8 * 1024),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    _wait_until_listening(proc, f"{base}/health", "llama-server")
    wait_until(lambda: _healthy(base), timeout=120, what="llama-server to load its model")
    yield f"{base}/v1"
    proc.terminate()
    proc.wait(timeout=10)


def _healthy(base: str) -> bool:
    """The server answers 200 on /health (503 while it loads the model)."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:  # HTTPError (503) included
        return False


def _predicted(base_url: str) -> int:
    """Tokens the server generated so far (its own count)."""
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r"^llamacpp:tokens_predicted_total (\d+)", text, re.M)
    assert found, text
    return int(found[1])


async def _run(
    redis_url: str, namespace: str, proxy: ProviderProxy, prefix: str, *, kill: str
) -> tuple[dict[str, CheckpointRecord], list[WatchEvent], str]:
    """Submit the turns, kill (``hosts`` or ``workers``) once 8 generations stream, wait."""
    route = HostRoute(env={"PHASELINE_LLAMA_CPP_URL": proxy.base_url})
    rt = await Runtime.start(
        generation_settings(namespace), redis_url=redis_url, hosts=2, model_route=route
    )
    seen: list[WatchEvent] = []
    watched = ""
    try:
        await rt.standbys()
        ids = [f"{prefix}{i:02d}" for i in range(TURNS)]
        await rt.submit(AGENT, TurnInput(message="Tell me a story about a lighthouse."), ids)

        async def streaming() -> bool:
            texts = 0
            for tid in ids[:8]:
                texts += await rt.client.xlen(rt.dep.keys.live(tid)) > 2
            return texts >= 4

        await eventually(streaming, timeout=120, what="generations streaming")

        # A turn whose generation streams now (its text in its live stream, not finished).
        watched = ""
        for tid in ids:
            record = await rt.store.load(tid)
            if record.in_progress and await rt.client.xlen(rt.dep.keys.live(tid)) > 2:
                watched = tid
                break
        assert watched, "no generation is streaming"

        async def watch() -> None:
            async for event in rt.watch(watched):
                seen.append(event)

        watcher = asyncio.ensure_future(watch())
        if kill == "hosts":
            for slot in range(rt.dep.hosts):
                await rt.kill_host(slot)
        else:
            for i in range(rt.dep.settings.models.workers):
                worker = ModelWorkerRef.named(rt.dep.model_worker_name(i))
                assert worker is not None
                os.kill((await worker.hello()).pid, signal.SIGKILL)
        finals = await rt.wait(ids, timeout=400)
        await asyncio.wait_for(watcher, 60)
    finally:
        await rt.shutdown()
    return finals, seen, watched


async def test_hosts_killed_mid_generation_on_llama_server_repay_nothing(
    cpp_server: str, redis_url: str, namespace: str
) -> None:
    loop = ProxyLoop()
    try:
        proxy = ProviderProxy(loop, cpp_server)
        tokens_before = _predicted(cpp_server)
        finals, seen, watched = await _run(redis_url, namespace, proxy, "lh", kill="hosts")
        calls = sum(f.counters.model_calls for f in finals.values())
        ends = {t: (f.counters.outcome, f.counters.last_error) for t, f in finals.items()}
        assert all(f.counters.outcome in ANSWERS for f in finals.values()), ends
        assert sum(f.counters.generations_adopted for f in finals.values()) >= 1
        assert sum(f.counters.generations_repaid for f in finals.values()) == 0
        # Requests at the server = model calls in the transcripts: none asked twice.
        assert proxy.upstream == proxy.forwarded == calls == TURNS, (proxy.upstream, calls)
        # Tokens counted once: the server's own count, the turns' sum.
        completion = sum(f.counters.tokens.completion_tokens for f in finals.values())
        adopted = sum(f.counters.generations_adopted for f in finals.values())
        print(f"hosts killed: {calls} calls, {proxy.upstream} requests, {adopted} adopted, "
              f"{completion} tokens")  # fmt: skip
        assert _predicted(cpp_server) - tokens_before == completion
        # The watcher saw the restart and the generation go on, each piece of text once.
        assert any(isinstance(e, Restarted) for e in seen)
        streamed = "".join(e.text for e in seen if isinstance(e, TextDelta))
        answer = "".join(m.text for m in finals[watched].messages if m.role == "assistant")
        assert streamed == answer
    finally:
        loop.close()


async def test_model_workers_killed_mid_generation_on_llama_server_ask_once_more(
    cpp_server: str, redis_url: str, namespace: str
) -> None:
    loop = ProxyLoop()
    try:
        proxy = ProviderProxy(loop, cpp_server)
        finals, _, _ = await _run(redis_url, namespace, proxy, "lw", kill="workers")
        calls = sum(f.counters.model_calls for f in finals.values())
        repaid = sum(f.counters.generations_repaid for f in finals.values())
        assert all(f.counters.outcome in ANSWERS for f in finals.values())
        assert repaid >= 1
        # Each generation lost with its worker was asked for again: one request more than the
        # transcripts' calls each (a call sent to a worker already dead reached no server,
        # and is counted repaid too).
        print(f"workers killed: {calls} calls, {proxy.upstream} requests, {repaid} repaid")
        assert calls < proxy.upstream <= calls + repaid, (proxy.upstream, calls, repaid)
    finally:
        loop.close()
