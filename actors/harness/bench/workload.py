"""Whole-runtime figures: durability overhead, turns/s per host count, turns one host holds.

Every measurement runs on its own fresh deployment (own namespace, own actors) on the shared
Ray cluster and Redis, so one run's leftovers never weigh on the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import Scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.run_stats import new_run_id, turn_ids
from actors.engine.settings.config import Settings
from store.records import CheckpointRecord
from store.write.transcript import Transcript

WARMUP_TURNS = 20
"""Turns run (untimed) on a fresh deployment first, so tool workers and pools are up."""


@contextlib.asynccontextmanager
async def deployed(
    base: Settings, url: str, *, hosts: int, label: str, mid_turn: bool = True
) -> AsyncIterator[Runtime]:
    """A fresh deployment that saves at every durable boundary (no debounce), or, with
    ``mid_turn=False``, only at submission and at the end; handed over once its standby
    hosts are up."""
    checkpoint = base.checkpoint.model_copy(update={"min_interval_s": 0.0, "mid_turn": mid_turn})
    settings = base.model_copy(update={"checkpoint": checkpoint}).with_overrides(
        namespace=f"bench{label}{new_run_id()}"
    )
    rt = await Runtime.start(settings, redis_url=url, hosts=hosts)
    try:
        await rt.standbys()  # started after the deployment is up: not in what is measured
        yield rt
    finally:
        await rt.shutdown()


async def run_turns(
    rt: Runtime, scenario: Scenario, n: int, *, timeout: float = 1800.0
) -> tuple[float, dict[str, CheckpointRecord]]:
    """Submit ``n`` turns at once and wait for all; returns (wall seconds, final records)."""
    ids = turn_ids(new_run_id(), n)
    t0 = time.perf_counter()
    await rt.submit(*scripted_turn(scenario), ids)
    finals = await rt.wait(ids, timeout=timeout)
    return time.perf_counter() - t0, finals


def _outcomes(finals: dict[str, CheckpointRecord]) -> dict[str, int]:
    return dict(Counter(str(r.counters.outcome) for r in finals.values()))


async def timed_run(rt: Runtime, scenario: Scenario, n: int) -> dict[str, Any]:
    """Warm the deployment up, then time ``n`` concurrent turns."""
    await run_turns(rt, scenario, WARMUP_TURNS)
    wall, finals = await run_turns(rt, scenario, n)
    return {
        "turns": n,
        "wall_s": round(wall, 3),
        "turns_per_s": round(n / wall, 2),
        "checkpoints": sum(r.seq for r in finals.values()),
        "outcomes": _outcomes(finals),
    }


async def durability_overhead(
    base: Settings, url: str, scenario: Scenario, *, turns: int, reps: int, hosts: int
) -> dict[str, Any]:
    """Figure 3: turns/s with checkpointing on and off, ``reps`` pairs, medians reported.

    One run of 1,000 short turns swings by up to 20 % on this VM, so the pairs alternate which
    mode goes first (a drift during the figure hits both alike) and every pair's own overhead
    is reported beside the medians, to show the spread."""
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for rep in range(reps):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            async with deployed(
                base, url, hosts=hosts, label=f"d{mode}{rep}", mid_turn=mode == "on"
            ) as rt:
                runs[mode].append(await timed_run(rt, scenario, turns))
    on = statistics.median(r["turns_per_s"] for r in runs["on"])
    off = statistics.median(r["turns_per_s"] for r in runs["off"])
    pairs = [
        _overhead_pct(a["turns_per_s"], b["turns_per_s"])
        for a, b in zip(runs["on"], runs["off"], strict=True)
    ]
    return {
        "scenario": scenario.name,
        "turns": turns,
        "hosts": hosts,
        "on_turns_per_s": on,
        "baseline_off_turns_per_s": off,
        "ratio_on_to_off": round(on / off, 3),
        "overhead_pct": _overhead_pct(on, off),
        "overhead_pct_per_pair": pairs,
        "runs": runs,
    }


def _overhead_pct(on: float, off: float) -> float:
    """How much slower turns ran with checkpointing on, in % of the rate with it off."""
    return round((off - on) / off * 100, 1)


async def host_scaling(
    base: Settings, url: str, scenario: Scenario, *, turns: int, host_counts: tuple[int, ...]
) -> dict[str, Any]:
    """Figure 5b: turns/s of the same workload on 1, 2, 4 ... hosts, against 1 host."""
    rows: list[dict[str, Any]] = []
    for hosts in host_counts:
        async with deployed(base, url, hosts=hosts, label=f"h{hosts}") as rt:
            rows.append({"hosts": hosts, **await timed_run(rt, scenario, turns)})
    baseline = rows[0]["turns_per_s"]
    for row in rows:
        row["ratio_to_first"] = round(row["turns_per_s"] / baseline, 3)
    return {"scenario": scenario.name, "turns": turns, "rows": rows}


async def host_capacity(
    base: Settings, url: str, scenario: Scenario, *, ladder: tuple[int, ...]
) -> dict[str, Any]:
    """Figure 5a: one host, ``n`` concurrent turns per step. A step is *held* when every turn
    answers and the host was never replaced (it kept answering the Supervisor's pings while
    it held them all). How much slower than scripted the turns ran is reported beside it
    (``slowdown``, the median turn over its scripted duration), not folded into "held": a
    host can hold more turns than its CPU can drive at full speed. Memory per turn is the
    host's peak RSS growth over its idle RSS, per turn, minus the encoded transcript and meta
    of a finished turn."""
    ideal_ms = (scenario.rounds + 1) * scenario.llm_latency_ms + (
        scenario.rounds * scenario.tool_latency_ms
    )
    rows: list[dict[str, Any]] = []
    for n in ladder:
        async with deployed(base, url, hosts=1, label=f"c{n}") as rt:
            (idle,) = await rt.host_info()
            done = asyncio.Event()
            sampler = asyncio.ensure_future(peak_rss(rt, done, idle.rss_bytes))
            try:
                wall, finals = await run_turns(rt, scenario, n)
            finally:
                done.set()
                peak = await sampler
            respawns = await rt.respawns()
        durations = [r.updated_at - r.meta[0].at_ms for r in finals.values()]
        slowdown = statistics.median(durations) / ideal_ms
        final = next(iter(finals.values()))
        transcript = Transcript.of(final.messages, final.meta).nbytes
        per_turn = (peak - idle.rss_bytes) / n - transcript
        outcomes = _outcomes(finals)
        rows.append(
            {
                "turns": n,
                "idle_rss_mib": round(idle.rss_bytes / 2**20, 1),
                "peak_rss_mib": round(peak / 2**20, 1),
                "bytes_per_turn_beyond_transcript": round(per_turn),
                "transcript_bytes": transcript,
                "median_turn_ms": round(statistics.median(durations)),
                "ideal_turn_ms": ideal_ms,
                "slowdown": round(slowdown, 2),
                "wall_s": round(wall, 2),
                "outcomes": outcomes,
                "respawns": respawns,
                "held": outcomes == {"answered": n} and respawns == 0,
            }
        )
    held = [r for r in rows if r["held"]]
    best = max(held, key=lambda r: r["turns"]) if held else None
    return {
        "scenario": scenario.name,
        "max_turns_held": best["turns"] if best else 0,
        "bytes_per_turn_at_max": best["bytes_per_turn_beyond_transcript"] if best else None,
        "rows": rows,
    }


async def peak_rss(rt: Runtime, done: asyncio.Event, floor: int) -> int:
    """Highest host RSS seen until ``done`` is set, sampled every 0.25 s."""
    peak = floor
    while not done.is_set():
        for info in await rt.host_info():
            peak = max(peak, info.rss_bytes)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), 0.25)  # the sampling period
    return peak
