"""The ``durable_loop`` figure: what durability costs a turn in the in-process engine.

A turn of the scripted agent: 10 rounds of one tool call, 500-byte payloads, no model or tool
latency, a checkpoint after every tool batch (``min_interval_s = 0``). *Durable*: the
:class:`~actors.engine.turn_engine.TurnEngine` on Redis (submission, fenced saves, the ledger's
compare-and-sets). *Baseline*: the same engine's loop on :mod:`store.memory` (the same rules,
no Redis). Measured one turn at a time (ms per turn, the two alternating so they share the
noise) and 200 at once (turns/s). ``ratio`` is durable speed over baseline speed: 0.6 means
durability costs 40 %.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.engine.agents import load_agent
from actors.engine.engine_settings import EngineSettings
from actors.engine.scenario import Scenario
from actors.engine.scripted import scripted_turn
from actors.engine.submission import new_turns
from actors.engine.toolrun import BatchExecutor
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.errors import StoreError
from bus.outcomes import Outcome
from store.connection import connect
from store.keys import KeyLayout
from store.memory import MemoryCheckpoints, MemoryInbox, MemoryLedger

SCENARIO = Scenario(
    name="durable_loop", rounds=10, tools_per_round=1, tools=["echo"], payload_bytes=500
)

Turn = Callable[[str], Awaitable[None]]


async def durable_loop(
    url: str, *, turns: int, concurrent: int, reps: int, warmup: int = 20
) -> dict[str, Any]:
    """The figure: ``turns`` sequential turns per variant, then ``reps`` rounds of
    ``concurrent`` turns at once per variant."""
    client = connect(url, max_connections=256)
    engine = TurnEngine(
        client,
        KeyLayout(f"benchloop{time.time_ns()}"),
        EngineSettings(loop=LoopSettings(checkpoint_min_interval_s=0), watchdog=None),
    )
    agent, turn_input = scripted_turn(SCENARIO)
    registry = await engine.runner.registry(agent, load_agent(agent), turn_input)

    async def durable(turn_id: str) -> None:
        ((spec, record),) = await engine.submit_many(agent, turn_input, [turn_id])
        _check(await engine.drive(await engine.build_loop(record, spec)))

    async def memory(turn_id: str) -> None:
        checkpoints = MemoryCheckpoints()
        ((spec, record),) = new_turns(agent, turn_input, [turn_id])
        await checkpoints.save(record)
        ledger = MemoryLedger(checkpoints)
        loop = await engine.build_loop(
            record,
            spec,
            checkpoints=checkpoints,
            tools=BatchExecutor(registry, engine.runner, ledger, None, agent=agent),
            inbox=MemoryInbox(),
        )
        _check(await engine.drive(loop))

    try:
        ms, tps = await _timed(
            {"durable": durable, "memory": memory},
            turns=turns, concurrent=concurrent, reps=reps, warmup=warmup,
        )  # fmt: skip
    finally:
        await client.aclose()
    return _figure(ms, tps, turns=turns, concurrent=concurrent, reps=reps)


async def _timed(
    variants: dict[str, Turn], *, turns: int, concurrent: int, reps: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant: ms of each of ``turns`` sequential turns (the variants alternating, so
    they share the machine's noise), and turns/s of each of ``reps`` rounds of ``concurrent``
    turns at once; after ``warmup`` turns of each."""
    counter = iter(range(10**9))

    def fresh(label: str) -> str:
        return f"{label}-{next(counter)}"

    for name, run in variants.items():
        for _ in range(warmup):
            await run(fresh(f"warm-{name}"))
    ms: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(turns):
        for name, run in variants.items():
            t0 = time.perf_counter()
            await run(fresh(name))
            ms[name].append((time.perf_counter() - t0) * 1000)
    tps: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            t0 = time.perf_counter()
            await asyncio.gather(*(run(fresh(f"c-{name}")) for _ in range(concurrent)))
            tps[name].append(concurrent / (time.perf_counter() - t0))
    return ms, tps


def _figure(
    ms: dict[str, list[float]],
    tps: dict[str, list[float]],
    *,
    turns: int,
    concurrent: int,
    reps: int,
) -> dict[str, Any]:
    one = {name: round(statistics.mean(v), 3) for name, v in ms.items()}
    many = {name: round(statistics.median(v), 1) for name, v in tps.items()}
    return {
        "scenario": SCENARIO.model_dump(exclude_defaults=True),
        "saves_per_turn": SCENARIO.rounds + 2,  # submission, one per batch, the final
        "sequential": {
            "turns": turns,
            "durable_ms_per_turn": one["durable"],
            "memory_ms_per_turn": one["memory"],
            "ratio": round(one["memory"] / one["durable"], 3),
        },
        "concurrent": {
            "turns": concurrent,
            "reps": reps,
            "durable_turns_per_s": many["durable"],
            "memory_turns_per_s": many["memory"],
            "ratio": round(many["durable"] / many["memory"], 3),
        },
    }


def _check(outcome: Any) -> None:
    if outcome.outcome is not Outcome.ANSWERED:
        raise StoreError(f"bench turn {outcome.turn_id} ended {outcome.outcome}")
