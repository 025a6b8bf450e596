"""Figure: tool calls/s of a latency-bound tool at 1, 2, 4 and 8 ToolWorkers, against 1 worker
and against the ideal (linear: workers x per-worker concurrency / latency)."""

from __future__ import annotations

import time
from typing import Any

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import Scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.run_stats import new_run_id, turn_ids
from actors.engine.settings.config import Settings
from actors.harness.bench.napping import PER_WORKER
from bus.outcomes import Outcome

#: Import path of the figure's agent.
NAPPING = "actors.harness.bench.napping:agent"


async def tool_scaling(
    base: Settings,
    url: str,
    *,
    turns: int,
    rounds: int,
    latency_ms: int,
    worker_counts: tuple[int, ...],
) -> dict[str, Any]:
    """Per worker count, a fresh deployment (2 hosts) runs ``turns`` turns of ``rounds`` calls
    of the napping tool each, all at once; calls/s is calls over the wall time of the run."""
    scenario = Scenario.model_validate(
        {
            "name": "tool_scaling",
            "rounds": rounds,
            "tools_per_round": 1,
            "tools": ["sleep"],
            "llm_latency_ms": 0,
            "tool_latency_ms": latency_ms,
            "payload_bytes": 20,
        }
    )
    _, turn_input = scripted_turn(scenario)  # the scripted input, run by the napping agent
    rows: list[dict[str, Any]] = []
    for workers in worker_counts:
        tools = base.tools.model_copy(update={"workers": workers})
        checkpoint = base.checkpoint.model_copy(update={"min_interval_s": 0.0})
        settings = base.model_copy(update={"tools": tools, "checkpoint": checkpoint})
        settings = settings.with_overrides(namespace=f"benchtools{workers}x{new_run_id()}")
        rt = await Runtime.start(settings, redis_url=url, hosts=2)
        try:
            await rt.standbys()  # their process starts would share the timed CPU
            warm = turn_ids(new_run_id(), workers * 2)  # every worker up and serving
            await rt.submit(NAPPING, turn_input, warm)
            await rt.wait(warm, timeout=600)
            ids = turn_ids(new_run_id(), turns)
            t0 = time.perf_counter()
            await rt.submit(NAPPING, turn_input, ids)
            finals = await rt.wait(ids, timeout=1800)
            wall = time.perf_counter() - t0
        finally:
            await rt.shutdown()
        answered = sum(r.counters.outcome is Outcome.ANSWERED for r in finals.values())
        calls = turns * rounds
        rows.append(
            {
                "workers": workers,
                "calls": calls,
                "wall_s": round(wall, 2),
                "calls_per_s": round(calls / wall, 1),
                "ideal_calls_per_s": round(workers * PER_WORKER * 1000 / latency_ms, 1),
                "answered": answered,
            }
        )
    first = rows[0]["calls_per_s"]
    for row in rows:
        row["ratio_to_1_worker"] = round(row["calls_per_s"] / first, 2)
        row["ideal_ratio"] = round(row["workers"] / rows[0]["workers"], 2)
        row["fraction_of_ideal"] = round(row["calls_per_s"] / row["ideal_calls_per_s"], 2)
    return {
        "tool_latency_ms": latency_ms,
        "per_worker_concurrency": PER_WORKER,
        "turns": turns,
        "rounds": rounds,
        "rows": rows,
    }
