"""The scaling model: sizes grow with the load they carry, the single-threaded parts are the
ceilings, and the prediction names what limits a CPU-bound deployment."""

from __future__ import annotations

import dataclasses

import pytest

from actors.harness.bench.scaling_model import (
    Hardware,
    UnitCosts,
    Workload,
    predict_rounds_per_s,
    size,
)

COSTS = UnitCosts(
    host_cpu_ms=4.0,
    checkpoint_cpu_ms_per_save=0.5,
    redis_cpu_ms=0.25,
    tool_cpu_ms_per_call=1.0,
    other_cpu_ms=1.0,
    saves_per_round=1.0,
    calls_per_round=2.0,
    host_bytes_per_turn=50_000,
    redis_bytes_per_turn=10_000,
)


def test_a_small_deployment_needs_one_of_each() -> None:
    s = size(COSTS, Workload(turns=100, round_s=5.0))
    assert (s.hosts, s.checkpoint_actors, s.redis_shards, s.nodes) == (1, 1, 1, 1)
    assert s.rounds_per_s == 20.0 and s.saves_per_s == 20.0


def test_each_part_is_sized_from_its_own_cost() -> None:
    # 100,000 turns, a round every 5 s: 20,000 rounds/s.
    s = size(COSTS, Workload(turns=100_000, round_s=5.0), Hardware(headroom=1.0))
    assert s.hosts == 80  # 20,000 x 4 ms = 80 cores of host loops
    assert s.checkpoint_actors == 10  # 20,000 saves x 0.5 ms
    assert s.redis_shards == 5  # 20,000 x 0.25 ms
    # one CheckpointActor: 1 core / 0.5 ms per round x 5 s = 10,000 turns; Redis: 20,000
    assert s.turns_per_checkpoint_actor == 10_000 and s.turns_per_redis_shard == 20_000
    assert s.bottleneck == "the CheckpointActor"
    # cores: hosts 80 + checkpoint 10 + tools 40 + other 20 = 150 over 16-core nodes
    assert s.nodes == 10


def test_redis_memory_can_set_the_shard_count() -> None:
    fat = dataclasses.replace(COSTS, redis_bytes_per_turn=1_000_000)
    s = size(fat, Workload(turns=100_000, round_s=60.0), Hardware(redis_memory_gib=25.0))
    assert s.redis_shards == 6  # 100 GB over 25 GiB x 0.7
    assert s.bottleneck == "Redis"


def test_the_prediction_names_what_limits_a_cpu_bound_run() -> None:
    rounds, what = predict_rounds_per_s(COSTS, cores=2, hosts=1)
    assert what == "the hosts" and rounds == pytest.approx(250.0)  # one loop at 4 ms a round
    rounds, what = predict_rounds_per_s(COSTS, cores=2, hosts=4)
    assert what == "all cores" and rounds == pytest.approx(2000 / COSTS.cpu_ms_per_round)
    cheap_hosts = dataclasses.replace(COSTS, host_cpu_ms=0.1, tool_cpu_ms_per_call=0.0,
                                      other_cpu_ms=0.0)  # fmt: skip
    rounds, what = predict_rounds_per_s(cheap_hosts, cores=64, hosts=64)
    assert what == "the CheckpointActor" and rounds == pytest.approx(2000.0)
    rounds, what = predict_rounds_per_s(cheap_hosts, cores=64, hosts=64, checkpoint_actors=4)
    assert what == "Redis" and rounds == pytest.approx(4000.0)
