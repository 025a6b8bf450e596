"""``phaseline demo``: many concurrent turns on Ray, one host SIGKILLed mid-run, then a verdict.

The verdict is read from Redis, not from the runtime's counters: every turn must have a final
record, its transcript must equal a fault-free in-process run of the same scenario message for
message, meta must be index-aligned, and nothing may be left in progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from actors.engine import LocalEngine
from actors.loop import LoopSettings
from actors.runtime import Runtime
from actors.scenario import Scenario
from store.keys import KeyLayout


@dataclass(slots=True)
class DemoReport:
    turns: int
    completed: int = 0
    correct: int = 0
    resumed: int = 0
    checkpoints: int = 0
    kills: list[dict[str, float | int]] = field(default_factory=list)
    respawns: int = 0
    wrong: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.completed == self.correct == self.turns and not self.wrong

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "turns": self.turns,
            "completed": self.completed,
            "correct": self.correct,
            "resumed": self.resumed,
            "checkpoints": self.checkpoints,
            "kills": self.kills,
            "respawns": self.respawns,
            "wrong": self.wrong[:20],
            "wall_s": round(self.wall_s, 2),
            "turns_per_s": round(self.turns / self.wall_s, 1) if self.wall_s else None,
        }


async def reference_transcript(
    client: aioredis.Redis, scenario: Scenario, namespace: str
) -> tuple[object, ...]:
    """The fault-free transcript (the scripted model's output depends on the scenario only)."""
    engine = LocalEngine(
        client,
        KeyLayout(namespace, shards=1),
        loop_settings=LoopSettings(checkpoint_min_interval_s=0),
    )
    await engine.run_new(scenario.model_copy(update={"llm_latency_ms": 0}), ["reference"])
    return (await engine.store.load("reference")).messages


async def run_demo(
    rt: Runtime,
    scenario: Scenario,
    ids: list[str],
    *,
    kill_at: float,
    on_done: Callable[[str], None],
) -> DemoReport:
    report = DemoReport(turns=len(ids))
    expected = await reference_transcript(rt.client, scenario, f"{rt.dep.keys.namespace}-ref")
    started = time.monotonic()
    done = 0
    killed = asyncio.Event()

    def finished(turn_id: str) -> None:
        nonlocal done
        done += 1
        on_done(turn_id)
        if done >= kill_at * len(ids) and not killed.is_set():
            killed.set()

    await rt.submit(scenario, ids)
    waiter = asyncio.ensure_future(rt.wait(ids, timeout=1800, on_done=finished))
    await asyncio.wait(
        [waiter, asyncio.ensure_future(killed.wait())], return_when=asyncio.FIRST_COMPLETED
    )
    if not waiter.done():
        slot = 0
        pid = await rt.kill_host(slot)
        report.kills.append(
            {"slot": slot, "pid": pid, "at_s": round(time.monotonic() - started, 2)}
        )
    finals = await waiter
    report.wall_s = time.monotonic() - started
    report.respawns = await rt.respawns()
    for tid in ids:
        record = finals.get(tid)
        if record is None or record.in_progress:
            report.wrong.append(f"{tid}: lost")
            continue
        report.completed += 1
        report.resumed += record.counters.resume_attempts > 0
        report.checkpoints += record.seq
        if record.messages != expected:
            report.wrong.append(f"{tid}: transcript differs from the fault-free run")
        elif len(record.meta) != len(record.messages):
            report.wrong.append(f"{tid}: meta drift")
        else:
            report.correct += 1
    if await rt.store.list_in_progress():
        report.wrong.append("turns left in progress")
    return report
