"""The ``unit_costs`` figure: what one round of a turn costs each process, and the scaling
model (:mod:`actors.harness.bench.scaling_model`) checked against this machine.

A fresh deployment runs ``turns`` turns of ``bench.toml`` at once (CPU-bound: their scripted
waits are short). The CPU time of every process of the deployment is read before and after
(``psutil``: hosts, CheckpointActor, WatchdogActor, RecoveryActor, Supervisor, ToolWorkers,
this driver; redis-server's own ``INFO cpu``), and whatever else the machine did in between
(Ray's raylet and GCS, mostly) is put under ``other``. Divided by the rounds done, these are
the unit costs the model sizes deployments with. The check: the costs measured on one host
predict the turns/s of one host, two hosts, and two hosts with two CheckpointActors on this
machine's cores; each is then measured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from typing import Any

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import Scenario
from actors.engine.settings.config import Settings
from actors.harness.bench.cpu import machine_busy_s, processes_cpu_s, redis_cpu_s
from actors.harness.bench.scaling_model import (
    Hardware,
    UnitCosts,
    Workload,
    predict_rounds_per_s,
    size,
)
from actors.harness.bench.workload import WARMUP_TURNS, deployed, peak_rss, run_turns
from store.redis.failures import translated

__all__ = ["unit_costs"]

#: (hosts, CheckpointActors) of the measured runs: the costs come from the first, the model
#: predicts all three.
SHAPES = ((1, 1), (2, 1), (2, 2))

#: The deployments docs/SCALING.md sizes.
MODEL_TURNS = (10_000, 100_000, 1_000_000)

_ROLES = ("watchdog", "recovery", "supervisor")


async def _pids(rt: Runtime) -> dict[str, list[int]]:
    """Every process of the deployment by role."""
    out: dict[str, list[int]] = {"host": [h.pid for h in await rt.host_info(isolation=True)]}
    for role in _ROLES:
        out[role] = [await rt.service_pid(role)]
    out["checkpoint"] = [await rt.service_pid(role) for role in rt.dep.checkpoint_roles()]
    tools = []
    for pool in rt.dep.tool_pools():
        for i in range(rt.dep.settings.tools.bounds()[1]):
            worker = rt.tool_worker(pool, i)
            if worker is not None:
                tools.append((await worker.hello()).pid)
    out["tool"] = tools
    out["driver"] = [os.getpid()]
    return out


async def _redis(rt: Runtime) -> tuple[float, int]:
    """redis-server's CPU seconds and used memory."""
    with translated("read redis INFO memory"):
        mem = await rt.client.info("memory")
    return await redis_cpu_s(rt.client), int(mem["used_memory"])


async def _measure(rt: Runtime, scenario: Scenario, turns: int) -> dict[str, Any]:
    """One timed run with the CPU of every process around it."""
    await run_turns(rt, scenario, WARMUP_TURNS)
    pids = await _pids(rt)
    hosts = await rt.host_info()
    idle = hosts[0] if len(hosts) == 1 else None  # memory per turn: on one host only
    cpu0 = {role: processes_cpu_s(p) for role, p in pids.items()}
    each0 = [processes_cpu_s([pid]) for pid in pids["checkpoint"]]
    busy0, (redis0, mem0) = machine_busy_s(), await _redis(rt)
    done = asyncio.Event()
    sampler = asyncio.ensure_future(peak_rss(rt, done, idle.rss_bytes)) if idle else None
    try:
        wall, finals = await run_turns(rt, scenario, turns)
    finally:
        done.set()
        peak = await sampler if sampler else None
    cpu = {role: processes_cpu_s(p) - cpu0[role] for role, p in pids.items()}
    each = [processes_cpu_s([pid]) - c for pid, c in zip(pids["checkpoint"], each0, strict=True)]
    redis1, mem1 = await _redis(rt)
    cpu["redis"] = redis1 - redis0
    cpu["other"] = max(0.0, machine_busy_s() - busy0 - sum(cpu.values()))
    rounds = turns * (scenario.rounds + 1)
    saves = sum(r.seq for r in finals.values())
    calls = turns * scenario.rounds * scenario.tools_per_round
    per_round = {role: round(s * 1000 / rounds, 4) for role, s in cpu.items()}
    return {
        "turns": turns,
        "wall_s": round(wall, 3),
        "turns_per_s": round(turns / wall, 2),
        "rounds": rounds,
        "saves": saves,
        "tool_calls": calls,
        "cpu_s": {role: round(s, 3) for role, s in cpu.items()},
        "cpu_ms_per_round": per_round,
        "checkpoint_actor_cpu_s": [round(c, 3) for c in each],
        "host_peak_growth_bytes_per_turn": None
        if peak is None or idle is None
        else round((peak - idle.rss_bytes) / turns),
        "redis_bytes_per_turn": round((mem1 - mem0) / turns),
    }


