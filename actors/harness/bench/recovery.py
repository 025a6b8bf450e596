"""Figure 4: how long turns stand still when their host is SIGKILLed, against Ray itself.

The baseline is what Ray does for any actor declared with ``max_restarts``: notice the death,
start a new process, run ``__init__``, answer. phaseline has more to do (find the death,
bring up a host, plan and resume every turn from Redis), and this figure says how much more.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.cluster.refs import ask
from actors.engine.models.scenario import Scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.run_stats import new_run_id, turn_ids
from actors.engine.settings.config import Settings
from actors.harness.bench.workload import deployed
from actors.harness.percentiles import summarize
from actors.harness.transitions import first_moves_after, read_moves
from bus.errors import PhaselineError
from bus.outcomes import Outcome


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class EmptyActor:
    """Nothing but a pid: the cheapest actor Ray can restart."""

    def pid(self) -> int:
        return os.getpid()


async def ray_restart_ms(samples: int, *, timeout: float = 60.0) -> list[float]:
    """SIGKILL an empty restartable actor ``samples`` times; milliseconds from each kill until
    a call is answered by the new process."""
    actor = EmptyActor.remote()  # type: ignore[attr-defined]
    pid = await actor.pid.remote()
    out: list[float] = []
    try:
        for _ in range(samples):
            os.kill(pid, signal.SIGKILL)
            t0 = time.perf_counter()
            deadline = t0 + timeout
            while True:
                if time.perf_counter() > deadline:
                    raise PhaselineError(f"empty actor not restarted within {timeout:g} s")
                try:
                    new = await ask(actor.pid.remote(), timeout)
                except RayActorError:
                    continue  # the call went to the dead process; the next one waits for Ray
                if new != pid:
                    break
            out.append((time.perf_counter() - t0) * 1000)
            pid = new
    finally:
        ray.kill(actor, no_restart=True)
    return out


async def host_kill_recovery(
    base: Settings, url: str, scenario: Scenario, *, turns: int, timeout: float = 600.0
) -> dict[str, Any]:
    """One host runs ``turns`` turns; once each has moved, SIGKILL it and time, per turn, the
    kill to its first transition under the successor's epoch."""
    async with deployed(base, url, hosts=1, label="rec") as rt:
        ids = turn_ids(new_run_id(), turns)
        await rt.submit(*scripted_turn(scenario), ids)
        deadline = time.monotonic() + timeout
        while len({t.turn_id for t in await read_moves(rt.client, rt.dep.keys)}) < turns:
            if time.monotonic() > deadline:
                raise PhaselineError(f"{turns} turns did not all start within {timeout:g} s")
            await asyncio.sleep(0.1)  # polling the bus for every turn's first move
        in_flight = len(set(await rt.store.list_in_progress()) & set(ids))
        pid = await rt.kill_host(0)
        kill_ms = time.time() * 1000
        finals = await rt.wait(ids, timeout=timeout)
        moves = await read_moves(rt.client, rt.dep.keys)
    first = first_moves_after(moves, {tid: 1 for tid in ids}, kill_ms)
    latency = [t.at_ms - kill_ms for t in first.values()]
    return {
        "scenario": scenario.name,
        "turns": turns,
        "in_flight_at_kill": in_flight,
        "killed_pid": pid,
        "recovered": len(first),
        "answered": sum(r.counters.outcome is Outcome.ANSWERED for r in finals.values()),
        "latency_ms": summarize(latency),
    }
