"""The Supervisor: detached, restartable, stateless (everything it knows is in Redis or Ray).

Every ``ping_interval_s`` it makes sure the singleton services exist (CheckpointActor,
WatchdogActor, RecoveryActor, each restarted by Ray on death) and checks every host slot:

* a host that is gone (``RayActorError``, or no actor under its name) is replaced at once: a
  call parked on each host fails the moment Ray sees its process die, which triggers the
  check without waiting for the next ping;
* a host whose lease has lapsed (``store.domain.leases``: it renews it from its own event loop, so a
  hung or SIGSTOPped host stops) and that does not answer one ping is replaced too, about
  ``lease_ttl_s`` after it stopped; an unanswered ping alone (a busy host) replaces nothing;
* a host that answers its ping but is cut off from Redis (it says it has not reached Redis
  for ``cut_off_s``, its lease has lapsed, and a renewal asked for now fails, while the
  Supervisor itself reads Redis) is replaced as well: its turns go on on its successor, and
  what it sends when its link returns is fenced. After Redis itself was away, every host's
  renewal asked for now succeeds and nothing is replaced;
* a replacement is a new *generation* (a new named actor), already started as an idle standby
  when the previous one was spawned (``standby``). It is recorded in Redis, asked to
  adopt every in-progress turn of its slot (each resumed from its last checkpoint under a new
  epoch, so the old incarnation is fenced), and the old actor is killed, best effort;
* the isolation host (``Deployment.isolation_slot``, after the shared slots) is watched and
  replaced the same way; its successor is told whether it died (then the turn it ran alone
  counts that death, ``actors.turn.poison``) or stopped answering (a freeze counts nothing);
* a host incarnation seen for the first time (e.g. after a restart of the whole deployment)
  is asked to adopt as well, so turns left by a previous run are finished; every live host
  is asked again each ``adopt_interval_s``, so no in-progress turn stays orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import ray
from ray.exceptions import RayActorError

from actors.cluster.checkpoint_actor import CheckpointActor
from actors.cluster.deployment import Deployment, HostDirectory, worker_options
from actors.cluster.info import HostInfo, ServiceInfo, SupervisorInfo, this_node
from actors.cluster.joining import ray_cluster_id
from actors.cluster.metrics import metrics
from actors.cluster.model_workers import ModelWorker
from actors.cluster.placement import (
    alive_nodes,
    host_node,
    singleton_options,
    standby_node,
    strategy,
)
from actors.cluster.recovery_actor import RecoveryActor
from actors.cluster.refs import (
    RAY_NAMESPACE,
    ActorRef,
    HostRef,
    RayActor,
    ServiceRef,
    ToolWorkerRef,
    spawn,
)
from actors.cluster.tool_workers import ToolWorker
from actors.cluster.turn_actor import TurnActor
from actors.cluster.watchdog_actor import WatchdogActor
from actors.turn.autoscale import PoolLoad, ScaleRule, next_size
from bus.errors import PhaselineError
from store.domain.leases import HostLeases
from store.domain.limiter import EndpointLimiter
from store.domain.ownership import Holder, NamespaceOwner
from store.domain.pools import PoolSizes
from store.domain.usage import agent_usage
from store.redis.failures import translated

log = logging.getLogger(__name__)

#: How often the supervisor sets the deployment-wide gauges (Ray reports metrics every 10 s).
METRICS_PERIOD_S = 5.0


def services(dep: Deployment) -> dict[str, type[RayActor]]:
    """The service actors of a deployment by role: its CheckpointActors, the WatchdogActor and
    the RecoveryActor."""
    return {
        **dict.fromkeys(dep.checkpoint_roles(), CheckpointActor),
        "watchdog": WatchdogActor,
        "recovery": RecoveryActor,
    }


class Supervisor:
    """Keeps a deployment's actors alive (see the module's docstring)."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,
        "max_restarts": -1,  # stateless: a restarted one boots itself from Redis and Ray
        "max_task_retries": -1,
    }

    def __init__(self, deployment_json: str, owner: Sequence[str] = ()) -> None:
        """``owner``: the namespace's claim this deployment was started under
        (:meth:`Holder.wire`), written back if its lease lapsed before the first renewal
        here (a slow start: the claim's time to live runs from the claim, not from the
        Supervisor's boot)."""
        self.dep = Deployment.from_wire(deployment_json)
        self.client = self.dep.connect(max_connections=8)
        self.hosts = HostDirectory(self.dep, self.client)
        self._adopted: set[str] = set()
        self.leases = HostLeases(
            self.client, self.dep.keys, ttl_s=self.dep.settings.supervisor.lease_ttl_s
        )
        self._last_adopt: dict[int, float] = defaultdict(float)
        self._adopting: dict[int, asyncio.Future[None]] = {}
        self._locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._parked: dict[int, tuple[int, asyncio.Future[None]]] = {}
        self._standbys: dict[int, tuple[int, asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._lost = ""
        """Why this deployment stopped itself ("": it did not): its namespace was taken."""
        self.pools = PoolSizes(self.client, self.dep.keys, ttl_s=0)
        self._load: dict[int, HostInfo] = {}
        """The latest ``hello`` of each slot's host (its tool queue and calls in flight)."""
        self.owners = NamespaceOwner(
            self.client, self.dep.keys, ttl_s=self.dep.settings.supervisor.owner_ttl_s
        )
        self._cluster = ray_cluster_id()
        self._holder: Holder | None = Holder.parse(self.dep.keys.owner(), owner) if owner else None
        """The namespace's holder as last read (this cluster's), written back if it lapses."""
        self._resized: dict[str, float] = defaultdict(float)
        self._busy_at: dict[str, float] = defaultdict(time.monotonic)
        # Boot itself, also after Ray restarted it: nobody else may be around to ask.
        ray.get_runtime_context().current_actor.ensure.remote()

    # -- public -------------------------------------------------------------------------------

    async def ensure(self) -> dict[str, Any]:
        """Bring the deployment up (idempotent) and keep watching it."""
        await self._reconcile()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._watch())
        return await self.hello()

    async def hello(self) -> dict[str, Any]:
        with translated("read supervisor stats"):
            respawns = await self.client.hget(self.dep.keys.supervisor(), "respawns")
        return SupervisorInfo(
            pid=os.getpid(),
            hosts=self.dep.hosts,
            respawns=int(respawns or 0),
            watching=self._task is not None and not self._task.done(),
            deployment=self.dep.to_wire(),
            node_id=this_node(),
            lost=self._lost,
        ).wire()

    async def stop(self) -> None:
        """Kill every actor of the deployment (not the supervisor itself)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        # The hosts by the names Ray has, not by the generations in Redis: after a takeover
        # those are another deployment's, and this one's hosts would be left running.
        for name in ray.util.list_named_actors(all_namespaces=True):
            if name["namespace"] == RAY_NAMESPACE and self.dep.is_host_name(name["name"]):
                _kill(name["name"])
        for role in services(self.dep):
            _kill(self.dep.name(role))
        for name in self.dep.model_worker_names():
            _kill(name)
        _lo, hi = self.dep.settings.tools.bounds()
        for pool in self.dep.tool_pools():
            for i in range(hi):
                _kill(self.dep.tool_worker_name(pool, i))

    # -- the watch ----------------------------------------------------------------------------

    async def _watch(self) -> None:
        reported = renewed = 0.0
        while not self._stopping:
            await asyncio.sleep(self.dep.settings.supervisor.ping_interval_s)  # watch period
            try:
                if time.monotonic() - renewed >= self.dep.settings.supervisor.owner_ttl_s / 4:
                    renewed = time.monotonic()
                    if not await self._hold_namespace():
                        return
                await self._reconcile()
                if time.monotonic() - reported >= METRICS_PERIOD_S:
                    reported = time.monotonic()
                    await self._report()
            except (PhaselineError, RayActorError) as exc:
                log.warning("supervisor: %s; retrying", exc)

    async def _hold_namespace(self) -> bool:
        """Renew the namespace's lease for this Ray cluster; if another cluster has taken the
        namespace (this one's lease lapsed, Redis was away too long), stop this deployment:
        two would run the same turns. False when stopped."""
        holder = await self.owners.holder()
        if holder is not None and holder.cluster == self._cluster:
            self._holder = holder
        if await self.owners.renew(self._cluster, self._holder):
            return True
        holder = await self.owners.holder()  # who took it: read after the refusal, not before
        self._lost = (
            f"namespace {self.dep.keys.namespace!r} is now held by "
            f"{holder.line() if holder else 'another cluster'}"
        )
        log.error("%s; stopping this deployment (Ray cluster %s)", self._lost, self._cluster)
        await self.stop()
        return False

    async def _report(self) -> None:
        """The gauges of what the store counts for the whole deployment: model endpoints'
        lines and pauses, agents' tokens. One process sets them, so they are not summed over
        hosts."""
        m = metrics()
        for ep in await EndpointLimiter(self.client, self.dep.keys).snapshot():
            tags = {"endpoint": ep.label}
            m.model_waiting.set(ep.waiting, tags=tags)
            m.model_in_flight.set(ep.in_flight, tags=tags)
            m.model_paused.set(ep.paused_s, tags=tags)
        for usage in await agent_usage(self.client, self.dep.keys):
            agent = usage.agent or "-"
            m.agent_turns.set(usage.turns, tags={"agent": agent})
            t = usage.tokens
            for kind, n in (
                ("prompt", t.prompt_tokens),
                ("completion", t.completion_tokens),
                ("cached", t.cached_tokens),
            ):
                m.agent_tokens.set(n, tags={"agent": agent, "kind": kind})

    async def _reconcile(self) -> None:
        cfg = self.dep.settings.supervisor
        refs = [
            ServiceRef(spawn(cls, self.dep.name(role), self.dep.to_wire(), **singleton_options()))
            for role, cls in services(self.dep).items()
        ]
        await self._scale_pools()
        self._model_workers()
        await asyncio.gather(
            *(_ping(r, cfg.ping_timeout_s) for r in refs),  # also starts the watchdog loop
            *(self._check_slot(slot) for slot in self.dep.slots()),
        )

    async def _scale_pools(self) -> None:
        """Each pool: resize it by the hosts' reported load (``actors.turn.autoscale``), make
        sure its workers run, and drain then kill the ones past its size."""
        tools = self.dep.settings.tools
        lo, hi = tools.bounds()
        rule = ScaleRule(lo, hi, tools.scale_interval_s, tools.idle_s)
        sizes = await self.pools.all(fresh=True)
        now = time.monotonic()
        for pool, resources in self.dep.tool_pools().items():
            size = sizes.get(pool, tools.workers)
            load = PoolLoad(
                queued=sum(h.tool_queue.get(pool, 0) for h in self._load.values()),
                running=sum(h.tool_inflight.get(pool, 0) for h in self._load.values()),
            )
            if load.queued or load.running:
                self._busy_at[pool] = now
            new = next_size(
                size,
                load,
                rule,
                since_resize_s=now - self._resized[pool],
                idle_for_s=now - self._busy_at[pool],
            )
            for i in range(new):  # started before hosts may route to them
                self._tool_worker(pool, i, resources)
            if new != size or pool not in sizes:
                log.info("tool pool %s: %d -> %d workers (%s)", pool, size, new, load)
                await self.pools.set(pool, new)
                self._resized[pool] = now
            if now - self._resized[pool] > 2.5:  # hosts have read the size (1 s cache)
                for i in range(new, hi):
                    await _retire(self.dep.tool_worker_name(pool, i))

    def _model_workers(self) -> None:
        """Make sure the model workers run (Ray restarts a dead one in place; this starts
        the ones never started). The isolation worker is started by the first host that
        needs it (``actors.cluster.model_lines``): most deployments never do, and a process
        each deployment starts for nothing costs it a second of CPU."""
        if self.dep.settings.models.remote:
            for i in range(self.dep.settings.models.workers):
                spawn(ModelWorker, self.dep.model_worker_name(i), self.dep.to_wire())

    def _tool_worker(self, pool: str, index: int, resources: dict[str, float]) -> None:
        name = self.dep.tool_worker_name(pool, index)
        spawn(ToolWorker, name, self.dep.to_wire(), **worker_options(resources))

    async def _check_slot(self, slot: int) -> None:
        """One check at a time per slot (the watch loop and a death notice may both ask)."""
        async with self._locks[slot]:
            await self._check_slot_now(slot, (await self.hosts.generations()).get(slot))

    async def _check_slot_now(self, slot: int, gen: int | None) -> None:
        cfg = self.dep.settings.supervisor
        if gen is None:
            await self._spawn(slot, 0, node=host_node(alive_nodes(), slot))
            return
        handle = await self.hosts.handle(slot, gen)
        info = None if handle is None else await _ping(handle, cfg.ping_timeout_s)
        if handle is None or not isinstance(info, HostInfo):
            dead = handle is None or not await handle.alive()
            if dead or not await self.leases.held(slot, gen):
                why = "died" if dead else "stopped: its lease lapsed and it does not answer"
                log.warning("host slot %d gen %d %s: replacing", slot, gen, why)
                await self._replace(slot, gen, handle, died=dead)
            return
        if info.store_silent_s >= cfg.cut_off_s and await self._cut_off(slot, gen, handle):
            log.warning(
                "host slot %d gen %d has not reached Redis for %.1f s: replacing",
                slot,
                gen,
                info.store_silent_s,
            )
            await self._replace(slot, gen, handle, died=False)
            return
        self._park(slot, gen, handle)
        now = time.monotonic()
        self._load[slot] = info
        self._watch_standby(slot, gen + 1, info.node_id)
        fresh = info.incarnation not in self._adopted
        if fresh or now - self._last_adopt[slot] > cfg.adopt_interval_s:
            # Also periodically: a turn in progress in Redis that its live host does not run
            # (its task was cut short by a Redis failure, a lost call) is picked up again.
            self._adopt_aside(slot, handle, info.incarnation)

    def _adopt_aside(self, slot: int, handle: HostRef, incarnation: str) -> None:
        """Ask a live host to adopt its slot's orphans, without waiting for it here: a host
        whose Redis link hangs answers late, and the watch must go on meanwhile (to replace
        that very host if it is cut off). One such call per slot at a time."""
        pending = self._adopting.get(slot)
        if pending is not None and not pending.done():
            return

        async def adopt() -> None:
            try:
                await handle.adopt(False)  # no death to report: this host was alive
            except (PhaselineError, RayActorError) as exc:
                log.warning("host slot %d did not adopt: %s", slot, exc)
                return
            self._adopted.add(incarnation)
            self._last_adopt[slot] = time.monotonic()

        self._adopting[slot] = asyncio.ensure_future(adopt())

    async def _spawn(
        self,
        slot: int,
        generation: int,
        *,
        predecessor_died: bool = False,
        node: str | None = None,
    ) -> HostRef:
        """Make ``generation`` the slot's host (the standby started for it, else a new one on
        ``node``) and start the next generation's standby on another node."""
        handle = self._host(slot, generation, node=node)
        info = await handle.hello()
        await self.leases.renew(slot, generation)  # granted here; the host renews it from now
        await self.hosts.set_generation(slot, generation)
        self._park(slot, generation, handle)
        await handle.adopt(predecessor_died)
        self._adopted.add(info.incarnation)
        self._last_adopt[slot] = time.monotonic()
        # The next generation, started now and idle until it is needed: replacing a dead host
        # then costs no process start and no imports. On another node than this one, so one
        # node's loss does not take both (actors.cluster.placement).
        self._watch_standby(slot, generation + 1, info.node_id)
        return handle

    def _watch_standby(self, slot: int, generation: int, active_node: str) -> None:
        """Keep the slot's standby (``generation``, the next one) alive: started if it is not
        there, watched by a parked call, started again on another node than ``active_node``
        if it dies while its slot still waits on it. Once per generation, so a Supervisor
        that restarted watches the standbys its predecessor started, with no polling."""
        if not self.dep.settings.supervisor.standby:
            return
        watched = self._standbys.get(slot)
        if watched is not None and watched[0] == generation and not watched[1].done():
            return
        task = asyncio.ensure_future(self._keep_standby(slot, generation, active_node))
        self._standbys[slot] = (generation, task)

    async def _keep_standby(self, slot: int, generation: int, active_node: str) -> None:
        backoff = 0.5
        while not self._stopping:
            node = standby_node(alive_nodes(), active_node, slot)
            standby = self._host(slot, generation, node=node)  # the live one, or a new one
            with contextlib.suppress(RayActorError):
                await standby.park()
            if self._stopping or (await self.hosts.generations()).get(slot) != generation - 1:
                return  # promoted (its own watch is the active host's now), or superseded
            # It died with a node other than its active host's: without it, the slot's next
            # loss would wait for a process start (1.4 s more in a chaos run).
            log.warning("host slot %d: standby gen %d died; starting it again", slot, generation)
            # Backoff: Ray frees a dead actor's name only after its death is processed, and
            # lists a lost node as alive until its health check gives up (a standby placed there
            # dies at once), so a tight retry would churn actors for nothing.
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 8.0)

    def _host(self, slot: int, generation: int, *, node: str | None = None) -> HostRef:
        """The slot's host of ``generation``: the one that exists, or a new one on ``node``,
        else wherever Ray places it."""
        name = self.dep.host_name(slot, generation)
        wire = self.dep.to_wire()
        return HostRef(
            spawn(TurnActor, name, wire, slot, generation, scheduling_strategy=strategy(node))
        )

    def _park(self, slot: int, generation: int, handle: HostRef) -> None:
        """Keep a call parked on the slot's host; its failure is the death notice."""
        parked = self._parked.get(slot)
        if parked is not None and parked[0] == generation and not parked[1].done():
            return
        self._parked[slot] = (generation, asyncio.ensure_future(self._on_death(slot, handle)))

    async def _on_death(self, slot: int, handle: HostRef) -> None:
        with contextlib.suppress(RayActorError):
            await handle.park()
        if not self._stopping:
            try:
                await self._check_slot(slot)
            except (PhaselineError, RayActorError) as exc:
                log.warning("supervisor: %s; the watch loop retries", exc)

    async def _cut_off(self, slot: int, gen: int, handle: HostRef) -> bool:
        """Whether a host that answers Ray cannot reach Redis while this process can: its
        lease read here has lapsed, and it fails to renew it now."""
        if await self.leases.held(slot, gen):
            return False
        try:
            return not await handle.reach_store(self.dep.settings.supervisor.ping_timeout_s)
        except (TimeoutError, RayActorError):
            return False  # slow or dying: the next check sees which

    async def _replace(
        self, slot: int, generation: int, old: HostRef | None, *, died: bool
    ) -> None:
        await self._spawn(slot, generation + 1, predecessor_died=died)
        with translated("count respawns"):
            await self.client.hincrby(self.dep.keys.supervisor(), "respawns", 1)
        if old is not None and self.dep.settings.supervisor.kill_replaced:
            old.kill()


async def _ping(ref: HostRef | ServiceRef, timeout: float) -> HostInfo | ServiceInfo | None:
    """The actor's ``hello``, or None if it did not come."""
    try:
        return await ref.hello(timeout)
    except (TimeoutError, RayActorError):
        return None


async def _retire(name: str) -> None:
    """Kill a tool worker past its pool's size once it runs no call (if it exists)."""
    worker = ToolWorkerRef.named(name)
    try:
        if worker is not None and (await worker.hello(2)).counts.get("active", 0) == 0:
            worker.kill()
    except (TimeoutError, RayActorError):
        return  # busy, or dying: looked at again next tick


def _kill(name: str) -> None:
    ref = ActorRef.named(name)
    if ref is not None:
        ref.kill()
