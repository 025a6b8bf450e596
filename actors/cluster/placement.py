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
* The singletons (Supervisor, CheckpointActor, WatchdogActor, RecoveryActor) run on the head
  node (:func:`singleton_options`) and are restarted there (``max_restarts=-1``). The head runs
  the GCS, so losing it loses the cluster anyway (with GCS fault tolerance, the restarted head
  takes them back); on a worker node they would die with it, and every turn of the deployment
  would wait for their restart, not only the turns of the lost hosts (a chaos run found the
  Supervisor restarted three times in seven node losses). They take no CPU, so a head started
  with ``--num-cpus 0`` still holds them.

The choice is pure (:func:`standby_node`) so it is tested without Ray; :func:`alive_nodes` and
:func:`strategy` are the Ray side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

__all__ = [
    "HEAD_RESOURCE",
    "alive_nodes",
    "host_node",
    "singleton_options",
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


HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node alone (a head that GCS fault tolerance restarts has it
too, where a node-id affinity would name the dead one)."""


def singleton_options() -> dict[str, Any]:
    """Ray options that put a singleton (and its restarts) on the head node. A soft node
    affinity to the head was not honoured in a test (the CheckpointActor started on a worker
    node), so the singletons ask for a sliver of the head's own resource instead: 0.0001, Ray's
    smallest unit, so the head's 1.0 holds 10,000 of them."""
    return {"resources": {HEAD_RESOURCE: 0.0001}}
