"""Tool worker pools that grow while calls wait and shrink when idle: the pure rule, the
settings, and a pool resized under load on the real Ray runtime."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from actors.cluster.deployment import worker_options
from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings, ToolSettings
from actors.turn.autoscale import PoolLoad, ScaleRule, next_size
from store.domain.pools import PoolSizes
from store.records import TurnInput
from tests.support.polling import eventually

RULE = ScaleRule(min_workers=1, max_workers=4, interval_s=1.0, idle_s=10.0)


def test_a_pool_grows_while_calls_wait_and_shrinks_when_idle() -> None:
    busy, idle = PoolLoad(queued=5, running=8), PoolLoad(queued=0, running=0)
    assert next_size(1, busy, RULE, since_resize_s=2, idle_for_s=0) == 2
    assert next_size(4, busy, RULE, since_resize_s=2, idle_for_s=0) == 4  # at the cap
    assert next_size(2, busy, RULE, since_resize_s=0.5, idle_for_s=0) == 2  # too soon
    running = PoolLoad(queued=0, running=3)
    assert next_size(3, running, RULE, since_resize_s=60, idle_for_s=0) == 3  # in use: kept
    assert next_size(3, idle, RULE, since_resize_s=60, idle_for_s=9) == 3  # not idle long
    assert next_size(3, idle, RULE, since_resize_s=60, idle_for_s=10) == 2
    assert next_size(1, idle, RULE, since_resize_s=60, idle_for_s=99) == 1  # at the floor
    assert next_size(9, idle, RULE, since_resize_s=0, idle_for_s=0) == 4  # out of bounds


def test_pool_bounds_are_checked() -> None:
    assert ToolSettings(workers=2).bounds() == (2, 2)
    assert ToolSettings(workers=1, max_workers=8).bounds() == (1, 8)
    with pytest.raises(ValueError, match="min_workers <= workers <= max_workers"):
        ToolSettings(workers=4, max_workers=2)


@pytest.mark.usefixtures("ray_cluster")
async def test_a_pool_is_resized_under_load_on_ray(
    redis_url: str, namespace: str, real_client: aioredis.Redis
) -> None:
    settings = Settings.model_validate({
        "redis": {"namespace": namespace},
        "tools": {"workers": 1, "min_workers": 1, "max_workers": 3, "scale_interval_s": 0.5,
                  "idle_s": 1.0},
    })  # fmt: skip
    scenario = parse_scenario({"name": "naps", "rounds": 4, "tools": ["sleep"],
                               "llm_latency_ms": 0, "tool_latency_ms": 300})  # fmt: skip
    _, turn_input = scripted_turn(scenario)
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    sizes = PoolSizes(real_client, rt.dep.keys, ttl_s=0)
    try:
        ids = [f"nap{i:02d}" for i in range(40)]  # 40 calls at once, 4 per worker
        await rt.submit("actors.harness.bench.napping:agent", turn_input, ids)

        async def grown() -> int | None:
            size = await sizes.get("default", 1)
            return size if size >= 2 else None

        await eventually(grown, timeout=30, what="the pool to grow")
        finals = await rt.wait(ids, timeout=180)
        assert {str(r.counters.outcome) for r in finals.values()} == {"answered"}

        async def shrunk() -> bool:
            return await sizes.get("default", 0) == 1

        await eventually(shrunk, timeout=30, what="the idle pool to shrink back")

        def retired() -> bool:
            return rt.tool_worker("default", 1) is None

        async def gone() -> bool:
            return retired()

        await eventually(gone, timeout=30, what="the drained worker to be killed")
    finally:
        await rt.shutdown()


def test_worker_options_split_ray_and_custom_resources() -> None:
    assert worker_options({}) == {
        "num_cpus": 0, "num_gpus": 0, "resources": None, "scheduling_strategy": "SPREAD",
    }  # fmt: skip
    opts = worker_options({"num_cpus": 0.5, "GPU": 1, "gpu_box": 1})
    assert (opts["num_cpus"], opts["num_gpus"], opts["resources"]) == (0.5, 1, {"gpu_box": 1})


@pytest.mark.usefixtures("ray_cluster")
async def test_a_tool_with_ray_resources_runs_on_its_own_pool(
    redis_url: str, namespace: str
) -> None:
    agent = "tests.support.agents:heavy"
    settings = Settings.model_validate({"redis": {"namespace": namespace}, "tools": {"workers": 1}})
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1, agents=[agent])
    try:
        assert set(rt.dep.tool_pools()) == {"default", "num_cpus=0.5"}
        work = TurnInput(message="go", context={"calls": [["add_heavy", {"a": 2, "b": 3}]],
                                                "quote": True})  # fmt: skip
        await rt.submit(agent, work, ["heavy1"])
        final = (await rt.wait(["heavy1"], timeout=120))["heavy1"]
        assert final.answer == "ok: 5"
        worker = rt.tool_worker("num_cpus=0.5", 0)
        assert worker is not None
        assert (await worker.hello()).counts["calls"] == 1
    finally:
        await rt.shutdown()
