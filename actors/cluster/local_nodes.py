"""A multi-node Ray cluster on this machine (Ray's own ``ray.cluster_utils.Cluster``: several
raylets, each its own node with its own resources), for ``--nodes N`` of the demo and the
chaos harness. The runtime joins it by its address exactly as it joins a real cluster; the
chaos target ``node`` removes a worker node (its raylet and every worker on it) and adds a
fresh one.
"""

from __future__ import annotations

import os
from types import TracebackType

from ray.cluster_utils import Cluster

from actors.cluster.joining import AUTH_MODE
from bus.errors import ConfigError

__all__ = ["NODE_HEALTH_CHECK", "LocalNodes"]

NODE_HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
"""How fast the head notices a dead raylet: Ray's defaults (3 s x 5 misses) took 21 s from a
node's loss to its turns running again in a chaos run; these ask for 1.5 s. The same
``_system_config`` (or ``ray start --system-config``) applies to a real cluster's head."""


class LocalNodes:
    """A head node and ``nodes - 1`` worker nodes of one CPU each."""

    def __init__(self, nodes: int, *, head_cpus: int = 2) -> None:
        if nodes < 2:
            raise ConfigError(f"a local multi-node cluster needs --nodes >= 2, got {nodes}")
        self.nodes = nodes
        self.head_cpus = head_cpus
        self._cluster: Cluster | None = None

    @property
    def address(self) -> str:
        """The GCS address to join (``ray.init(address=...)``, ``--ray-address``)."""
        if self._cluster is None:
            raise ConfigError("the local Ray cluster is not started")
        return str(self._cluster.address)

    def start(self) -> str:
        """Start every raylet; the cluster's address.

        The mode of Ray's authentication its raylets start with is said in this process's
        environment (``disabled`` unless set), so the runtime that joins the cluster by
        address keeps it (``actors.cluster.joining`` turns it to ``token`` when a token is at
        hand and nothing is said) and the nodes added later have it: a node started in token
        mode refuses every request of a head that sends no token (the GCS leased workers
        there every 200 ms for ten minutes, so a chaos run's replacement hosts and model
        workers never started), and a driver in token mode refuses the head's questions
        about the actors it owns."""
        os.environ.setdefault(AUTH_MODE, "disabled")
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": self.head_cpus,
                "include_dashboard": False,
                "_system_config": NODE_HEALTH_CHECK,
            },
        )
        for _ in range(self.nodes - 1):
            self.add_node()
        return self.address

    def add_node(self) -> str:
        """Start one more worker node; its node id."""
        if self._cluster is None:
            raise ConfigError("the local Ray cluster is not started")
        return str(self._cluster.add_node(num_cpus=1, include_dashboard=False).node_id)

    def worker_node_ids(self) -> list[str]:
        """Ids of the worker nodes alive now (the head is never a victim: it is the cluster)."""
        return sorted(str(n.node_id) for n in self._cluster.worker_nodes) if self._cluster else []

    def remove_node(self, node_id: str) -> None:
        """SIGKILL a worker node's raylet and every process on it."""
        if self._cluster is None:
            raise ConfigError("the local Ray cluster is not started")
        node = next((n for n in self._cluster.worker_nodes if n.node_id == node_id), None)
        if node is None:
            raise ConfigError(f"no worker node {node_id}")
        self._cluster.remove_node(node, allow_graceful=False)

    def stop(self) -> None:
        """Stop every raylet."""
        if self._cluster is not None:
            self._cluster.shutdown()  # type: ignore[no-untyped-call]
            self._cluster = None

    def __enter__(self) -> LocalNodes:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
