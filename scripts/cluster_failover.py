"""Kill a Redis Cluster primary under checkpoint saves and count acknowledged saves lost,
once per durability (``ack``: Redis answered; ``replicas:1``: ``WAIT 1`` after each batch).

    .venv/bin/python scripts/cluster_failover.py [--runs N] [--turns N] [--lag S --payload B]

``--lag S`` holds the primary's replica stopped for S seconds before the kill (a replica behind
a slow or cut link): the writes of that time are what asynchronous replication can lose.

Each run starts its own local cluster (three primaries, a replica each;
store.redis.embedded_cluster) and prints one JSON line per run
(actors.harness.failover.FailoverReport)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

from actors.harness.failover import failover_under_saves
from store.redis.embedded_cluster import EmbeddedCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per durability")
    parser.add_argument("--turns", type=int, default=48, help="concurrent writers")
    parser.add_argument("--lag", type=float, default=0.0, help="seconds the replica lags")
    parser.add_argument(
        "--unsent",
        type=int,
        default=0,
        help="under ack, hold the replica until the primary keeps this many bytes for it beyond"
        " its socket (under replicas:1 the writers wait for the replica and fill nothing)",
    )
    parser.add_argument("--payload", type=int, default=0, help="bytes of each save's message")
    args = parser.parse_args()
    for durability in ("ack", "replicas:1"):
        for _ in range(args.runs):
            with EmbeddedCluster() as cluster:
                report = asyncio.run(
                    failover_under_saves(
                        cluster,
                        durability=durability,
                        turns=args.turns,
                        lag_s=args.lag,
                        unsent_bytes=args.unsent if durability == "ack" else 0,
                        payload_bytes=args.payload,
                    )
                )
            print(json.dumps(dataclasses.asdict(report)), flush=True)


if __name__ == "__main__":
    main()
