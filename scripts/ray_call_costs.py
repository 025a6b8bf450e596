#!/usr/bin/env python3
"""What a Ray actor call costs its caller's CPU: the measurement behind sending a batch's calls of
idempotent tools to a ToolWorker as one call (``ToolWorker.call_group``):

    .venv/bin/python scripts/ray_call_costs.py [--batches N] [--reps R]

A local Ray with two async actors standing in for ToolWorkers (each call sleeps 20 ms, like the
bench's tools); the caller sends ``N`` batches of two tool calls at once, awaiting each as a host
does (``asyncio.wrap_future(ref.future())``), and reads its own process CPU (all its threads:
Ray's IO threads do part of the work). Three ways: one Ray call per tool call, one per batch
(both calls in it, what a host now sends), and one streamed reply per batch (an item per call).
Prints JSON: caller CPU µs per tool call, each way, per repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import ray

CALL = (
    "actors.engine.models.scripted:agent",
    "echo",
    '{"text": "' + "x" * 100 + '"}',
    "t1",
    "k" * 40,
)


class Worker:
    async def call(self, agent: str, name: str, args: str, turn: str, key: str) -> str:
        await asyncio.sleep(0.02)
        return args

    async def group(self, calls: list[tuple[str, ...]]) -> list[str]:
        return list(await asyncio.gather(*(self.call(*c) for c in calls)))

    async def stream(self, calls: list[tuple[str, ...]]) -> AsyncIterator[str]:
        for done in asyncio.as_completed([self.call(*c) for c in calls]):
            yield await done


async def ask(ref: Any) -> Any:
    return await asyncio.wrap_future(ref.future())


async def measure(batches: int, reps: int) -> dict[str, list[float]]:
    actor = ray.remote(Worker).options(max_concurrency=10_000, num_cpus=0)
    workers: list[Any] = [actor.remote() for _ in range(2)]
    await asyncio.gather(*(ask(w.call.remote(*CALL)) for w in workers))

    async def per_call(j: int) -> None:
        await asyncio.gather(*(ask(workers[(j + i) % 2].call.remote(*CALL)) for i in range(2)))

    async def per_batch(j: int) -> None:
        await ask(workers[j % 2].group.remote([CALL, CALL]))

    async def streamed(j: int) -> None:
        async for ref in (
            workers[j % 2].stream.options(num_returns="streaming").remote([CALL, CALL])
        ):
            await ref

    ways: dict[str, Callable[[int], Awaitable[None]]] = {
        "call_per_tool_call": per_call,
        "call_per_batch": per_batch,
        "streamed_batch": streamed,
    }
    out: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for name, way in ways.items():
            c0 = time.process_time()
            await asyncio.gather(*(way(j) for j in range(batches)))
            out[name].append(round(1e6 * (time.process_time() - c0) / (2 * batches), 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    ray.init(include_dashboard=False, logging_level=logging.ERROR)
    try:
        result = asyncio.run(measure(args.batches, args.reps))
    finally:
        ray.shutdown()
    print(json.dumps({"caller_cpu_us_per_tool_call": result}, indent=2))


if __name__ == "__main__":
    main()
