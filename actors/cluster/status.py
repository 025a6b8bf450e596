"""What ``phaseline status`` shows of a live deployment, gathered from Ray and Redis.

Rates (checkpoints/s, tool calls/s) are the difference of two samples of the actors' counters
``sample_s`` apart, so one call takes that long.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from actors.cluster.info import HostInfo, ServiceInfo
from actors.cluster.refs import ServiceRef
from actors.cluster.runtime import Runtime
from store.domain.limiter import EndpointLimiter, EndpointState
from store.domain.pools import PoolSizes
from store.domain.usage import AgentUsage, agent_usage


@dataclass(frozen=True, slots=True)
class HostRow:
    """One TurnActor."""

    label: str
    """``host<N>`` or ``isolation``."""
    generation: int
    """Its generation in the slot (how often the slot was replaced)."""
    running: int
    """Turns it holds now."""
    finished: int
    """Turns it ended."""
    rss_mib: float
    """Its resident memory."""


@dataclass(frozen=True, slots=True)
class PoolRow:
    """One tool worker pool (one Ray resource shape)."""

    pool: str
    """Pool name (``default``, or the resource shape)."""
    resources: dict[str, float]
    """The Ray resources each of its workers holds."""
    size: int
    """Workers it has now."""
    queued: int
    """Calls waiting for it on the hosts."""
    running: int
    """Calls the hosts have running on it."""
    calls_per_s: float
    """Calls its workers finished per second over the sample."""


@dataclass(frozen=True, slots=True)
class MCPRow:
    """One MCP server as the workers of a pool hold it."""

    pool: str
    """The pool whose workers hold sessions with it."""
    server: str
    """Server name."""
    connected: int
    """Workers with an open session now."""
    starts: int
    """Sessions started so far, over the workers (more than the workers: restarts)."""


@dataclass(frozen=True, slots=True)
class AgentRow:
    """One agent's finished turns and their tokens (``store.domain.usage``)."""

    agent: str
    """Its import path."""
    turns: int
    """Finished turns."""
    prompt_tokens: int
    """Their prompt tokens."""
    completion_tokens: int
    """Their completion tokens."""
    cached_tokens: int
    """Of the prompt tokens, those served from the endpoint's cache."""
    unknown: int
    """Their lost incarnations and unmetered calls: calls whose tokens are not counted."""


@dataclass(frozen=True, slots=True)
class DeploymentStatus:
    """One screen of a deployment."""

    namespace: str
    """Its key namespace."""
    hosts: list[HostRow]
    """Its TurnActors."""
    phases: dict[str, int]
    """Running turns per phase."""
    in_progress: int
    """Turns in progress in Redis (also those no host runs right now)."""
    pools: list[PoolRow]
    """Its tool worker pools."""
    mcp: list[MCPRow] = field(default_factory=list)
    """MCP servers the workers hold sessions with."""
    models: list[EndpointState] = field(default_factory=list)
    """Model endpoints: calls waiting on each one's rate limit, its pause."""
    agents: list[AgentRow] = field(default_factory=list)
    """Agents with finished turns, and the tokens those used."""
    checkpoints_per_s: float = 0.0
    """Saves the CheckpointActor wrote per second over the sample."""
    respawns: int = 0
    """Hosts the Supervisor replaced so far."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _hello(ref: ServiceRef) -> ServiceInfo | None:
    try:
        return await ref.hello(5)
    except (TimeoutError, RayActorError):
        return None


async def deployment_status(rt: Runtime, *, sample_s: float = 1.0) -> DeploymentStatus:
    """Sample the deployment twice, ``sample_s`` apart."""
    dep = rt.dep
    sizes = await PoolSizes(rt.client, dep.keys, ttl_s=0).all()
    pools = dep.tool_pools()
    workers = {
        (pool, i): handle
        for pool in pools
        for i in range(sizes.get(pool, dep.settings.tools.workers))
        if (handle := rt.tool_worker(pool, i)) is not None
    }
    checkpoints = [a for role in dep.checkpoint_roles() if (a := rt.service(role))]

    async def sample() -> tuple[float, _Sample, int]:
        infos = await asyncio.gather(*(_hello(h) for h in workers.values()))
        saved = await asyncio.gather(*(_hello(a) for a in checkpoints))
        return (
            time.monotonic(),
            dict(zip(workers, infos, strict=True)),
            sum(s.counts.get("saves", 0) for s in saved if s is not None),
        )

    t0, before, saves0 = await sample()
    await asyncio.sleep(sample_s)  # the rate window
    t1, after, saves1 = await sample()
    span = max(t1 - t0, 1e-6)
    hosts = await rt.host_info(isolation=True)
    pool_rows = [
        PoolRow(
            pool=pool,
            resources=resources,
            size=sizes.get(pool, dep.settings.tools.workers),
            queued=sum(h.tool_queue.get(pool, 0) for h in hosts),
            running=sum(h.tool_inflight.get(pool, 0) for h in hosts),
            calls_per_s=round(_calls(pool, before, after) / span, 1),
        )
        for pool, resources in pools.items()
    ]
    return DeploymentStatus(
        namespace=dep.keys.namespace,
        hosts=[_host_row(dep.host_label(h.slot), h) for h in hosts],
        phases=await _phases(rt),
        in_progress=len(await rt.store.list_in_progress()),
        pools=pool_rows,
        mcp=_mcp_rows(after),
        models=await EndpointLimiter(rt.client, dep.keys).snapshot(),
        agents=[_agent_row(u) for u in await agent_usage(rt.client, dep.keys)],
        checkpoints_per_s=round((saves1 - saves0) / span, 1),
        respawns=await rt.respawns(),
    )


_Sample = dict[tuple[str, int], ServiceInfo | None]


async def _phases(rt: Runtime) -> dict[str, int]:
    """Running turns per phase, as each host's engine holds them now."""
    phases: Counter[str] = Counter()
    for host in (await rt.hosts.handles()).values():
        try:
            for transition in await host.phases(5):
                phases[transition.dst.value] += 1
        except (TimeoutError, RayActorError):
            continue
    return dict(sorted(phases.items()))


def _calls(pool: str, before: _Sample, after: _Sample) -> int:
    """Calls the pool's workers finished between the two samples."""
    done = 0
    for (p, i), info in after.items():
        if p == pool and info is not None:
            prev = before.get((p, i))
            done += info.counts.get("calls", 0) - (prev.counts.get("calls", 0) if prev else 0)
    return done


def _mcp_rows(sample: _Sample) -> list[MCPRow]:
    """Per pool and MCP server: its workers' open sessions and sessions started."""
    rows: dict[tuple[str, str], list[int]] = {}
    for (pool, _), info in sample.items():
        for session in info.mcp if info is not None else ():
            row = rows.setdefault((pool, session.server), [0, 0])
            row[0] += session.connected
            row[1] += session.starts
    return [MCPRow(p, s, c, n) for (p, s), (c, n) in sorted(rows.items())]


def _agent_row(u: AgentUsage) -> AgentRow:
    t = u.tokens
    return AgentRow(
        u.agent or "-",
        u.turns,
        t.prompt_tokens,
        t.completion_tokens,
        t.cached_tokens,
        u.lost_incarnations + u.unmetered_calls,
    )


def _host_row(label: str, info: HostInfo) -> HostRow:
    return HostRow(
        label=label,
        generation=info.generation,
        running=info.running,
        finished=info.finished,
        rss_mib=round(info.rss_bytes / 2**20, 1),
    )
