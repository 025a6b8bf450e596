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
from actors.harness.verdict import Verdict, VerdictMode, expected_for, judge
from actors.harness.work import Work


@dataclass(slots=True)
class DemoReport:
    verdict: Verdict
    kills: list[dict[str, float | int]] = field(default_factory=list)
    respawns: int = 0
    wall_s: float = 0.0

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
            "calls_repaid": v.calls_repaid,
            "duplicate_side_effects": len(v.duplicate_effects),
            "orphaned_side_effects": len(v.orphaned_effects),
            "kills": self.kills,
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
) -> DemoReport:
    """``on_kill`` hears the pid of the host just killed, before Ray's own report of the death
    reaches the driver (the CLI says it is the demo's kill)."""
    expected = await expected_for(mode, rt.client, work, f"{rt.dep.keys.namespace}-ref")
    started = time.monotonic()
    done = 0
    due = asyncio.Event()
    kills: list[dict[str, float | int]] = []

    def check() -> None:
        if done >= kill_at * len(ids):
            due.set()

    def finished(turn_id: str) -> None:
        nonlocal done
        done += 1
        on_done(turn_id)
        check()

    await rt.submit(work.agent, work.turn_input, ids)
    check()  # at kill_at 0 the kill is due at once, with every turn in flight
    waiter = asyncio.ensure_future(rt.wait(ids, timeout=1800, on_done=finished))
    kill_due = asyncio.ensure_future(due.wait())
    await asyncio.wait([waiter, kill_due], return_when=asyncio.FIRST_COMPLETED)
    kill_due.cancel()
    if not waiter.done():
        pid = await rt.kill_host(0)
        if on_kill is not None:
            on_kill(pid)
        kills.append({"slot": 0, "pid": pid, "at_s": round(time.monotonic() - started, 2)})
    await waiter
    wall = time.monotonic() - started
    verdict = await judge(rt.client, rt.dep.keys, ids, expected)
    return DemoReport(verdict, kills, await rt.respawns(), wall)
