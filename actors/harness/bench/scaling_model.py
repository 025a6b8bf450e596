"""The scaling model of docs/SCALING.md: from measured unit costs to a deployment's size.

Pure arithmetic (no Ray, no Redis), so it is tested alone and the same function both sizes the
large deployments in docs/SCALING.md and predicts what this machine does, which the
``unit_costs`` bench figure then measures (:func:`predict_rounds_per_s`).

The model's premise: a turn spends its life waiting on the model, so what it costs the cluster
is a fixed amount of work per *round* (one model call and the tool batch it asks for), and a
deployment of ``T`` concurrent turns, each making a round every ``round_s`` seconds, must do
``T / round_s`` rounds a second. Each kind of process is one event loop, so it can use at most
one core: hosts are added freely, but a deployment has one CheckpointActor per checkpoint
shard and one redis-server per Redis shard, and those are the ceilings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Hardware", "Sizing", "UnitCosts", "Workload", "predict_rounds_per_s", "size"]


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitCosts:
    """What one round costs each part of a deployment (the ``unit_costs`` bench figure)."""

    host_cpu_ms: float
    """CPU milliseconds of the TurnActor per round: the loop, phase events, encoding saves,
    the ledger's compare-and-sets, dispatching tool calls."""
    checkpoint_cpu_ms_per_save: float
    """CPU milliseconds of the CheckpointActor per save (framing checks, the save scripts)."""
    redis_cpu_ms: float
    """CPU milliseconds of redis-server per round: every command a round sends (saves, ledger,
    inbox, events, leases)."""
    tool_cpu_ms_per_call: float
    """CPU milliseconds of a ToolWorker per call, for the built-in ``echo`` tool: the runtime's
    own overhead per call (a real tool adds its own work)."""
    other_cpu_ms: float
    """CPU milliseconds per round of everything else (Supervisor, WatchdogActor,
    RecoveryActor, the submitting driver)."""
    saves_per_round: float
    """Checkpoints per round (one per tool batch, plus a turn's first and final)."""
    calls_per_round: float
    """Tool calls per round."""
    host_bytes_per_turn: float
    """Host memory per concurrent turn, its transcript included."""
    redis_bytes_per_turn: float
    """Redis memory per turn (record, bodies, spec, ledger, its share of the streams)."""

    @property
    def cpu_ms_per_round(self) -> float:
        """Every process's CPU per round, together."""
        return (
            self.host_cpu_ms
            + self.checkpoint_cpu_ms_per_save * self.saves_per_round
            + self.redis_cpu_ms
            + self.tool_cpu_ms_per_call * self.calls_per_round
            + self.other_cpu_ms
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What the deployment must carry."""

    turns: int
    """Concurrent turns."""
    round_s: float = 5.0
    """Seconds between a turn's rounds: a model call of a few seconds and its tool batch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """The machines a deployment is sized for."""

    node_cores: int = 16
    """Cores of a Ray worker node."""
    node_memory_gib: float = 64.0
    """Memory of a Ray worker node."""
    redis_memory_gib: float = 25.0
    """Memory one Redis shard may hold (a primary; its replica mirrors it)."""
    headroom: float = 0.7
    """Share of a core, or of memory, a process may be planned to use (the rest absorbs bursts
    and recoveries)."""


@dataclass(frozen=True, slots=True)
class Sizing:
    """A deployment sized for one workload."""

    turns: int
    """Concurrent turns."""
    rounds_per_s: float
    """Rounds the deployment does a second."""
    saves_per_s: float
    """Checkpoints a second."""
    hosts: int
    """TurnActor processes (each under ``headroom`` of a core)."""
    checkpoint_actors: int
    """CheckpointActors (checkpoint shards)."""
    redis_shards: int
    """Redis primaries."""
    nodes: int
    """Ray worker nodes for the hosts, CheckpointActors, tool workers and the rest."""
    bottleneck: str
    """What a deployment of one CheckpointActor and one Redis runs out of first."""
    turns_per_checkpoint_actor: int
    """Concurrent turns one CheckpointActor carries."""
    turns_per_redis_shard: int
    """Concurrent turns one Redis primary carries (CPU or memory, whichever is first)."""


def size(costs: UnitCosts, work: Workload, hw: Hardware = Hardware()) -> Sizing:
    """How many of each process a workload needs on ``hw``."""
    rounds = work.turns / work.round_s
    saves = rounds * costs.saves_per_round
    host_cores = rounds * costs.host_cpu_ms / 1000
    host_memory = work.turns * costs.host_bytes_per_turn
    node_memory = hw.node_memory_gib * 2**30 * hw.headroom
    hosts = max(1, math.ceil(host_cores / hw.headroom))
    ckpt_cores = saves * costs.checkpoint_cpu_ms_per_save / 1000
    checkpoint_actors = max(1, math.ceil(ckpt_cores / hw.headroom))
    redis_cpu = rounds * costs.redis_cpu_ms / 1000
    redis_memory = work.turns * costs.redis_bytes_per_turn
    redis_shards = max(
        1,
        math.ceil(redis_cpu / hw.headroom),
        math.ceil(redis_memory / (hw.redis_memory_gib * 2**30 * hw.headroom)),
    )
    cores = (
        host_cores
        + ckpt_cores
        + rounds * costs.calls_per_round * costs.tool_cpu_ms_per_call / 1000
        + rounds * costs.other_cpu_ms / 1000
    )
    nodes = max(
        1,
        math.ceil(cores / (hw.node_cores * hw.headroom)),
        math.ceil(host_memory / node_memory),
    )
    per_ckpt = _turns_per_unit(costs.checkpoint_cpu_ms_per_save * costs.saves_per_round, work, hw)
    per_redis = min(
        _turns_per_unit(costs.redis_cpu_ms, work, hw),
        int(hw.redis_memory_gib * 2**30 * hw.headroom / costs.redis_bytes_per_turn),
    )
    bottleneck = "the CheckpointActor" if per_ckpt <= per_redis else "Redis"
    return Sizing(
        work.turns,
        round(rounds, 1),
        round(saves, 1),
        hosts,
        checkpoint_actors,
        redis_shards,
        nodes,
        bottleneck,
        per_ckpt,
        per_redis,
    )


def _turns_per_unit(cpu_ms_per_round: float, work: Workload, hw: Hardware) -> int:
    """Concurrent turns one single-threaded process carries at ``headroom`` of its core."""
    if cpu_ms_per_round <= 0:
        return 10**12
    return int(hw.headroom * 1000 / cpu_ms_per_round * work.round_s)


def predict_rounds_per_s(
    costs: UnitCosts, *, cores: float, hosts: int, checkpoint_actors: int = 1, redis_shards: int = 1
) -> tuple[float, str]:
    """Rounds a second a CPU-bound deployment reaches on ``cores`` cores, and what limits it:
    all cores busy, or one kind of single-threaded process at a full core."""
    limits = {
        "all cores": cores * 1000 / costs.cpu_ms_per_round,
        "the hosts": hosts * 1000 / costs.host_cpu_ms,
        "the CheckpointActor": checkpoint_actors
        * 1000
        / (costs.checkpoint_cpu_ms_per_save * costs.saves_per_round),
        "Redis": redis_shards * 1000 / costs.redis_cpu_ms,
    }
    what = min(limits, key=lambda k: limits[k])
    return limits[what], what
