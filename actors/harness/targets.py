"""What a chaos fault can hit (:class:`ChaosTarget`), what each needs of the run, and reading
the ``--targets`` flag."""

from __future__ import annotations

from enum import StrEnum

from bus.errors import ConfigError

__all__ = [
    "CLUSTER_ONLY",
    "EMBEDDED_ONLY",
    "HTTP_ONLY",
    "LOCAL_ONLY",
    "NODES_ONLY",
    "TARGETS",
    "WITNESSED",
    "ChaosTarget",
    "parse_targets",
]


class ChaosTarget(StrEnum):
    """What a fault hits."""

    HOST = "host"
    """SIGKILL a turn host."""
    TOOL = "tool"
    """SIGKILL a tool worker."""
    MODEL = "model"
    """SIGKILL a model worker (the generations it runs are lost and asked again)."""
    CHECKPOINT = "checkpoint"
    """SIGKILL a CheckpointActor."""
    WATCHDOG = "watchdog"
    """SIGKILL the WatchdogActor."""
    RECOVERY = "recovery"
    """SIGKILL the RecoveryActor."""
    SUPERVISOR = "supervisor"
    """SIGKILL the Supervisor."""
    REDIS = "redis"
    """Restart the embedded Redis (SIGKILL, then start it on its AOF)."""
    FREEZE = "freeze"
    """SIGSTOP a turn host until it is replaced."""
    CONCURRENT_RESUME = "concurrent_resume"
    """Resume a few turns of one host from this process too, as a second resumer would."""
    POWER_LOSS = "power_loss"
    """Cut the embedded Redis off as a power loss would: what was not fsynced is lost."""
    NODE = "node"
    """Remove a whole Ray worker node, then add a fresh one."""
    REDIS_FAILOVER = "redis_failover"
    """SIGKILL a Redis Cluster primary; its replica takes over."""
    PROVIDER = "provider"
    """A storm at the model endpoint, through a fault proxy in front of it: 429s with
    ``retry-after``, 529s, 5xx, replies cut mid-way, hangs, a dead endpoint
    (``actors.harness.provider_proxy``), and a latency on every call while the run lasts."""
    PARTITION = "partition"
    """Cut one host's link to Redis, or to the model endpoint, for a few seconds, then restore
    it (``actors.harness.tcp_proxy``): the rest of the deployment keeps its links."""
    BAD_INPUT = "bad_input"
    """Submit a turn whose tools raise what is not an ``Exception`` (each call must fail alone,
    the turn answer, nothing go down); ``phaseline chaos`` also probes a console on the run's
    Redis (a rebound Host, a cross-site form, no token, an approval before its question)."""


TARGETS = tuple(ChaosTarget)

#: Targets that need the embedded server (they kill and restart it).
EMBEDDED_ONLY = (ChaosTarget.REDIS, ChaosTarget.POWER_LOSS)

#: Targets that need a local multi-node Ray cluster (``--nodes N``): they remove a node.
NODES_ONLY = (ChaosTarget.NODE,)

#: Targets that need the embedded Redis Cluster (``--redis-cluster``): they kill a primary.
CLUSTER_ONLY = (ChaosTarget.REDIS_FAILOVER,)

#: Targets that put proxies on this machine between the hosts and what they reach: the hosts
#: must run here too (a private Ray or ``--nodes``, not ``--ray-address``), on one Redis server
#: (a cluster's clients follow its nodes' own addresses, around any proxy).
LOCAL_ONLY = (ChaosTarget.PROVIDER, ChaosTarget.PARTITION)

#: Targets that need the turns' model to be an HTTP endpoint named by ``OPENAI_BASE_URL``
#: (an agent, not a scenario's in-process scripted model).
HTTP_ONLY = (ChaosTarget.PROVIDER,)

#: Targets whose side effects are counted on a witness server: they can lose Redis writes.
WITNESSED = (ChaosTarget.POWER_LOSS, ChaosTarget.REDIS_FAILOVER)


def parse_targets(
    spec: str,
    *,
    embedded: bool,
    nodes: bool = False,
    cluster: bool = False,
    local: bool = True,
    http: bool = False,
) -> tuple[ChaosTarget, ...]:
    """``all``, ``none`` (no fault but the poison turns' own), or a comma-separated list.
    ``embedded``: the run owns its one Redis server; ``nodes``: it owns a local multi-node Ray
    cluster; ``cluster``: it owns a local Redis Cluster; ``local``: its hosts run on this
    machine; ``http``: its turns call a model endpoint over HTTP. ``all`` leaves out what the
    run cannot do; a list naming it is refused."""
    if spec == "none":
        return ()
    every = spec in ("all", "")
    given = () if every else tuple(t.strip() for t in spec.split(",") if t.strip())
    unknown = sorted(set(given) - {t.value for t in TARGETS})
    if unknown:
        raise ConfigError(f"unknown chaos targets {unknown}; choose from {', '.join(TARGETS)}")
    names = TARGETS if every else tuple(ChaosTarget(t) for t in given)
    for needed, have, why in (
        (EMBEDDED_ONLY, embedded, "restart the embedded server; drop --redis-url for them"),
        (NODES_ONLY, nodes, "remove a Ray node; run with --nodes 2 or more (no --ray-address)"),
        (CLUSTER_ONLY, cluster, "kill a Redis Cluster primary; run with --redis-cluster"),
        (
            LOCAL_ONLY,
            local and not cluster,
            "put proxies on this machine in front of the "
            "hosts' Redis and model; run without --ray-address and --redis-cluster",
        ),
        (
            HTTP_ONLY,
            http,
            "stand in front of a model endpoint; run an agent whose model reads "
            "OPENAI_BASE_URL (--agent), not a scenario",
        ),
    ):
        needs = [t for t in names if t in needed]
        if needs and not have:
            if not every:
                raise ConfigError(f"targets {needs} {why}")
            names = tuple(t for t in names if t not in needed)
    return names
