#!/usr/bin/env python3
"""What bounds the throughput figure (checkpoint saves/s at 1,000 turns) on this machine: the
save script sent with no client work at all.

    .venv/bin/python scripts/throughput_floor.py [--seconds S] [--clients 1,2]

On an embedded server under ``appendfsync always`` (what the default ``fsync`` durability runs
on), in a temporary directory: 1,000 turns of 12 messages are stored, then every save of the
timed window is encoded *beforehand* (the save script's ``EVALSHA`` with its keys and arguments,
forty sequence numbers per turn), and ``--clients`` processes send them the way the group commit
does: on the client's lane, in batches (1,000 in flight, as many as turns), the durability wait
after each batch. No record is encoded or validated and no Ray call is made while the clock
runs, so the saves/s it reaches is what the runtime's batched path could reach at best with this
client and this server; a plain ``SET`` of 500 bytes sent the same way shows what the server and
the durability wait allow for the cheapest write.

Per run: saves/s, client CPU and redis-server CPU per save over the timed window, and the
server's own time per call (``INFO commandstats``). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import redis

from actors.engine.settings.config import Settings
from actors.harness.bench.sizes import bench_record
from store.codec import EncodedRecord
from store.keys import KeyLayout
from store.redis.connection import connect
from store.redis.durability import DurabilityWait
from store.redis.embedded import EmbeddedRedis
from store.redis.transport import transport_of
from store.write.checkpoint import RedisCheckpointStore
from store.write.save_script import SAVE_LUA, SaveCall

TURNS, MESSAGES, PAYLOAD_BYTES = 1000, 12, 500
#: Batches in flight at once per client process (their saves together: the turns).
BATCHES = 8
SEQS = 40


async def _client(
    url: str,
    namespace: str,
    part: int,
    parts: int,
    mode: str,
    seconds: float,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    client = connect(url, max_connections=128)
    durability = Settings().redis.durability_policy()
    store = RedisCheckpointStore(client, KeyLayout(namespace), durability=durability)
    turns = [f"floor-{part}-{i}" for i in range(TURNS // parts)]
    records = [bench_record(t, messages=MESSAGES, payload_bytes=PAYLOAD_BYTES) for t in turns]
    # Every body stored first, and known to the store: what is timed is a running turn's saves
    # (its new record, no bodies), as the runtime sends them.
    await store.save_many(records)
    wait = await DurabilityWait(client, durability).command()
    sha = await client.script_load(SAVE_LUA)
    calls: list[tuple[object, ...]] = []
    for seq in range(2, SEQS + 2):  # seq-major: each turn's saves go out in order
        for record in records:
            encoded = EncodedRecord.of(record.model_copy(update={"seq": seq}), store.known)
            keys, args = SaveCall.of(  # the exact call a save sends
                store.keys,
                encoded,
                None,
                events_maxlen=store.events_maxlen,
                retention=store.retention,
            ).script_args()
            command = ("EVALSHA", sha, len(keys), *keys, *args)
            calls.append(command if mode == "script" else ("SET", keys[0], b"x" * PAYLOAD_BYTES))
    batch = len(records) // BATCHES
    transport, slot_key = transport_of(client), store.keys.turn(records[0].turn_id)  # one server
    done, next_call = 0, 0
    ready.put(part)
    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    stop = time.perf_counter() + seconds

    async def sender() -> None:
        nonlocal done, next_call
        while time.perf_counter() < stop and next_call < len(calls):
            sent = calls[next_call : next_call + batch]
            next_call += batch
            out = await transport.send(slot_key, sent, wait=wait)
            for reply in (*out.replies, *out.waits):
                if isinstance(reply, Exception):
                    raise reply
            done += len(sent)

    me = psutil.Process()
    cpu0, t0 = sum(me.cpu_times()[:2]), time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(BATCHES)))
    wall, cpu = time.perf_counter() - t0, sum(me.cpu_times()[:2]) - cpu0
    out.put({"saves": done, "wall_s": wall, "cpu_s": cpu, "ran_out": next_call >= len(calls)})
    await client.aclose()


def _run_client(*args: Any) -> None:
    asyncio.run(_client(*args))


def _server_process(server: EmbeddedRedis) -> psutil.Process:
    port = str(server.port)
    for proc in psutil.process_iter(["cmdline"]):
        if any(port in part for part in proc.info["cmdline"] or ()):
            return proc
    raise RuntimeError("the embedded server's process was not found")


def one_run(server: EmbeddedRedis, mode: str, clients: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    namespace = f"floor{time.time_ns()}"
    procs = [
        ctx.Process(
            target=_run_client,
            args=(server.url, namespace, i, clients, mode, seconds, ready, go, out),
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    admin = redis.Redis.from_url(server.url)
    admin.config_resetstat()
    redis_proc = _server_process(server)
    r0 = sum(redis_proc.cpu_times()[:2])
    go.set()
    results = [out.get(timeout=600) for _ in procs]
    r1 = sum(redis_proc.cpu_times()[:2])
    stats = admin.info("commandstats")
    admin.close()
    for p in procs:
        p.join()
    saves = sum(r["saves"] for r in results)
    wall = max(r["wall_s"] for r in results)
    command = "evalsha" if mode == "script" else "set"
    return {
        "mode": mode,
        "clients": clients,
        "saves_per_s": round(saves / wall),
        "client_cpu_us_per_save": round(1e6 * sum(r["cpu_s"] for r in results) / saves, 1),
        "redis_cpu_us_per_save": round(1e6 * (r1 - r0) / saves, 1),
        "server_us_per_call": stats.get(f"cmdstat_{command}", {}).get("usec_per_call"),
        "ran_out_of_saves": any(r["ran_out"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,2", help="client process counts, comma-separated")
    opts = parser.parse_args()
    counts = [int(c) for c in opts.clients.split(",")]
    runs = []
    with (
        tempfile.TemporaryDirectory() as data,
        EmbeddedRedis(data_dir=data, appendfsync="always") as server,
    ):
        for mode in ("set", "script"):
            for clients in counts:
                runs.append(one_run(server, mode, clients, opts.seconds))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"turns": TURNS, "messages": MESSAGES, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
