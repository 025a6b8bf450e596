"""The chaos harness's links to the world outside: a TCP proxy that a partition cuts (held, not
refused, then let through) in front of the real Redis, and the provider fault proxy in front of
the tests' OpenAI-compatible endpoint, driven through the real ``openai`` SDK."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from urllib.parse import urlsplit

import openai
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from actors.harness.links import Links, outside_links
from actors.harness.provider_proxy import Latency, ProviderFault, ProviderProxy
from actors.harness.targets import ChaosTarget
from actors.harness.tcp_proxy import ProxyLoop, TcpProxy
from tests.support.polling import wait_until

SCRIPT = '#script {"rounds": 0, "say": "fine"}\nhello'


@pytest.fixture
def loop() -> Iterator[ProxyLoop]:
    proxies = ProxyLoop()
    yield proxies
    proxies.close()


def through(url: str, port: int, timeout: float) -> redis.Redis:
    parts = urlsplit(url)
    return redis.Redis(
        host="127.0.0.1", port=port, password=parts.password, socket_timeout=timeout,
        socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
    )  # fmt: skip


def test_a_cut_link_holds_bytes_both_ways_and_lets_them_through_once_restored(
    loop: ProxyLoop, redis_url: str
) -> None:
    parts = urlsplit(redis_url)
    assert parts.hostname and parts.port
    link = TcpProxy(loop, (parts.hostname, parts.port))
    client = through(redis_url, link.port, timeout=0.5)
    assert client.ping()
    link.cut()
    with pytest.raises(redis.TimeoutError):  # silence, not a refusal
        client.ping()
    fresh = through(redis_url, link.port, timeout=0.5)
    with pytest.raises(redis.TimeoutError):  # a new connection is held too
        fresh.ping()
    assert link.held_connections == 1
    link.restore()
    patient = through(redis_url, link.port, timeout=5)
    assert patient.set("partition-test", "after") and patient.get("partition-test") == b"after"
    link.refuse()
    with pytest.raises(redis.ConnectionError):
        through(redis_url, link.port, timeout=5).ping()
    link.close()


def sdk(base_url: str, timeout: float = 10) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=timeout)


def ask(client: openai.OpenAI, *, stream: bool = False) -> str:
    messages = [{"role": "user", "content": SCRIPT}]
    if not stream:
        reply = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_provider_proxy_forwards_then_brings_each_fault_as_a_provider_does(
    loop: ProxyLoop, openai_server: str
) -> None:
    proxy = ProviderProxy(loop, openai_server, latency=Latency(median_ms=20), seed=3)
    client = sdk(proxy.base_url)
    assert ask(client) == "fine" and ask(client, stream=True) == "fine"
    # Counted once the upstream connection ends, which may be after the client has its answer.
    wait_until(lambda: proxy.forwarded == 2, timeout=10, what="both requests counted forwarded")

    proxy.storm(ProviderFault.RATE_LIMIT, 5)
    with pytest.raises(openai.RateLimitError) as limited:
        ask(client)
    assert limited.value.code == "rate_limit_exceeded"
    assert 1 <= int(limited.value.response.headers["retry-after-ms"]) <= 5000

    proxy.storm(ProviderFault.OVERLOADED, 5)
    with pytest.raises(openai.APIStatusError) as overloaded:
        ask(client)
    assert overloaded.value.status_code == 529
    assert json.loads(overloaded.value.response.text)["error"]["type"] == "overloaded_error"

    proxy.storm(ProviderFault.SERVER_ERROR, 5)
    with pytest.raises(openai.InternalServerError) as failed:
        ask(client)
    assert failed.value.status_code in (500, 502, 503)

    proxy.storm(ProviderFault.DROP, 5)
    with pytest.raises(openai.APIConnectionError):  # cut mid-reply
        ask(client, stream=True)

    proxy.storm(ProviderFault.HANG, 5)
    with pytest.raises(openai.APITimeoutError):
        ask(sdk(proxy.base_url, timeout=0.5))

    proxy.storm(ProviderFault.DEAD, 5)
    with pytest.raises(openai.APIConnectionError):
        ask(client)

    proxy.calm()
    assert ask(client) == "fine"
    assert {f: proxy.landed[f] for f in ProviderFault} == {f: 1 for f in ProviderFault}
    proxy.close()


def test_a_runs_links_route_each_host_through_its_own_proxies(
    openai_server: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", openai_server)
    targets = (ChaosTarget.PROVIDER, ChaosTarget.PARTITION)
    with outside_links(targets, redis_url=redis_url, slots=3, http=True, seed=1) as links:
        assert isinstance(links, Links) and links.provider is not None
        routes = [r for slot in links.routes(3) for r in slot]  # two machines per slot
        assert os.environ["OPENAI_BASE_URL"] == links.provider.base_url
        ports = {urlsplit(r.redis_url or "").port for r in routes}
        assert len(ports) == 6 and urlsplit(redis_url).port not in ports
        machines = [m for slot in links.hosts for m in slot]
        for route, host in zip(routes, machines, strict=True):
            assert host.model is not None
            assert route.env["OPENAI_BASE_URL"] == f"http://{host.model.address}/v1"
            assert ask(sdk(route.env["OPENAI_BASE_URL"])) == "fine"  # host -> provider -> model
            assert through(route.redis_url or "", host.redis.port, timeout=5).ping()
        # A slot's generations take its machines in turn: a successor is on the other one.
        assert links.of(0, 0) is links.of(0, 2) is machines[0] and links.of(0, 1) is machines[1]
        links.of(0, 0).model.cut()  # type: ignore[union-attr]
        with pytest.raises(openai.APITimeoutError):  # one host cut off; the others are not
            ask(sdk(routes[0].env["OPENAI_BASE_URL"], timeout=0.5))
        assert ask(sdk(routes[1].env["OPENAI_BASE_URL"])) == "fine"
        assert ask(sdk(routes[2].env["OPENAI_BASE_URL"])) == "fine"
    assert os.environ["OPENAI_BASE_URL"] == openai_server
