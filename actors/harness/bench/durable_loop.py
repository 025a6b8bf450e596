"""The ``durable_loop`` figure: what durability costs a turn in the in-process engine.

A turn of the scripted agent: 10 rounds of one tool call, 500-byte payloads, no model or tool
latency, a checkpoint after every tool batch (``min_interval_s = 0``). *Durable*: the
:class:`~actors.engine.turn_engine.TurnEngine` on Redis (submission, fenced saves, the ledger's
compare-and-sets). *Baseline*: the same engine's loop on :mod:`store.write.memory` (the same rules,
no Redis). Measured one turn at a time (ms per turn, the two alternating so they share the
noise) and 200 at once (turns/s). ``ratio`` is durable speed over baseline speed: 0.6 means
durability costs 40 %.

What bounds the ratio is measured in the same run, so a miss says whether code or the machine
is in the way. One at a time, a durable turn waits for each of its round trips to Redis, and a
write's round trip includes the server's fsync (``appendfsync always`` under the default
``fsync`` durability): ``floor_ms_per_turn`` is the baseline turn plus the durable turn's round
trips (counted on its connections) each at the price of the cheapest durable write this client
can make (one ``SET`` and the durability wait, timed here), and ``ceiling_ratio`` the ratio no
client of this kind could beat on this machine. Many at once, the process's CPU is the limit:
``cpu_ms_per_turn`` of each variant says how much of it durability takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from actors.engine.agents import load_agent
from actors.engine.gc_tuning import DEFAULT_GC_THRESHOLD, gc_tuned
from actors.engine.models.scenario import Scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.submission import new_turns
from actors.engine.tools.toolrun import BatchExecutor
from actors.engine.turn_checkpoints import TurnCheckpoints
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.errors import StoreError
from bus.outcomes import Outcome
from store.keys import KeyLayout
from store.redis.connection import StoreClient, connect
from store.redis.durability import DurabilityWait
from store.redis.failures import translated
from store.redis.lane import lane_of
from store.redis.transport import transport_of
from store.write.memory import MemoryCheckpoints, MemoryInbox, MemoryLedger

SCENARIO = Scenario(
    name="durable_loop", rounds=10, tools_per_round=1, tools=["echo"], payload_bytes=500
)

Turn = Callable[[str], Awaitable[None]]


async def durable_loop(
    url: str,
    *,
    turns: int,
    concurrent: int,
    reps: int,
    warmup: int = 20,
    gc_threshold: int = DEFAULT_GC_THRESHOLD,
) -> dict[str, Any]:
    """The figure: ``turns`` sequential turns per variant, then ``reps`` rounds of
    ``concurrent`` turns at once per variant; both variants under a host's garbage-collector
    setting (``[host] gc_threshold``)."""
    client = connect(url, max_connections=256)
    round_trips = _count_round_trips(client)
    settings = EngineSettings(loop=LoopSettings(checkpoint_min_interval_s=0), watchdog=None)
    keys = KeyLayout(f"benchloop{time.time_ns()}")
    engine = TurnEngine(client, keys, settings)
    agent, turn_input = scripted_turn(SCENARIO)
    registry = await engine.runner.registry(agent, load_agent(agent), turn_input)

    async def durable(turn_id: str) -> None:
        _check(await engine.run_one(agent, turn_input, turn_id))

    async def memory(turn_id: str) -> None:
        checkpoints = MemoryCheckpoints()
        ((spec, record),) = new_turns(agent, turn_input, [turn_id])
        await checkpoints.save(record)
        ledger = MemoryLedger(checkpoints)
        loop = await engine.build_loop(
            record,
            spec,
            checkpoints=TurnCheckpoints(checkpoints, ledger),
            tools=BatchExecutor(registry, engine.runner, ledger, None, agent=agent),
            inbox=MemoryInbox(),
        )
        _check(await engine.drive(loop))

    write = _cheapest_write(client, DurabilityWait(client, settings.durability), keys)
    try:
        with gc_tuned(gc_threshold):  # as a host runs its turns
            timed = await _timed(
                {"durable": durable, "memory": memory},
                turns=turns,
                concurrent=concurrent,
                reps=reps,
                warmup=warmup,
                round_trips=round_trips,
                write=write,
            )
    finally:
        # best effort: a Redis gone by now already failed the figure
        with contextlib.suppress(StoreError), translated("delete the bench's write key"):
            await client.delete(_floor_key(keys))
        await client.aclose()
    return _figure(timed, turns=turns, concurrent=concurrent, reps=reps)


#: Cheapest durable writes timed after each pair of sequential turns (``write_round_trip_ms``).
WRITES_PER_TURN = 2


def _floor_key(keys: KeyLayout) -> str:
    """Where the cheapest write goes (deleted when the figure ends)."""
    return keys.turn("bench-floor")


def _count_round_trips(client: StoreClient) -> Callable[[], int]:
    """A counter of ``client``'s round trips (one per send of packed commands: a pipeline
    is one), counted by the connections it opens from now on and by its lane."""
    count = [0]
    lane = lane_of(client)
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a cluster client: not counted (the figure runs on one server)
        return lambda: count[0]
    base: type[Any] = pool.connection_class

    class Counted(base):  # type: ignore[misc]
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            count[0] += 1
            await super().send_packed_command(command, check_health)

    pool.connection_class = Counted
    return lambda: count[0] + (lane.round_trips if lane is not None else 0)


def _cheapest_write(
    client: StoreClient, wait: DurabilityWait, keys: KeyLayout
) -> Callable[[], Awaitable[float]]:
    """One durable write as cheap as this client makes them (a 500-byte ``SET`` and the
    durability wait, one round trip, the way a save is sent: on the client's lane if it has
    one); each call answers its ms."""
    key = _floor_key(keys)
    value = b"x" * SCENARIO.payload_bytes

    async def write() -> float:
        command = await wait.command()
        t0 = time.perf_counter()
        with translated("bench write"):  # sent as the saves are
            sent = await transport_of(client).send(key, [("SET", key, value)], wait=command)
            for reply in (*sent.replies, *sent.waits):
                if isinstance(reply, Exception):
                    raise reply
        return (time.perf_counter() - t0) * 1000

    return write


@dataclass
class _Timed:
    """What :func:`_timed` measured, per variant."""

    ms: dict[str, list[float]]
    """Wall ms of each sequential turn."""
    cpu_ms: dict[str, float]
    """This process's CPU ms per sequential turn."""
    round_trips: float
    """Round trips to Redis per sequential durable turn."""
    write_ms: list[float]
    """Wall ms of each cheapest durable write (:func:`_cheapest_write`)."""
    tps: dict[str, list[float]]
    """Turns/s of each round of concurrent turns."""
    cpu_ms_many: dict[str, float]
    """This process's CPU ms per turn when many run at once."""


