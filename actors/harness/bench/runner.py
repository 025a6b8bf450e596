"""The bench run: every figure in order, the report, and the targets it is judged by.

Ray and Redis are shared by all figures; each figure that needs a deployment starts a fresh
one. Figures are measured one after another, never at the same time, so each has the machine
to itself (with its baseline measured right beside it).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psutil
import ray
from ray.exceptions import RayError

from actors.engine.models.scenario import Scenario, load_scenario
from actors.engine.settings.config import Settings
from actors.engine.settings.shipped import configs_dir
from actors.harness.bench.cpu import machine_busy_s, processes_cpu_s, redis_cpu_s
from actors.harness.bench.durability_modes import durability_modes
from actors.harness.bench.durable_loop import durable_loop
from actors.harness.bench.probe import BenchProbe
from actors.harness.bench.recovery import host_kill_recovery, ray_restart_ms
from actors.harness.bench.sizes import checkpoint_sizes
from actors.harness.bench.targets import targets
from actors.harness.bench.tool_scaling import tool_scaling
from actors.harness.bench.unit_costs import unit_costs
from actors.harness.bench.workload import deployed, durability_overhead, host_capacity, host_scaling
from actors.harness.percentiles import summarize
from bus.errors import ConfigError, PhaselineError
from store.keys import KeyLayout
from store.redis.connection import StoreClient, connect
from store.redis.failures import translated
from store.write.checkpoint import RedisCheckpointStore

SCENARIOS = configs_dir() / "scenarios"

FIGURES = (
    "sizes",
    "latency",
    "throughput",
    "durability",
    "durability_modes",
    "scaling",
    "capacity",
    "recovery",
    "tool_scaling",
    "durable_loop",
    "unit_costs",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """How much of each figure to measure; :data:`QUICK` and :data:`FULL` are the two sizes."""

    latency_saves: int
    """Sequential saves per path for the latency figure."""
    throughput_rows: tuple[tuple[int, int], ...] = ((1, 12), (100, 12), (1000, 12), (1000, 200))
    """(concurrent saving turns, messages per record) of the throughput figure's rows."""
    throughput_s: float
    """Seconds each throughput path runs at each concurrency."""
    record_messages: int = 12
    """Messages in the record the probe saves (a turn five tool rounds in)."""
    payload_bytes: int = 500
    """Size of each message text and tool output in the probe's and the size figure's records."""
    durability_turns: int
    """Concurrent turns of the durability figure."""
    durability_reps: int
    """On/off pairs of the durability figure (medians are reported)."""
    scaling_turns: int
    """Turns of the host-count figure."""
    host_counts: tuple[int, ...] = (1, 2, 4)
    """Host counts of the host-count figure."""
    capacity_ladder: tuple[int, ...]
    """Concurrent turns tried on one host."""
    recovery_turns: int = 500
    """Turns in flight on the host that is killed."""
    ray_restarts: int
    """Empty-actor restarts measured as the recovery baseline."""
    modes_s: float = 3.0
    """Seconds each durability mode runs per round of the durability-modes figure."""
    size_lengths: tuple[int, ...] = (10, 50, 100, 250, 500)
    """Transcript lengths of the size figure."""
    tool_turns: int = 64
    """Turns of the tool-scaling figure (each makes ``tool_rounds`` calls, one at a time)."""
    tool_rounds: int = 5
    """Tool calls per turn of the tool-scaling figure."""
    tool_latency_ms: int = 200
    """What one call of the tool-scaling figure's tool waits."""
    worker_counts: tuple[int, ...] = (1, 2, 4, 8)
    """ToolWorker pool sizes of the tool-scaling figure."""
    loop_turns: int = 100
    """Sequential turns per variant of the durable-loop figure."""
    loop_concurrent: int = 200
    """Turns at once in the durable-loop figure's concurrent part."""
    loop_reps: int = 2
    """Rounds of the concurrent part per variant (the median is reported)."""
    unit_turns: int = 1000
    """Concurrent turns of each run of the unit-costs figure."""


QUICK = BenchConfig(
    modes_s=1.5,
    latency_saves=200,
    throughput_s=2.0,
    durability_turns=1000,
    durability_reps=2,
    scaling_turns=300,
    capacity_ladder=(5000,),
    ray_restarts=3,
    unit_turns=500,
)
FULL = BenchConfig(
    loop_turns=300,
    loop_reps=3,
    tool_turns=128,
    tool_rounds=10,
    latency_saves=1000,
    throughput_s=5.0,
    durability_turns=1000,
    durability_reps=5,
    scaling_turns=1000,
    capacity_ladder=(1000, 5000, 10000),
    ray_restarts=5,
)


