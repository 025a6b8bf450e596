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
from dataclasses import dataclass

import ray

from actors.cluster.deployment import Deployment, HostDirectory, actor_name, ensure_ray, pool_name
from actors.cluster.info import HostInfo
from actors.cluster.namespace_claim import claim_namespace, may_stop
from actors.cluster.placement import singleton_options
from actors.cluster.refs import HostRef, ServiceRef, SupervisorRef, ToolWorkerRef, spawn
from actors.cluster.supervisor import Supervisor
from actors.engine.agents import load_agent
from actors.engine.cancel import Cancelled, queue_behind, request_cancel
from actors.engine.config import Settings
from actors.engine.submission import new_turns, session_turn
from bus.errors import ConfigError, PhaselineError, SessionBusy, StoreError, TurnExists
from bus.events import WatchEvent
from store.approvals import Approvals
from store.checkpoint import RedisCheckpointStore
from store.connection import StoreClient
from store.failures import translated
from store.finals import wait_final
from store.inbox import Inbox
from store.ownership import Holder, NamespaceOwner
from store.records import Approval, CheckpointRecord, InboxItem, QueuedTurn, TurnInput
from store.sessions import IfBusy, Sessions
from store.urls import redact_url
from store.watch import watch_turn

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionSubmit:
    """What a message to a session became."""

    turn_id: str | None = None
    """The turn it opened (None: queued)."""
    queued_behind: str | None = None
    """The running turn it waits for, when queued."""
    place: int = 0
    """Its place in the session's queue (1: next), when queued."""