def _costs(m: dict[str, Any]) -> UnitCosts:
    per_round, rounds = m["cpu_ms_per_round"], m["rounds"]
    saves_per_round = m["saves"] / rounds
    calls_per_round = m["tool_calls"] / rounds
    return UnitCosts(
        host_cpu_ms=per_round["host"],
        checkpoint_cpu_ms_per_save=per_round["checkpoint"] / saves_per_round,
        redis_cpu_ms=per_round["redis"],
        tool_cpu_ms_per_call=per_round["tool"] / calls_per_round if calls_per_round else 0.0,
        other_cpu_ms=sum(
            per_round[k] for k in ("watchdog", "recovery", "supervisor", "driver", "other")
        ),
        saves_per_round=saves_per_round,
        calls_per_round=calls_per_round,
        host_bytes_per_turn=float(m["host_peak_growth_bytes_per_turn"] or 0),
        redis_bytes_per_turn=float(max(1, m["redis_bytes_per_turn"])),
    )


async def unit_costs(
    base: Settings, url: str, scenario: Scenario, *, turns: int, round_s: float = 5.0
) -> dict[str, Any]:
    """The figure: unit costs on one host, the model's prediction for each of :data:`SHAPES` on
    this machine beside what it measured, and the model's deployments."""
    runs: dict[str, dict[str, Any]] = {}
    for hosts, actors in SHAPES:
        ckpt = base.checkpoint.model_copy(update={"actors": actors})
        async with deployed(
            base.model_copy(update={"checkpoint": ckpt}), url, hosts=hosts, label=f"u{hosts}"
        ) as rt:
            runs[f"{hosts}x{actors}"] = await _measure(rt, scenario, turns)
    costs = _costs(runs["1x1"])
    cores = float(os.cpu_count() or 1)
    check = []
    for hosts, actors in SHAPES:
        run = runs[f"{hosts}x{actors}"]
        rounds_per_s, limit = predict_rounds_per_s(
            costs, cores=cores, hosts=hosts, checkpoint_actors=actors
        )
        predicted = rounds_per_s / (scenario.rounds + 1)
        check.append(
            {
                "hosts": hosts,
                "checkpoint_actors": actors,
                "predicted_turns_per_s": round(predicted, 2),
                "limited_by": limit,
                "measured_turns_per_s": run["turns_per_s"],
                "measured_over_predicted": round(run["turns_per_s"] / predicted, 3),
            }
        )
    model = [
        dataclasses.asdict(size(costs, Workload(turns=n, round_s=round_s), Hardware()))
        for n in MODEL_TURNS
    ]
    return {
        "scenario": scenario.name,
        "turns": turns,
        "cores": cores,
        "costs": {k: round(v, 4) for k, v in dataclasses.asdict(costs).items()},
        "cpu_ms_per_round_total": round(costs.cpu_ms_per_round, 3),
        "runs": runs,
        "check": check,
        "check_error_median": round(
            statistics.median(abs(c["measured_over_predicted"] - 1) for c in check), 3
        ),
        "model_round_s": round_s,
        "model_hardware": dataclasses.asdict(Hardware()),
        "model": model,
        "measured_at": time.time(),
    }
