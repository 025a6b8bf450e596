"""Where the Supervisor puts turn hosts on a multi-node Ray cluster.

* A slot's first host goes on node ``slot mod nodes`` of the alive nodes (sorted by id): the
  slots' hosts are spread over the nodes, so losing a node costs a fraction of the turns, not
  all of them. (Ray's ``SPREAD`` strategy put all three hosts of a test on one node: the
  actors take no resources, so every node looks equally free.)
* A slot's idle standby (the next generation, started in advance) goes on another node than the
  slot's active host: the node loss that kills the active host must not kill its replacement
  too. Ray has no anti-affinity for actors, so the standby gets a node affinity to a node
  chosen here. The affinity is hard: a soft one was ignored in a test (the standby landed
  beside its active host). A node that died before the standby started makes that standby
  fail; the slot's next replacement is then placed afresh.
* The singletons (Supervisor, CheckpointActor, WatchdogActor, RecoveryActor) prefer the head
  node (:func:`singleton_strategy`, a *soft* affinity) and restart anywhere
  (``max_restarts=-1``). The head runs the GCS, so losing it loses the cluster (short of GCS
  fault tolerance, where a soft affinity lets them restart on any node); on a worker node they
  would die with it, and every turn of the deployment would wait for their restart, not only
  the turns of the lost hosts. They take no CPU, so a head started with ``--num-cpus 0`` still
  holds them.

The choice is pure (:func:`standby_node`) so it is tested without Ray; :func:`alive_nodes` and
:func:`strategy` are the Ray side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = [
    "alive_nodes",
    "head_node",
    "host_node",
    "singleton_strategy",
    "standby_node",
    "strategy",
]


def host_node(nodes: Sequence[str], slot: int) -> str | None:
    """The node a slot's first host should run on (None: no node is known)."""
    ordered = sorted(nodes)
    return ordered[slot % len(ordered)] if ordered else None


def standby_node(nodes: Sequence[str], active: str, slot: int) -> str | None:
    """The node a slot's standby should run on: not ``active``'s, chosen by slot so standbys
    spread over the other nodes; None when no other node is alive."""
    others = sorted(n for n in nodes if n != active)
    return others[slot % len(others)] if others else None


def alive_nodes() -> list[str]:
    """Hex ids of the Ray nodes alive now."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]


def strategy(node: str | None) -> Any:
    """The scheduling strategy of a host: on ``node``, or (None) wherever Ray likes."""
    if node is None:
        return "DEFAULT"
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def head_node() -> str | None:
    """Hex id of the alive head node (Ray gives it the ``node:__internal_head__`` resource)."""
    for n in ray.nodes():  # type: ignore[no-untyped-call]
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
            return str(n["NodeID"])
    return None


def singleton_strategy() -> Any:
    """Where a singleton starts (and restarts): on the head node if it can, else anywhere."""
    head = head_node()
    if head is None:
        return "DEFAULT"
    return NodeAffinitySchedulingStrategy(node_id=head, soft=True)
