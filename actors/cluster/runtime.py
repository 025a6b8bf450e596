"""The Runtime facade: start or join a deployment, submit turns, talk to them, wait, shut down.

Callers hold a :class:`Runtime` and turn ids, never actor objects. Redis holds every fact; the
Supervisor (detached) keeps the actors alive, so a ``Runtime`` can be dropped and re-created
(``phaseline resume``) without losing a turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import ray
from ray.exceptions import RayActorError

from actors.cluster.deployment import (
    Deployment,
    HostDirectory,
    HostRoute,
    actor_name,
    pool_name,
)
from actors.cluster.info import HostInfo
from actors.cluster.joining import ensure_ray
from actors.cluster.namespace_claim import claim_namespace, may_stop
from actors.cluster.placement import singleton_options
from actors.cluster.refs import (
    HostRef,
    ModelWorkerRef,
    ServiceRef,
    SupervisorRef,
    ToolWorkerRef,
    spawn,
)
from actors.cluster.supervisor import Supervisor
from actors.engine.agents import load_agent
from actors.engine.front_desk import FrontDesk
from actors.engine.settings.config import Settings
from bus.errors import ConfigError, PhaselineError, StoreError
from bus.events import WatchEvent
from store.domain.ownership import Holder, NamespaceOwner, RayAuth
from store.records import CheckpointRecord, TurnInput
from store.redis.connection import StoreClient
from store.redis.embedded import EmbeddedRedis, appendfsync_for, attach_or_start
from store.redis.failures import translated
from store.redis.urls import redact_url
from store.views.finals import wait_final
from store.views.watch import watch_turn

log = logging.getLogger(__name__)


class Runtime(FrontDesk):
    """A handle on one deployment: its owner's (which may stop it) or a client's. The
    operator's verbs are the front desk's; a runtime also tells the hosts at once (a new turn
    is handed to its slot's host, a cancel ends an in-flight model call, a reopened turn is
    adopted now)."""

    def __init__(
        self,
        dep: Deployment,
        client: StoreClient,
        supervisor: SupervisorRef,
        owns_ray: bool,
        *,
        owner: Holder | None = None,
        server: EmbeddedRedis | None = None,
    ):
        super().__init__(client, dep.settings, keys=dep.keys)
        self._server = server
        """The embedded Redis this runtime started (stopped with the deployment)."""
        self.dep = dep
        self.supervisor = supervisor
        self.owns_ray = owns_ray
        self._checked: set[str] = set()
        """Agents a host of the deployment was seen to start."""
        self.owner = owner
        """This process's claim on the namespace when it owns the deployment; None for a
        client, whose :meth:`shutdown` leaves the deployment running."""
        self.namespace_owner = NamespaceOwner(
            client, dep.keys, ttl_s=dep.settings.supervisor.owner_ttl_s
        )
        self.hosts = HostDirectory(dep, client)

    @classmethod
    async def start(
        cls,
        settings: Settings,
        *,
        redis_url: str | None = None,
        hosts: int = 2,
        ray_address: str | None = None,
        effects_url: str | None = None,
        agents: Sequence[str] = (),
        host_routes: Sequence[Sequence[HostRoute]] = (),
        model_route: HostRoute | None = None,
    ) -> Runtime:
        """Start a private local Ray (or join ``ray_address``) and bring the deployment up, on
        ``redis_url`` (else ``[redis] url`` of the settings, else the embedded server on
        ``[redis] data_dir``, as every CLI verb finds it; started if none runs, and stopped
        with the deployment).
        ``agents`` lists the import paths of agents whose tools need Ray resources (each
        resource shape gets its ToolWorker pool); any agent whose tools need none runs without
        being listed. ``host_routes``: per host slot, the routes to Redis and its model
        endpoints its generations take in turn, when not as the rest of the deployment does
        (a chaos run's partitions); ``model_route``: the model workers' (its provider proxy).

        The namespace is claimed first (``store.domain.ownership``): if this Ray cluster already
        runs its deployment, the runtime attaches to it as a client (its :meth:`shutdown` stops
        nothing); if another cluster or process holds it, :class:`NamespaceHeld` names the
        holder and nothing starts."""
        for path in agents:
            load_agent(path)  # a bad path is a ConfigError here, not in the supervisor
        server = None
        redis_url = redis_url or settings.redis.url
        if redis_url is None:
            redis_url, server = attach_or_start(
                settings.redis.data_path(),
                appendfsync=appendfsync_for(settings.redis.durability_policy()),
            )
        dep = Deployment(
            redis_url=redis_url,
            settings=settings.with_telemetry_env(),  # hosts on other nodes lack this env
            hosts=hosts,
            effects_url=effects_url,
            agents=tuple(agents),
            host_routes=tuple(tuple(r) for r in host_routes),
            model_route=model_route or HostRoute(),
        )
        client = settings.redis.connect(redis_url)
        owns_ray = False
        try:
            with translated(f"cannot reach Redis at {redact_url(redis_url)}"):
                await client.ping()
            if ray_address is None and not ray.is_initialized():
                # A private Ray would be a cluster of its own: a held namespace is refused now,
                # not after the seconds Ray takes to start.
                await NamespaceOwner(client, dep.keys, ttl_s=1).refuse_if_held()
            owns_ray = ensure_ray(ray_address)
            owner = await claim_namespace(client, dep)
        except PhaselineError:
            await client.aclose()
            if owns_ray:
                ray.shutdown()
            if server is not None:
                server.stop()
            raise
        claim = owner.wire() if owner else []  # a lease that lapses before it boots is kept
        supervisor = SupervisorRef(
            spawn(Supervisor, dep.name("supervisor"), dep.to_wire(), claim, **singleton_options())
        )
        info = await supervisor.ensure()
        running = Deployment.from_wire(info.deployment)
        await _check_running(client, dep, running, owner)
        return cls(running, client, supervisor, owns_ray, owner=owner, server=server)

    @classmethod
    async def find(cls, settings: Settings, client: StoreClient) -> Runtime | None:
        """Join the deployment that serves ``settings``' namespace, wherever its Ray cluster
        is: the namespace's owner record in Redis (reached by ``client``) holds the cluster's
        address and whether it wants a token (see :mod:`actors.cluster.joining`). None when
        no deployment on Ray serves it (nothing holds it, or a process that runs its turns in
        itself does). :class:`ConfigError` when the recorded cluster cannot be joined."""
        owners = NamespaceOwner(
            client, settings.redis.key_layout(), ttl_s=settings.supervisor.owner_ttl_s
        )
        holder = await owners.holder()
        if holder is None or holder.ray_address is None:
            return None
        return await cls.attach(settings, ray_address=holder.ray_address, auth=holder.auth)

    @classmethod
    async def attach(
        cls, settings: Settings, *, ray_address: str | None, auth: RayAuth | None = None
    ) -> Runtime:
        """Join the deployment of ``settings``' namespace that already runs on the Ray cluster
        at ``ray_address`` (``phaseline serve``); nothing is started. :class:`ConfigError` if
        there is none. Leave it with :meth:`detach`, which stops nothing. ``auth``: whether
        the cluster wants a token, if known (:meth:`find` knows)."""
        owns_ray = ensure_ray(ray_address, auth=auth)
        namespace = settings.redis.namespace
        supervisor = SupervisorRef.named(actor_name(namespace, "supervisor"))
        if supervisor is None:
            if owns_ray:
                ray.shutdown()
            raise ConfigError(
                f"no deployment of namespace {namespace!r} runs on this Ray cluster; start one "
                "with phaseline serve (and join its cluster with --ray-address)"
            ) from None
        dep = Deployment.from_wire((await supervisor.hello()).deployment)
        client = dep.connect()
        with translated(f"cannot reach Redis at {redact_url(dep.redis_url)}"):
            await client.ping()
        return cls(dep, client, supervisor, owns_ray)

    # -- turns --------------------------------------------------------------------------------

    async def _vet(self, agent: str, turn_input: TurnInput) -> None:
        """A host of the deployment can start the agent, and its tools' pools run."""
        await self._check_on_a_host(agent, turn_input)
        self._check_pools(agent)

    async def _check_on_a_host(self, agent: str, turn_input: TurnInput) -> None:
        """Refuse (:class:`ConfigError`) an agent that one of the deployment's hosts cannot
        start: a module or a variable missing on the cluster's nodes, where this process's
        environment proves nothing. Asked once per agent; without a live host, nothing is
        asked (a host that fails later suspends the turn with the reason)."""
        if agent in self._checked:
            return
        handles = await self.hosts.handles()
        host = next((h for s, h in handles.items() if s != self.dep.isolation_slot), None)
        if host is None:
            return
        try:
            problem = await host.agent_problem(agent, turn_input, 30)
        except (TimeoutError, ray.exceptions.RayActorError):
            return
        if problem:
            raise ConfigError(
                f"{problem} (on a host of the deployment: every Ray node needs the agent's "
                "module importable and its variables set; see docs/OPERATIONS.md, 'What every "
                "Ray node needs')"
            )
        self._checked.add(agent)

    async def _hand_over(self, turn_ids: Sequence[str], *, adopted: bool = False) -> None:
        """Give new turns to their slots' hosts (a slot being replaced adopts them later); a
        reopened turn (``adopted``) is adopted by its slot's host now."""
        if adopted:
            await self.adopt(turn_ids)
            return
        by_slot: dict[int, list[str]] = defaultdict(list)
        for tid in turn_ids:
            by_slot[self.dep.slot_of(tid)].append(tid)
        for slot, ids in by_slot.items():
            host = await self.hosts.handle(slot)
            if host is None:
                continue  # being replaced: the new host adopts the slot's in-progress turns
            try:
                await host.run_turns(ids)
            except ray.exceptions.RayActorError:
                log.warning("host slot %d died while taking turns; its successor adopts them", slot)

    def watch(self, turn_id: str, *, from_start: bool = True) -> AsyncIterator[WatchEvent]:
        """The turn's live events until its final record (see ``store.views.watch``): phase
        transitions, ``idle_soft``, streamed text, tool calls and results, a
        :class:`~bus.events.Restarted` marker where a new owner took over after a crash, and
        :class:`~bus.events.Finished` last."""
        return watch_turn(self.client, self.dep.keys, turn_id, from_start=from_start)

    def _check_pools(self, agent: str) -> None:
        """Refuse an agent whose tools need a ToolWorker pool this deployment does not run."""
        pools = self.dep.tool_pools()
        missing = [
            dict(shape)
            for shape in load_agent(agent).resource_shapes()
            if pool_name(shape) not in pools
        ]
        if missing:
            raise ConfigError(
                f"agent {agent!r}: tools need Ray resources {missing} that no tool worker pool "
                "of this deployment holds; start the runtime with "
                f"agents=[{agent!r}]"
            )

    async def adopt(self, turn_ids: Iterable[str]) -> None:
        """Have the hosts of these turns' slots pick up their in-progress turns now (instead of
        at the supervisor's next periodic adopt), e.g. after ``phaseline resume TURN``."""
        for slot in sorted({self.dep.slot_of(t) for t in turn_ids}):
            host = await self.hosts.handle(slot)
            if host is None:
                continue  # being replaced: the new host adopts them
            try:
                await host.adopt()
            except ray.exceptions.RayActorError:
                log.warning("host slot %d died while adopting; its successor adopts", slot)

    async def _tell_cancel(self, turn_id: str) -> None:
        """Tell the turn's host of its cancel now (the request is already in its inbox)."""
        host = await self.hosts.handle(self.dep.slot_of(turn_id))
        if host is not None:  # else, or if it fails: the next incarnation reads the inbox
            with contextlib.suppress(TimeoutError, ray.exceptions.RayActorError):
                await host.cancel_turn(turn_id, 10)

    async def wait(
        self,
        turn_ids: Iterable[str],
        *,
        timeout: float = 600.0,
        on_done: Callable[[str], None] | None = None,
        on_unusable: Callable[[str, StoreError], None] | None = None,
    ) -> dict[str, CheckpointRecord]:
        """Block until every turn's final record is stored; returns them (see
        :func:`store.views.finals.wait_final`: an unreadable or gone turn is reported to
        ``on_unusable`` and left out, a Redis that is away is waited through)."""
        return await wait_final(
            self.client,
            self.store,
            turn_ids,
            timeout=timeout,
            on_done=on_done,
            on_unusable=on_unusable,
        )

    # -- the deployment -----------------------------------------------------------------------

    async def host_info(self, *, isolation: bool = False) -> list[HostInfo]:
        """``hello`` of every live host of the turn slots (and of the isolation host too, if
        asked: it holds no turns of its own, so memory and load figures leave it out)."""
        out = []
        for slot, host in (await self.hosts.handles()).items():
            if slot == self.dep.isolation_slot and not isolation:
                continue
            try:
                out.append(await host.hello(5))
            except (TimeoutError, ray.exceptions.RayActorError):
                continue
        return out

    async def standbys(self, *, timeout: float = 120.0) -> list[HostInfo]:
        """``hello`` of every slot's standby (its host's next generation), once each has answered;
        none when ``[supervisor] standby`` is off. The Supervisor starts them after the deployment
        is up, and a measurement begun before they did counts their process starts in what it
        measures (the bench waits for them). TimeoutError names the slots still without one."""
        if not self.dep.settings.supervisor.standby:
            return []
        deadline = time.monotonic() + timeout
        while True:
            found: dict[int, HostInfo] = {}
            for slot, generation in (await self.hosts.generations()).items():
                ref = HostRef.named(self.dep.host_name(slot, generation + 1))
                with contextlib.suppress(TimeoutError, ray.exceptions.RayActorError):
                    if ref is not None:
                        found[slot] = await ref.hello(5)
            missing = sorted(set(self.dep.slots()) - set(found))
            if not missing:
                return [found[slot] for slot in sorted(found)]
            if time.monotonic() > deadline:
                raise TimeoutError(f"host slots {missing} have no standby after {timeout} s")
            await asyncio.sleep(0.2)  # a process start takes seconds: poll, not spin

    async def stop_taking(self) -> int:
        """Have every host start no more turns (the deployment is stopping); returns how many
        turns the hosts run now."""
        running = 0
        for host in (await self.hosts.handles()).values():
            try:
                running += await host.stop_taking(5)
            except (TimeoutError, ray.exceptions.RayActorError):
                continue
        return running

    async def stopped(self) -> str:
        """Why the deployment no longer runs ("" while it does): its supervisor is gone, or
        stopped it because another Ray cluster took its namespace."""
        try:
            info = await self.supervisor.hello(10)
        except (TimeoutError, ray.exceptions.RayActorError):
            return "its supervisor is gone: the Ray cluster lost it"
        return info.lost

    async def abandon(self) -> None:
        """End what is left of a deployment that lost its namespace: its supervisor (which
        stopped every other actor of it already). The namespace, another's now, is left."""
        await self._stop_actors()
        await self.detach()

    async def _stop_actors(self) -> None:
        """Stop every actor of the deployment, then its supervisor."""
        with contextlib.suppress(ray.exceptions.RayActorError):
            await self.supervisor.stop()
            self.supervisor.kill()

    async def service_pid(self, role: str) -> int:
        """The process of a singleton role (``supervisor``, ``checkpoint``, ``watchdog``,
        ``recovery``); :class:`PhaselineError` if it is not registered."""
        name = self.dep.name(role)
        ref = SupervisorRef.named(name) if role == "supervisor" else ServiceRef.named(name)
        if ref is None:
            raise PhaselineError(f"no actor {name} runs")
        return (await ref.hello()).pid

    def service(self, role: str) -> ServiceRef | None:
        """The service actor of a role (``checkpoint``, ``watchdog``, ``recovery``), if it
        is registered."""
        return ServiceRef.named(self.dep.name(role))

    def model_worker(self, index: int) -> ModelWorkerRef | None:
        """Model worker ``index``, if it is registered."""
        return ModelWorkerRef.named(self.dep.model_worker_name(index))

    def tool_worker(self, pool: str, index: int) -> ToolWorkerRef | None:
        """Worker ``index`` of a tool pool, if it is registered."""
        return ToolWorkerRef.named(self.dep.tool_worker_name(pool, index))

    async def kill_host(self, slot: int, sig: int = signal.SIGKILL, wait_s: float = 30.0) -> int:
        """Send ``sig`` to the process of a host (for demos and chaos); returns its pid. A host
        the supervisor replaced between the lookup and its answer (slow to answer a ping on a
        busy machine) is followed to its successor, for up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            host = await self.hosts.handle(slot)
            if host is None and time.monotonic() > deadline:
                raise PhaselineError(f"host slot {slot} has no live actor")
            if host is not None:
                try:
                    pid = (await host.hello()).pid
                except RayActorError:
                    if time.monotonic() > deadline:
                        raise PhaselineError(f"host slot {slot} died before it answered") from None
                else:
                    os.kill(pid, sig)
                    return pid
            await asyncio.sleep(0.1)  # the supervisor is bringing the slot's next generation

    async def respawns(self) -> int:
        with translated("read supervisor stats"):
            raw = await self.client.hget(self.dep.keys.supervisor(), "respawns")
        return int(raw or 0)

    async def detach(self) -> None:
        """Close this runtime's connections (and Ray, if it started it), leaving the
        deployment as it is: running, for a client (its turns go on)."""
        await self.client.aclose()
        if self.owns_ray:
            ray.shutdown()
            self._stop_server()  # nothing of the deployment is left to use it

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    async def shutdown(self) -> None:
        """Stop every actor of the deployment and give its namespace up, then Ray if this
        runtime started it. Only the deployment's owner (the process that started it, or took
        it over) stops anything: a client's shutdown is :meth:`detach`."""
        holder = await self._holder()
        if not self._owns(holder):
            log.info(
                "leaving the deployment of namespace %r running (owned by %s)",
                self.dep.keys.namespace,
                holder.line() if holder else "no one",
            )
            await self.detach()
            return
        await self._stop_actors()
        try:
            with translated("forget host generations"):
                await self.client.delete(self.dep.keys.hosts())
            if holder is not None:
                await self.namespace_owner.release(holder.owner)
        except StoreError:
            pass
        await self.detach()
        self._stop_server()

    def _owns(self, holder: Holder | None) -> bool:
        """Whether this runtime may stop the deployment (:func:`may_stop`)."""
        return may_stop(self.owner, holder)

    async def _holder(self) -> Holder | None:
        try:
            return await self.namespace_owner.holder()
        except StoreError as exc:
            log.warning("cannot read who owns namespace %r: %s", self.dep.keys.namespace, exc)
            return self.owner


async def _check_running(
    client: StoreClient, dep: Deployment, running: Deployment, owner: Holder | None
) -> None:
    """What this Ray cluster already runs under ``dep``'s namespace must be ``dep``: the same
    Redis, and (when this process owns it now) as many hosts; attached as a client, say so."""
    settings = dep.settings
    if running.redis_url != dep.redis_url:
        raise ConfigError(
            f"namespace {settings.redis.namespace!r} already runs on this Ray cluster with "
            f"Redis {redact_url(running.redis_url)}; use that Redis or another --namespace"
        )
    if owner is None:
        holder = await NamespaceOwner(client, dep.keys, ttl_s=1).holder()
        log.warning(
            "namespace %r already runs on this Ray cluster (%d hosts, owned by %s): "
            "attached to it as a client; leaving stops nothing",
            settings.redis.namespace,
            running.hosts,
            holder.line() if holder else "?",
        )
    elif running.hosts != dep.hosts:
        raise ConfigError(
            f"namespace {settings.redis.namespace!r} already runs with {running.hosts} hosts; "
            "shut it down first or use another --namespace"
        )
