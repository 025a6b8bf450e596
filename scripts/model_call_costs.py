#!/usr/bin/env python3
"""What a model call costs each process of a deployment, with model calls on model workers or
in the hosts (``[models] remote``):

    .venv/bin/python scripts/model_call_costs.py [--turns N] [--hosts H] [--remote on|off]

A fresh deployment on a local Ray and an embedded Redis runs ``N`` concurrent turns of
``configs/scenarios/bench.toml`` (after a warm-up); the CPU time (user + system, every thread)
each kind of process spent over the timed run is divided by the model calls made (4 a turn).
With model workers, it also prints each worker's calls and the submits and collects that carried
them (how well the host's calls were batched). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from actors.cluster.refs import ModelWorkerRef
from actors.engine.models.scenario import load_scenario
from actors.engine.settings.config import load_settings
from actors.harness.bench.workload import deployed, run_turns
from store.redis.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]
CALLS_PER_TURN = 4  # bench.toml: three tool rounds and the answer


def cpu_by_kind() -> Counter[str]:
    """CPU seconds so far of each kind of process: Ray actors by class, Redis, this driver."""
    out: Counter[str] = Counter()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            times = proc.cpu_times()
        except psutil.Error:
            continue
        if cmd.startswith("ray::"):
            kind = cmd.split()[0].removeprefix("ray::").split(":")[-1].split(".")[0]
        elif "redis-server" in cmd or "valkey-server" in cmd:
            kind = "redis"
        elif proc.pid == os.getpid():
            kind = "driver"
        else:
            continue
        out[kind] += times.user + times.system
    return out


async def measure(turns: int, hosts: int, remote: bool) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as config:
        config.write(f"[models]\nremote = {'true' if remote else 'false'}\n")
        config.flush()
        base = load_settings(config.name)
    scenario = load_scenario(ROOT / "configs" / "scenarios" / "bench.toml")
    with EmbeddedRedis() as server:
        async with deployed(base, server.url, hosts=hosts, label="costs") as rt:
            await run_turns(rt, scenario, 50)
            before = cpu_by_kind()
            wall, _ = await run_turns(rt, scenario, turns)
            after = cpu_by_kind()
            workers = {}
            if remote:
                for name in rt.dep.model_worker_names():
                    if (worker := ModelWorkerRef.named(name)) is not None:
                        counts = (await worker.hello(10)).counts
                        workers[name] = {k: counts.get(k) for k in ("calls", "submits", "collects")}
    calls = turns * CALLS_PER_TURN
    return {
        "remote": remote,
        "hosts": hosts,
        "turns": turns,
        "turns_per_s": round(turns / wall, 1),
        "cpu_ms_per_model_call": {
            kind: round(1000 * (after[kind] - before[kind]) / calls, 3)
            for kind in sorted(after)
            if after[kind] - before[kind] > 0.01
        },
        "model_workers": workers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--turns", type=int, default=1500)
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--remote", choices=("on", "off"), default="on")
    args = ap.parse_args()
    result = asyncio.run(measure(args.turns, args.hosts, args.remote == "on"))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
