"""Run as ``python -m tests.support.fresh_node``: a local multi-node cluster whose driver joins
it with a Ray token at hand (as ``phaseline chaos --nodes`` does on a machine that ran Ray
once), then a node added as the chaos target ``node`` adds one; prints ``answered`` once an
actor pinned to the fresh node answers, ``refused`` if it does not within 30 s. Its own
process: the test process is already connected to the session's Ray cluster."""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.cluster.joining import ensure_ray
from actors.cluster.local_nodes import LocalNodes


class Probe:
    def hello(self) -> str:
        return "answered"


def main() -> None:
    with LocalNodes(2, head_cpus=1) as nodes:
        ensure_ray(nodes.address)
        try:
            fresh = nodes.add_node()
            pinned = NodeAffinitySchedulingStrategy(node_id=fresh, soft=False)
            probe = ray.remote(Probe).options(num_cpus=0, scheduling_strategy=pinned).remote()
            # owned by this driver (not detached, unlike the deployment's actors): the head
            # asks the driver about it too
            try:
                print(ray.get(probe.hello.remote(), timeout=30))
            except GetTimeoutError:
                print("refused")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
