#!/usr/bin/env python3
"""Saves/s of the checkpoint store under each durability mode (the bench's durability_modes
figure on its own):

    .venv/bin/python scripts/durability_saves.py [--appendfsync everysec|always] [--seconds S]

Starts a primary and a replica, then runs ack, fsync and replicas:1 in alternating rounds;
prints the JSON of ``actors.harness.bench.durability_modes``. ``$PHASELINE_REDIS_SERVER`` picks the
server binary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.harness.bench.durability_modes import durability_modes
from store.redis.embedded import find_redis_server


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--appendfsync", choices=["everysec", "always"], default="always")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    figure = asyncio.run(
        durability_modes(appendfsync=args.appendfsync, seconds=args.seconds, reps=args.reps)
    )
    print(json.dumps({"server": find_redis_server(), **figure}, indent=2))


if __name__ == "__main__":
    main()