def parse_figures(spec: str) -> tuple[str, ...]:
    """``all`` or a comma-separated subset of :data:`FIGURES`; anything else is a ConfigError."""
    if spec.strip() == "all":
        return FIGURES
    chosen = tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = sorted(set(chosen) - set(FIGURES))
    if unknown or not chosen:
        raise ConfigError(f"unknown figures {unknown or spec!r}; choose from {', '.join(FIGURES)}")
    return chosen


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


async def _probe_figures(
    base: Settings, url: str, cfg: BenchConfig, figures: tuple[str, ...]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The probe's synthetic turns are in progress with no host task and no spec, so the periodic
    # adopt would take them for orphans and quarantine them mid-measurement: keep it off here.
    sup = base.supervisor.model_copy(update={"adopt_interval_s": 86_400.0})
    async with deployed(
        base.model_copy(update={"supervisor": sup}), url, hosts=1, label="probe"
    ) as rt:
        probe = BenchProbe.remote(  # type: ignore[attr-defined]
            rt.dep.to_wire(), cfg.record_messages, cfg.payload_bytes
        )
        await probe.pid.remote()
        await probe.latency.remote(20)  # warm-up: connections, Ray call path
        if "latency" in figures:
            ms = await probe.latency.remote(cfg.latency_saves)
            actor, bare = summarize(ms["batched"], digits=3), summarize(ms["bare"], digits=3)
            out["checkpoint_latency"] = {
                "turns": 1,
                "record_messages": cfg.record_messages,
                "actor_ms": actor,
                "baseline_bare_multi_exec_ms": bare,
                "ratio_p50": _ratio(actor["p50"], bare["p50"]),
                "ratio_p99": _ratio(actor["p99"], bare["p99"]),
            }
        if "throughput" in figures:
            rows = []
            deployed_raw = f"raw_{base.checkpoint.atomic.value}"
            pids = {
                "probe": [await probe.pid.remote()],
                "checkpoint": [await rt.service_pid(r) for r in rt.dep.checkpoint_roles()],
            }
            for turns, messages in cfg.throughput_rows:
                row: dict[str, Any] = {"turns": turns, "messages": messages}
                cpu: dict[str, dict[str, float]] = {}
                for path in ("batched", "unbatched", "raw_script", "raw_multi_exec"):
                    await probe.throughput.remote(path, turns, min(0.5, cfg.throughput_s), messages)
                    got, cpu[path] = await _cpu_per_save(
                        rt.client,
                        pids,
                        probe.throughput.remote(path, turns, cfg.throughput_s, messages),
                    )
                    row[f"{path}_saves_per_s"] = round(got["saves_per_s"])
                row["cpu_us_per_save"] = cpu
                row["cores_for_10k_saves_per_s"] = round(cpu["batched"]["machine"] / 100, 2)
                row["ratio_to_unbatched"] = _ratio(
                    row["batched_saves_per_s"], row["unbatched_saves_per_s"]
                )
                row["ratio_to_raw"] = _ratio(
                    row["batched_saves_per_s"], row[f"{deployed_raw}_saves_per_s"]
                )
                row["ratio_multi_exec_to_script"] = _ratio(
                    row["raw_multi_exec_saves_per_s"], row["raw_script_saves_per_s"]
                )
                rows.append(row)
            out["checkpoint_throughput"] = {
                "atomic": base.checkpoint.atomic.value,
                "seconds_per_path": cfg.throughput_s,
                "rows": rows,
            }
        ray.kill(probe)
    return out


async def _cpu_per_save(
    client: StoreClient, pids: dict[str, list[int]], run: Awaitable[dict[str, float]]
) -> tuple[dict[str, float], dict[str, float]]:
    """``run`` (a throughput run: its ``saves``) and the CPU µs per save it cost each of
    ``pids``'s processes, redis-server, and the whole machine (Ray's own processes too)."""
    before = {who: processes_cpu_s(p) for who, p in pids.items()}
    redis0, busy0 = await redis_cpu_s(client), machine_busy_s()
    got = await run
    per = 1e6 / max(1.0, got["saves"])
    cpu = {who: round((processes_cpu_s(p) - before[who]) * per, 1) for who, p in pids.items()}
    cpu["redis"] = round((await redis_cpu_s(client) - redis0) * per, 1)
    cpu["machine"] = round((machine_busy_s() - busy0) * per, 1)
    return got, cpu


async def _sizes(url: str, cfg: BenchConfig, namespace: str) -> Any:
    """``bytes_per_checkpoint``: stored bytes per save as a transcript grows."""
    client = connect(url)
    try:
        store = RedisCheckpointStore(client, KeyLayout(namespace))
        return await checkpoint_sizes(
            client, store, lengths=cfg.size_lengths, payload_bytes=cfg.payload_bytes
        )
    finally:
        await client.aclose()


async def _recovery(base: Settings, url: str, slow: Scenario, cfg: BenchConfig) -> Any:
    """``recovery``: resume latency after a host is SIGKILLed, against Ray's own restart of
    an actor measured in the same run."""
    restarts = await ray_restart_ms(cfg.ray_restarts)
    kill = await host_kill_recovery(base, url, slow, turns=cfg.recovery_turns)
    baseline = statistics.median(restarts)
    kill["baseline_ray_restart_ms"] = summarize(restarts)
    kill["ratio_p50"] = _ratio(kill["latency_ms"]["p50"], baseline)
    kill["ratio_p99"] = _ratio(kill["latency_ms"]["p99"], baseline)
    return kill


async def run_bench(
    base: Settings,
    url: str,
    cfg: BenchConfig,
    *,
    figures: tuple[str, ...] = FIGURES,
    on_figure: Callable[[str, dict[str, Any]], None] = lambda name, data: None,
) -> dict[str, Any]:
    """Measure the chosen figures on Redis at ``url`` (Ray must be initialised)."""
    started = time.time()
    fig: dict[str, Any] = {}
    fast = load_scenario(SCENARIOS / "bench.toml")
    slow = load_scenario(SCENARIOS / "bench_slow.toml")

    plan: list[tuple[str, str, Callable[[], Awaitable[Any]]]] = [
        ("sizes", "bytes_per_checkpoint", lambda: _sizes(url, cfg, f"benchsize{int(started)}")),
        (
            "probe",
            "checkpoint_latency+checkpoint_throughput",
            lambda: _probe_figures(base, url, cfg, figures),
        ),
        (
            "durability",
            "durability_overhead",
            lambda: durability_overhead(
                base, url, fast, turns=cfg.durability_turns, reps=cfg.durability_reps, hosts=2
            ),
        ),
        (
            "durability_modes",
            "durability_modes",
            lambda: durability_modes(seconds=cfg.modes_s, reps=cfg.durability_reps),
        ),
        (
            "scaling",
            "turns_per_s_by_hosts",
            lambda: host_scaling(
                base, url, fast, turns=cfg.scaling_turns, host_counts=cfg.host_counts
            ),
        ),
        (
            "capacity",
            "host_capacity",
            lambda: host_capacity(base, url, slow, ladder=cfg.capacity_ladder),
        ),
        ("recovery", "recovery", lambda: _recovery(base, url, slow, cfg)),
        (
            "tool_scaling",
            "tool_scaling",
            lambda: tool_scaling(
                base,
                url,
                turns=cfg.tool_turns,
                rounds=cfg.tool_rounds,
                latency_ms=cfg.tool_latency_ms,
                worker_counts=cfg.worker_counts,
            ),
        ),
        (
            "durable_loop",
            "durable_loop",
            lambda: durable_loop(
                url,
                turns=cfg.loop_turns,
                concurrent=cfg.loop_concurrent,
                reps=cfg.loop_reps,
                gc_threshold=base.host.gc_threshold,
            ),
        ),
        ("unit_costs", "unit_costs", lambda: unit_costs(base, url, fast, turns=cfg.unit_turns)),
    ]
    for figure, name, measure in plan:
        wanted = {"latency", "throughput"} if figure == "probe" else {figure}
        if not wanted & set(figures):
            continue
        try:
            data = await measure()
        except (TimeoutError, PhaselineError, RayError) as exc:
            # Reported, not fatal: the other figures are still worth having.
            data = {"error": f"{type(exc).__name__}: {exc}"}
        results = data if figure == "probe" and "error" not in data else {name: data}
        for key, value in results.items():
            fig[key] = value
            on_figure(key, value)
    return {
        "machine": await machine(url),
        "config": dataclasses.asdict(cfg),
        "started_at": started,
        "wall_s": round(time.time() - started, 1),
        "figures": fig,
        "targets": [t.as_dict() for t in targets(fig)],
    }


async def machine(url: str) -> dict[str, Any]:
    """What the figures were measured on."""
    client = connect(url)
    try:
        with translated("read redis version"):
            info = await client.info("server")
    finally:
        await client.aclose()
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "ray": ray.__version__,
        "redis_server": info.get("redis_version"),
    }
