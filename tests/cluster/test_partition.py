"""A host cut off from Redis while Ray still reaches it: replaced, and what it sent during the
partition refused by the fence when its link comes back, counted by Redis itself."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from actors.cluster.deployment import HostRoute
from actors.cluster.runtime import Runtime
from actors.engine.models.scripted import scripted_turn
from actors.harness.links import via_port
from actors.harness.tcp_proxy import ProxyLoop, TcpProxy
from store.domain.effects import EffectCounters
from store.domain.usage import fenced_writes
from tests.cluster.test_ray_runtime import checkpoints_written, scenario, settings
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")


async def test_a_host_cut_off_from_redis_is_replaced_and_its_held_writes_are_fenced(
    redis_url: str, namespace: str, real_client: aioredis.Redis
) -> None:
    loop = ProxyLoop()
    upstream = urlsplit(redis_url)
    link = TcpProxy(loop, (upstream.hostname or "127.0.0.1", upstream.port or 6379))
    cfg = settings(namespace, supervisor={"lease_ttl_s": 1.0, "cut_off_s": 2.0})
    # Slot 0's first generation behind the link; its successor on another machine.
    routes = [(HostRoute(redis_url=via_port(redis_url, link.port)), HostRoute()), ()]
    rt = await Runtime.start(cfg, redis_url=redis_url, hosts=2, host_routes=routes)
    try:
        sc = scenario(tools=["counter_increment"], rounds=8)
        ids = [f"cut{i:02d}" for i in range(16)]
        await rt.submit(*scripted_turn(sc), ids)
        await checkpoints_written(real_client, rt.dep.keys, 16 + 16)
        cut = [t for t in await rt.store.list_in_progress() if rt.dep.slot_of(t) == 0]
        assert cut
        link.cut()

        async def moved() -> bool:
            # replaced, and the successor holds every turn the cut-off host had in progress
            if await rt.respawns() < 1:
                return False
            records = [await rt.store.load(t) for t in cut]
            return all(r.epoch >= 2 or not r.in_progress for r in records)

        try:
            await eventually(moved, timeout=60, what="the cut-off host's turns moved")
            # The other host never lost its link: it was not replaced.
            assert (await rt.hosts.generations()).get(1) == 0
        finally:
            link.restore()  # what the cut-off host sent arrives now, after its successor's claims
        finals = await rt.wait(ids, timeout=180)
        assert all(not f.in_progress for f in finals.values())
        effects = EffectCounters(real_client, rt.dep.keys)
        for t in ids:  # each call's side effect at most once, counted in Redis
            counts = await effects.counts(t)
            assert counts and max(counts.values()) == 1, (t, counts)

        async def refused() -> int:
            return sum((await fenced_writes(real_client, rt.dep.keys)).values())

        assert await eventually(refused, timeout=30, what="the held writes refused and counted")
    finally:
        await rt.shutdown()
        link.close()
        loop.close()