async def _timed(
    variants: dict[str, Turn],
    *,
    turns: int,
    concurrent: int,
    reps: int,
    warmup: int,
    round_trips: Callable[[], int],
    write: Callable[[], Awaitable[float]],
) -> _Timed:
    """Per variant: ms of each of ``turns`` sequential turns (the variants alternating, so
    they share the machine's noise), and turns/s of each of ``reps`` rounds of ``concurrent``
    turns at once; after ``warmup`` turns of each. ``round_trips``: the durable variant's
    counter (:func:`_count_round_trips`); ``write``: the cheapest durable write, timed between
    the sequential turns."""
    counter = iter(range(10**9))

    def fresh(label: str) -> str:
        return f"{label}-{next(counter)}"

    for name, run in variants.items():
        for _ in range(warmup):
            await run(fresh(f"warm-{name}"))
    ms: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, float] = dict.fromkeys(variants, 0.0)
    trips, write_ms = 0, []
    for _ in range(turns):
        for name, run in variants.items():
            before = round_trips()
            c0, t0 = time.process_time(), time.perf_counter()
            await run(fresh(name))
            ms[name].append((time.perf_counter() - t0) * 1000)
            cpu[name] += time.process_time() - c0
            if name == "durable":
                trips += round_trips() - before
        write_ms += [await write() for _ in range(WRITES_PER_TURN)]
    tps: dict[str, list[float]] = {name: [] for name in variants}
    cpu_many: dict[str, float] = dict.fromkeys(variants, 0.0)
    for _ in range(reps):
        for name, run in variants.items():
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(run(fresh(f"c-{name}")) for _ in range(concurrent)))
            tps[name].append(concurrent / (time.perf_counter() - t0))
            cpu_many[name] += time.process_time() - c0
    return _Timed(
        ms,
        {name: 1000 * s / turns for name, s in cpu.items()},
        trips / turns,
        write_ms,
        tps,
        {name: 1000 * s / (reps * concurrent) for name, s in cpu_many.items()},
    )


def _figure(t: _Timed, *, turns: int, concurrent: int, reps: int) -> dict[str, Any]:
    one = {name: round(statistics.mean(v), 3) for name, v in t.ms.items()}
    many = {name: round(statistics.median(v), 1) for name, v in t.tps.items()}
    # From the figures as reported, so the report's own arithmetic checks out.
    trips, write = round(t.round_trips, 1), round(statistics.median(t.write_ms), 3)
    floor = round(one["memory"] + trips * write, 3)
    return {
        "scenario": SCENARIO.model_dump(exclude_defaults=True),
        "saves_per_turn": SCENARIO.rounds + 2,  # submission, one per batch, the final
        "sequential": {
            "turns": turns,
            "durable_ms_per_turn": one["durable"],
            "memory_ms_per_turn": one["memory"],
            "ratio": round(one["memory"] / one["durable"], 3),
            "durable_cpu_ms_per_turn": round(t.cpu_ms["durable"], 3),
            "memory_cpu_ms_per_turn": round(t.cpu_ms["memory"], 3),
            "round_trips_per_turn": trips,
            "write_round_trip_ms": write,
            "floor_ms_per_turn": floor,
            "ceiling_ratio": round(one["memory"] / floor, 3),
        },
        "concurrent": {
            "turns": concurrent,
            "reps": reps,
            "durable_turns_per_s": many["durable"],
            "memory_turns_per_s": many["memory"],
            "ratio": round(many["durable"] / many["memory"], 3),
            "durable_cpu_ms_per_turn": round(t.cpu_ms_many["durable"], 3),
            "memory_cpu_ms_per_turn": round(t.cpu_ms_many["memory"], 3),
        },
    }


def _check(outcome: Any) -> None:
    if outcome.outcome is not Outcome.ANSWERED:
        raise StoreError(f"bench turn {outcome.turn_id} ended {outcome.outcome}")
