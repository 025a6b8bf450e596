"""``phaseline demo``: many concurrent turns on Ray, one host SIGKILLed mid-run, then a verdict.

The verdict is :func:`actors.harness.verdict.judge`, read from Redis, not from the runtime's
counters: every turn has a final record, its transcript equals a fault-free in-process run of
the same work message for message (modulo tool-call ids; the ``promises`` verdict skips this
for a model that is not deterministic), meta is index-aligned, nothing is left in progress, no
side effect ran twice and no stale write was accepted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.cluster.runtime import Runtime
from actors.harness.chaos_monkey import ChaosMonkey
from actors.harness.chaos_report import Fault
from actors.harness.chaos_settings import ChaosSettings
from actors.harness.links import Links
from actors.harness.targets import ChaosTarget
from actors.harness.verdict import Verdict, VerdictMode, expected_for, judge
from actors.harness.work import Work
from store.views.summaries import summaries

#: Seconds between two looks at the turns' progress while the kill waits.
POLL_S = 0.2
#: Mean seconds between two faults of ``--faults`` (each interval drawn from 0.5x..1.5x).
FAULT_INTERVAL_S = 3.0


async def _under_way(rt: Runtime, ids: list[str], kill_at: float) -> None:
    """Return once ``kill_at`` of the turns have saved a checkpoint past submission (or
    ended): at 0, at once."""
    due = kill_at * len(ids)
    while True:
        rows = await summaries(rt.client, rt.keys, [(t, 0) for t in ids])
        if sum(1 for r in rows if r is None or r.seq >= 1 or not r.in_progress) >= due:
            return
        await asyncio.sleep(POLL_S)  # the poll period


@dataclass(slots=True)
class DemoReport:
    verdict: Verdict
    kills: list[dict[str, float | int]] = field(default_factory=list)
    respawns: int = 0
    wall_s: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    """What ``--faults`` brought besides the kill."""

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    def as_dict(self) -> dict[str, object]:
        v = self.verdict
        return {
            "ok": self.ok,
            "turns": v.turns,
            "completed": v.turns - len(v.lost) - len(v.in_progress),
            "correct": v.turns
            - len(
                set(v.lost)
                | set(v.in_progress)
                | {d.split(":")[0] for d in v.differ}
                | set(v.meta_drift)
            ),
            "resumed": v.resumed,
            "checkpoints": v.checkpoints,
            "model_calls": v.model_calls,
            "generations_adopted": v.generations_adopted,
            "generations_repaid": v.generations_repaid,
            "calls_repaid": v.calls_repaid,
            "duplicate_side_effects": len(v.duplicate_effects),
            "orphaned_side_effects": len(v.orphaned_effects),
            "kills": self.kills,
            "faults": [f"{f.target}: {f.victim} ({f.note})" for f in self.faults if f.landed],
            "respawns": self.respawns,
            "verdict": v.as_dict(),
            "wall_s": round(self.wall_s, 2),
            "turns_per_s": round(v.turns / self.wall_s, 1) if self.wall_s else None,
        }


async def run_demo(
    rt: Runtime,
    work: Work,
    ids: list[str],
    *,
    kill_at: float,
    on_done: Callable[[str], None],
    mode: VerdictMode = VerdictMode.EXACT,
    on_kill: Callable[[int], None] | None = None,
    faults: tuple[ChaosTarget, ...] = (),
    links: Links | None = None,
) -> DemoReport:
    """Run ``ids`` and SIGKILL host 0 once ``kill_at`` of them have durable progress (their
    first checkpoint), while they run: the kill used to wait for that share of turns to
    *finish*, and concurrent turns of one scenario finish together, so on a fast machine it
    came when nothing was left to resume. ``on_kill`` hears the pid of the host just killed,
    before Ray's own report of the death reaches the driver (the CLI says it is the demo's
    kill). ``faults`` (``provider``, ``partition``, through ``links``): one every
    :data:`FAULT_INTERVAL_S` or so while the turns run, as ``phaseline chaos`` brings them."""
    expected = await expected_for(mode, rt.client, work, f"{rt.dep.keys.namespace}-ref")
    started = time.monotonic()
    kills: list[dict[str, float | int]] = []
    finished: list[str] = []

    def done(turn_id: str) -> None:
        finished.append(turn_id)
        on_done(turn_id)

    await rt.submit(work.agent, work.turn_input, ids)
    waiter = asyncio.ensure_future(rt.wait(ids, timeout=1800, on_done=done))
    outside = ChaosSettings(work, len(ids), 1800.0, FAULT_INTERVAL_S, faults, seed=1)
    monkey = ChaosMonkey(rt, None, outside, links=links)  # no faults: it returns at once
    storms = asyncio.ensure_future(monkey.run())
    kill_due = asyncio.ensure_future(_under_way(rt, ids, kill_at))
    await asyncio.wait([waiter, kill_due], return_when=asyncio.FIRST_COMPLETED)
    kill_due.cancel()
    if not waiter.done():
        pid = await rt.kill_host(0)
        if on_kill is not None:
            on_kill(pid)
        kills.append(
            {
                "slot": 0,
                "pid": pid,
                "at_s": round(time.monotonic() - started, 2),
                "finished_before": len(finished),
            }
        )
    await waiter
    wall = time.monotonic() - started
    storms.cancel()  # a partition being cut is restored as the monkey stops
    await asyncio.gather(storms, return_exceptions=True)
    verdict = await judge(rt.client, rt.dep.keys, ids, expected)
    return DemoReport(verdict, kills, await rt.respawns(), wall, monkey.faults)
