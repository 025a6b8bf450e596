#!/usr/bin/env python3
"""Saves/s of the checkpoint store under each durability mode, on one embedded server.

    .venv/bin/python scripts/durability_saves.py [--server PATH] [--appendfsync everysec|always]

Batches of 200 records of 12 messages (the group commit's shape) for 4 s per mode, each mode
twice, alternating, on a fresh embedded server. The figures behind the embedded default in
docs/ARCHITECTURE.md; ``phaseline bench`` measures whole turns.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.checkpoint import RedisCheckpointStore
from store.codec import EncodedRecord
from store.connection import connect
from store.durability import parse_durability
from store.embedded import SERVER_ENV, EmbeddedRedis, find_redis_server
from store.keys import KeyLayout
from tests.records_helpers import record


async def saves_per_s(url: str, mode: str, seconds: float = 4.0) -> float:
    client = connect(url)
    keys = KeyLayout(f"dur{mode.replace(':', '')}{time.time_ns()}")
    store = RedisCheckpointStore(client, keys, durability=parse_durability(mode))
    saved, seq, started = 0, 1, time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = [EncodedRecord.of(record(f"t{i}", seq=seq, n_turn_messages=10)) for i in range(200)]
        answers = await store.save_many(batch)
        failed = [a for a in answers if isinstance(a, Exception)]
        if failed:
            raise SystemExit(f"{mode}: {failed[0]}")
        saved, seq = saved + len(answers), seq + 1
    await client.aclose()
    return saved / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", help="server binary (default: the embedded choice)")
    ap.add_argument("--appendfsync", choices=["everysec", "always"], default="everysec")
    args = ap.parse_args()
    if args.server:
        os.environ[SERVER_ENV] = args.server
    with EmbeddedRedis(appendfsync=args.appendfsync) as server:
        print(f"server {find_redis_server()}, appendfsync {args.appendfsync}")
        for mode in ("ack", "fsync", "ack", "fsync"):
            print(f"{mode:6s} {asyncio.run(saves_per_s(server.url, mode)):8.0f} saves/s")


if __name__ == "__main__":
    main()