class Runtime:
    """A handle on one deployment: its owner's (which may stop it) or a client's."""

    def __init__(
        self,
        dep: Deployment,
        client: StoreClient,
        supervisor: SupervisorRef,
        owns_ray: bool,
        *,
        owner: Holder | None = None,
    ):
        self.dep = dep
        self.client = client
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
        self.store = RedisCheckpointStore(client, dep.keys, atomic=dep.settings.checkpoint.atomic)
        self.inbox = Inbox(client, dep.keys)
        self.approvals = Approvals(client, dep.keys)
        self.sessions = Sessions(self.store)
        self.hosts = HostDirectory(dep, client)

    @classmethod
    async def start(
        cls,
        settings: Settings,
        *,
        redis_url: str,
        hosts: int = 2,
        ray_address: str | None = None,
        effects_url: str | None = None,
        agents: Sequence[str] = (),
    ) -> Runtime:
        """Start a private local Ray (or join ``ray_address``) and bring the deployment up.
        ``agents`` lists the import paths of agents whose tools need Ray resources (each
        resource shape gets its ToolWorker pool); any agent whose tools need none runs without
        being listed.

        The namespace is claimed first (``store.ownership``): if this Ray cluster already runs
        its deployment, the runtime attaches to it as a client (its :meth:`shutdown` stops
        nothing); if another cluster or process holds it, :class:`NamespaceHeld` names the
        holder and nothing starts."""
        for path in agents:
            load_agent(path)  # a bad path is a ConfigError here, not in the supervisor
        owns_ray = ensure_ray(ray_address)
        dep = Deployment(
            redis_url=redis_url,
            settings=settings.with_telemetry_env(),  # hosts on other nodes lack this env
            hosts=hosts,
            effects_url=effects_url,
            agents=tuple(agents),
        )
        client = settings.redis.connect(redis_url)
        try:
            with translated(f"cannot reach Redis at {redact_url(redis_url)}"):
                await client.ping()
            owner = await claim_namespace(client, dep)
        except PhaselineError:
            await client.aclose()
            if owns_ray:
                ray.shutdown()
            raise
        supervisor = SupervisorRef(
            spawn(Supervisor, dep.name("supervisor"), dep.to_wire(), **singleton_options())
        )
        info = await supervisor.ensure()
        running = Deployment.from_wire(info.deployment)
        await _check_running(client, dep, running, owner)
        return cls(running, client, supervisor, owns_ray, owner=owner)

    @classmethod
    async def attach(cls, settings: Settings, *, ray_address: str | None) -> Runtime:
        """Join the deployment of ``settings``' namespace that already runs on the Ray cluster
        at ``ray_address`` (``phaseline serve``); nothing is started. :class:`ConfigError` if
        there is none. Leave it with :meth:`detach`, which stops nothing."""
        owns_ray = ensure_ray(ray_address)
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

    async def submit(
        self,
        agent: str,
        turn_input: TurnInput | str,
        turn_ids: Iterable[str] = (),
        *,
        session: str | None = None,
    ) -> list[str]:
        """Create turns of ``agent`` (an import path) on ``turn_input`` in Redis and hand each
        to its host slot; returns the new ones. A bad agent or input is a ConfigError here,
        before anything is written.

        With ``session``, one turn is opened in that session instead (its id is
        ``<session>/<n>``): it starts from the previous turn's final transcript, and is
        refused with :class:`SessionBusy` while that turn is still running (send the running
        turn a message with :meth:`inject` instead).

        Idempotent without a session: a turn that already exists is left alone, so a
        submission cut short by a Redis failure can simply be repeated. Any other failure
        raises after the turns that were created have been handed over.
        """
        if isinstance(turn_input, str):
            turn_input = TurnInput(message=turn_input)
        await self._check_on_a_host(agent, turn_input)
        ids = list(turn_ids)
        if session is not None:
            if ids:
                raise ConfigError("a session names its own turns: give turn_ids or session")
            self._check_pools(agent)
            spec, _ = await self.sessions.open(session, session_turn(agent, turn_input, session))
            await self._hand_over([spec.turn_id])
            return [spec.turn_id]
        turns = new_turns(agent, turn_input, ids)
        self._check_pools(agent)
        created: list[str] = []
        failure: StoreError | None = None
        for (spec, _), result in zip(turns, await self.store.submit_many(turns), strict=True):
            if isinstance(result, TurnExists):
                continue
            if isinstance(result, StoreError):
                failure = failure or result
                continue
            created.append(spec.turn_id)
        await self._hand_over(created)
        if failure is not None:
            raise failure
        return created

    async def submit_in_session(
        self,
        agent: str,
        turn_input: TurnInput | str,
        session: str,
        *,
        if_busy: IfBusy = IfBusy.REJECT,
        by: str = "",
    ) -> SessionSubmit:
        """Open the session's next turn; while its running turn has not ended, ``if_busy``
        says what happens: refused (:class:`SessionBusy`), queued behind it, or the running
        turn cancelled and the new one queued to open from its final transcript."""
        if isinstance(turn_input, str):
            turn_input = TurnInput(message=turn_input)
        try:
            (opened,) = await self.submit(agent, turn_input, session=session)
            return SessionSubmit(turn_id=opened)
        except SessionBusy as busy:
            if if_busy is IfBusy.REJECT:
                raise
            running = busy.turn_id
        queued = QueuedTurn(agent=agent, input=turn_input, at_ms=int(time.time() * 1000), by=by)
        interrupt = if_busy is IfBusy.INTERRUPT
        place, now_open = await queue_behind(
            self.sessions, self.inbox, session, running, queued, interrupt=interrupt
        )
        if interrupt:
            await self._tell_cancel(running)
        if now_open is not None:
            await self._hand_over([now_open[0].turn_id])
        return SessionSubmit(queued_behind=running, place=place)

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
                "module importable and its variables set; see README, Operating it)"
            )
        self._checked.add(agent)

    async def _hand_over(self, turn_ids: Sequence[str]) -> None:
        """Give new turns to their slots' hosts (a slot being replaced adopts them later)."""
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
        """The turn's live events until its final record (see ``store.watch``): phase
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

    async def inject(self, turn_id: str, text_: str, *, message_id: str | None = None) -> InboxItem:
        """Queue a user message; it enters the turn at its next boundary, exactly once.
        :class:`TurnNotRunning` for a turn that is not in progress."""
        return await self.inbox.push(turn_id, text_, message_id=message_id)

    async def cancel(self, turn_id: str, reason: str = "", *, by: str = "") -> Cancelled:
        """Cancel a turn: durable (its owner, or the incarnation that resumes it, ends it
        ``cancelled`` at its next boundary), and its host is told now, which cancels an
        in-flight model call. A suspended turn ends at once. :class:`TurnNotRunning` for one
        that already ended."""
        done = await request_cancel(self.store, self.inbox, turn_id, reason, by=by)
        if done is Cancelled.REQUESTED:
            await self._tell_cancel(turn_id)
        return done

    async def _tell_cancel(self, turn_id: str) -> None:
        """Tell the turn's host of its cancel now (the request is already in its inbox)."""
        host = await self.hosts.handle(self.dep.slot_of(turn_id))
        if host is not None:  # else, or if it fails: the next incarnation reads the inbox
            with contextlib.suppress(TimeoutError, ray.exceptions.RayActorError):
                await host.cancel_turn(turn_id, 10)

    async def pending_approvals(self, turn_id: str) -> dict[str, Approval]:
        """The turn's calls waiting for a decision, by call key (tool, arguments, when)."""
        return await self.approvals.pending(turn_id)

    async def decide(
        self, turn_id: str, call_key: str, approve: bool, *, by: str = "", reason: str = ""
    ) -> bool:
        """Approve or deny a waiting tool call; False if it was already decided. Who and why
        stay with the turn (the tool result's meta)."""
        return await self.approvals.decide(turn_id, call_key, approve, by=by, reason=reason)

    async def wait(
        self,
        turn_ids: Iterable[str],
        *,
        timeout: float = 600.0,
        on_done: Callable[[str], None] | None = None,
        on_unusable: Callable[[str, StoreError], None] | None = None,
    ) -> dict[str, CheckpointRecord]:
        """Block until every turn's final record is stored; returns them (see
        :func:`store.finals.wait_final`: an unreadable or gone turn is reported to
        ``on_unusable`` and left out, a Redis that is away is waited through)."""
        return await wait_final(
            self.client, self.store, turn_ids, timeout=timeout, on_done=on_done,
            on_unusable=on_unusable,
        )  # fmt: skip

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
        """``hello`` of every slot's standby (its host's next generation), once each has
        answered; none when ``[supervisor] standby`` is off. The Supervisor starts them after
        the deployment is up, and a measurement begun before they did counts their process
        starts: 0.5-0.6 ms of CPU per tool round in a 500-turn run of the bench's unit costs.
        TimeoutError names the slots still without one."""
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

    def tool_worker(self, pool: str, index: int) -> ToolWorkerRef | None:
        """Worker ``index`` of a tool pool, if it is registered."""
        return ToolWorkerRef.named(self.dep.tool_worker_name(pool, index))

    async def kill_host(self, slot: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the process of a host (for demos and chaos); returns its pid."""
        host = await self.hosts.handle(slot)
        if host is None:
            raise PhaselineError(f"host slot {slot} has no live actor")
        pid = (await host.hello()).pid
        os.kill(pid, sig)
        return pid

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

    async def shutdown(self) -> None:
        """Stop every actor of the deployment and give its namespace up, then Ray if this
        runtime started it. Only the deployment's owner (the process that started it, or took
        it over) stops anything: a client's shutdown is :meth:`detach`."""
        holder = await self._holder()
        if not self._owns(holder):
            log.info("leaving the deployment of namespace %r running (owned by %s)",
                     self.dep.keys.namespace, holder.line() if holder else "no one")  # fmt: skip
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
            settings.redis.namespace, running.hosts, holder.line() if holder else "?",
        )  # fmt: skip
    elif running.hosts != dep.hosts:
        raise ConfigError(
            f"namespace {settings.redis.namespace!r} already runs with {running.hosts} hosts; "
            "shut it down first or use another --namespace"
        )
