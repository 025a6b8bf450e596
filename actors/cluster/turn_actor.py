"""TurnActor: the async Ray actor that hosts many turns, one asyncio task per turn.

Not one actor per turn: every Ray actor is a process, and an idle one is already about 100 MiB
resident, while a host holding 5,000 turns at once peaked under 300 MiB (``phaseline bench
--figures capacity``; docs/BENCHMARKS.md). A turn spends its life waiting on a model or a
tool, which is what an event loop is for.

A host is the engine (:class:`~actors.engine.turn_engine.TurnEngine`) with Ray parts plugged
in: saves go through the CheckpointActor (batched), tool calls go to the ToolWorker actors,
transitions go to the bus. A host owns one *slot*; the Supervisor gives each slot a new
*generation* (a new actor) when the old one dies or hangs, and the new one adopts every
in-progress turn of the slot through a resume plan of the RecoveryActor (which bumps the
epoch, so the old incarnation is fenced off).

One more slot, after the shared ones, is the *isolation host*: it takes no turns of its own,
but runs the turns the poison-turn policy isolated (``actors.turn.poison``), one at a time, each
until its first checkpoint, and then hands it back to its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any, ClassVar

import psutil
from ray.exceptions import RayActorError

from actors.cluster.checkpoint_actor import CheckpointClient, ShardedCheckpoints, actor_sender
from actors.cluster.deployment import Deployment, HostDirectory
from actors.cluster.info import HostInfo, this_node
from actors.cluster.metrics import metrics
from actors.cluster.model_lines import RayModels
from actors.cluster.refs import CheckpointRef, HostRef, RecoveryRef
from actors.cluster.tool_workers import RayToolRunner
from actors.engine.agents import agent_problem
from actors.engine.gc_tuning import tune_gc
from actors.engine.resume import ResumePlan
from actors.engine.settings.engine_settings import EngineHooks
from actors.engine.turn_engine import TurnEngine
from actors.turn.run_result import RunStop, TurnOutcome
from bus.errors import PhaselineError
from bus.events import LiveEvent, Recovering, encode_event
from bus.outcomes import Problem
from bus.phase import TurnPhase
from store.domain.effects import EffectCounters
from store.domain.leases import HostLeases
from store.domain.pools import PoolSizes
from store.records import TurnInput
from store.redis.connection import connect
from store.views.streams import BufferedPublisher, RedisBus

log = logging.getLogger(__name__)


class TurnActor:
    """Hosts the turns of one slot, for one generation."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,
        "max_restarts": 0,  # never restarted in place: the Supervisor starts a new generation
        "max_concurrency": 10_000,
    }

    def __init__(self, deployment_json: str, slot: int, generation: int) -> None:
        self.dep = Deployment.from_wire(deployment_json)
        tune_gc(self.dep.settings.host.gc_threshold)
        self.slot = slot
        self.generation = generation
        self.incarnation = uuid.uuid4().hex
        self.node_id = this_node()  # an actor never moves
        self.isolating = slot == self.dep.isolation_slot
        os.environ.update(self.dep.route(slot, generation).env)  # its process is its own
        self.client = self.dep.connect(max_connections=128, host=(slot, generation))
        self.publisher = BufferedPublisher(
            RedisBus(self.client, self.dep.keys, live=self.dep.settings.events.live())
        )
        self.tools = RayToolRunner(
            self.dep, PoolSizes(self.client, self.dep.keys), on_event=self._on_event
        )
        self.checkpoints = ShardedCheckpoints(
            {
                role: CheckpointClient.configured(
                    actor_sender(functools.partial(self._checkpoint_actor, role)),
                    self.dep.settings.checkpoint,
                )
                for role in self.dep.checkpoint_roles()
            },
            self.dep.checkpoint_role,
        )
        self.engine = TurnEngine.from_settings(
            self.client,
            self.dep.settings,
            EngineHooks(
                checkpoints=self.checkpoints,
                runner=self.tools,
                models=RayModels(self.dep) if self.dep.settings.models.remote else None,
                on_transition=self.publisher.add,
                on_event=self._on_event,
                on_isolate=self._isolation_wanted,
                effects=self._effects(),
            ),
            watchdog=False,  # the WatchdogActor watches every host's turns
            publish=False,  # its own publisher, above: its drops are counted in hello
        )
        self.directory = HostDirectory(self.dep, self.client)
        self._tasks: dict[str, asyncio.Task[TurnOutcome]] = {}
        self._closed = False
        """Set when the deployment stops: no turn starts here any more."""
        self._started = time.time()
        self._wake = asyncio.Event()
        self._probations: asyncio.Task[None] | None = None
        self._pokes: set[asyncio.Task[None]] = set()
        self.leases = HostLeases(
            self.client, self.dep.keys, ttl_s=self.dep.settings.supervisor.lease_ttl_s
        )
        self._renewing: asyncio.Task[None] | None = None
        self._reached_store = time.monotonic()

    def _on_event(self, event: LiveEvent) -> None:
        if isinstance(event, Recovering) and event.problem is Problem.RATE_LIMITED:
            metrics().rate_limit_waits.inc(1, tags={"host": self.dep.host_label(self.slot)})
        self.publisher.add(event)

    def _checkpoint_actor(self, role: str) -> CheckpointRef | None:
        return CheckpointRef.named(self.dep.name(role))

    async def hello(self) -> dict[str, Any]:
        stats = self.engine.stats
        return HostInfo(
            slot=self.slot,
            isolation=self.isolating,
            generation=self.generation,
            incarnation=self.incarnation,
            pid=os.getpid(),
            node_id=self.node_id,
            running=len(self._tasks),
            finished=stats.turns,
            outcomes=dict(stats.outcomes),
            resumed=stats.resumed,
            rss_bytes=psutil.Process().memory_info().rss,
            checkpoint_batches=self.checkpoints.batches,
            events_dropped=self.publisher.dropped,
            tool_queue={k: v for k, v in self.tools.waiting.items() if v},
            tool_inflight={k: v for k, v in self.tools.inflight.items() if v},
            store_silent_s=time.monotonic() - self._reached_store,
        ).wire()

    async def agent_problem(self, agent: str, turn_input: dict[str, Any]) -> str:
        """Why this host could not start a turn of ``agent`` ("" if it could)."""
        return agent_problem(agent, TurnInput.model_validate(turn_input))

    async def stop_taking(self) -> int:
        """Start no more turns here (new or adopted): the deployment is stopping. Returns how
        many run here now."""
        self._closed = True
        return len(self._tasks)

    async def run_turns(self, turn_ids: list[str]) -> int:
        """Start submitted turns (a turn that already ran somewhere is resumed instead)."""
        return sum(self._spawn(t, self._run_submitted(t)) for t in turn_ids)

    async def adopt(self, predecessor_died: bool | None = None) -> int:
        """Resume every in-progress turn of this slot that is not running here, planned in
        one batch (each turn starts as soon as the batch is planned). Turns queued for
        isolation are left to the isolation host. There, the supervisor's first call starts
        the probation runs and says whether the host it replaces died (its probation marker
        is then evidence) or stopped answering (it is not); a call without that (None: a
        shared host's nudge) only wakes the runs. The first call also starts renewing this
        generation's lease: from here on the host is the slot's active one."""
        if self._renewing is None:
            self._renewing = asyncio.ensure_future(self._heartbeat())
        if self._closed:
            return 0
        if self.isolating:
            if self._probations is None and predecessor_died is not None:
                await self.engine.probations.note_predecessor(died=predecessor_died)
                self._probations = asyncio.ensure_future(self._run_probations())
            elif self._probations is not None and self._probations.done():
                self._probations = asyncio.ensure_future(self._run_probations())
            self._wake.set()
            return 0
        for session_id in await self.engine.queued_sessions():
            if self.dep.slot_of(session_id) == self.slot:  # one host per session tries
                await self._open_queued(session_id)
        mine = [
            t
            for t in await self.engine.adoptable()
            if self.dep.slot_of(t) == self.slot and t not in self._tasks
        ]
        if not mine:
            return 0
        plans = asyncio.ensure_future(self._plan(mine))
        return sum(self._spawn(t, self._resume_planned(t, i, plans)) for i, t in enumerate(mine))

    async def _heartbeat(self) -> None:
        """For as long as the event loop runs: renew this generation's lease, and report how many of
        its turns are in each phase (the ``phaseline_turns`` gauge). A failed renewal (Redis
        restarting, a failover) is retried at the next period; the lease may lapse meanwhile, but a
        host that still answers its ping is kept (``store.domain.leases``) unless it stays cut off
        from Redis for ``cut_off_s`` (the Supervisor asks :meth:`reach_store`)."""
        host = self.dep.host_label(self.slot)
        while True:
            by_phase = self.engine.phase_counts()
            for phase in TurnPhase:
                metrics().turns.set(by_phase[phase], tags={"phase": phase.value, "host": host})
            try:
                await self._renew()
            except PhaselineError as exc:
                log.warning("host slot %d: %s", self.slot, exc)
            await asyncio.sleep(self.leases.renew_every_s)  # the renewal period

    async def _renew(self) -> None:
        await self.leases.renew(self.slot, self.generation)
        self._reached_store = time.monotonic()

    async def reach_store(self, timeout: float) -> bool:
        """Renew this generation's lease now, within ``timeout``: whether this host reaches
        Redis (the Supervisor asks a host that answers Ray while its lease has lapsed)."""
        try:
            await asyncio.wait_for(self._renew(), timeout)
        except (PhaselineError, TimeoutError):
            return False
        return True

    async def park(self) -> None:
        """Never returns: the Supervisor keeps one call parked here, so Ray tells it the moment
        this process dies (the call fails) instead of at its next ping."""
        await asyncio.Event().wait()

    async def cancel_turn(self, turn_id: str) -> bool:
        """An operator cancelled this turn (the request is in its inbox): end it now if it runs
        here."""
        return self.engine.cancel(turn_id)

    async def cancel_llm(self, turn_id: str, epoch: int) -> bool:
        return self.engine.cancel_llm(turn_id, epoch)

    async def phases(self) -> list[dict[str, str | int]]:
        """Current phase of every running turn, in the bus wire form (for a new watchdog)."""
        return [encode_event(t) for t in self.engine.phases()]

    async def drain(self) -> None:
        """Wait until no turn runs here (tests and orderly shutdown)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    # -- isolation ----------------------------------------------------------------------------

    async def _run_probations(self) -> None:
        """The isolation host's loop: the due queued turns, one at a time."""
        while True:
            try:
                self._wake.clear()
                turn_id, wait_s = await self.engine.probations.next_turn()
                if turn_id is None:
                    # Woken by a shared host that queued a turn, by the supervisor's periodic
                    # adopt, or when the next backoff is over.
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait_s)
                    continue
                task = await self.engine.probations.run_settled(turn_id)
                self._tasks[turn_id] = task  # if it outlasted the patience, it goes on here
                task.add_done_callback(functools.partial(self._finished, turn_id))
                settled = task.done() and not task.cancelled() and task.exception() is None
                if settled and task.result().outcome is RunStop.INTERRUPTED:
                    # Redis cut it, or its agent does not load here: it stays queued, so back
                    # off before reading the queue again instead of claiming it in a tight loop.
                    await asyncio.sleep(1)
            except PhaselineError as exc:
                log.warning("isolation host: %s; retrying", exc)
                await asyncio.sleep(1)  # Redis is away: back off, then read the queue again

    def _effects(self) -> EffectCounters | None:
        """The chaos witness, where side effects are counted when the deployment has one (as
        the ToolWorkers count there)."""
        url = self.dep.effects_url
        if url is None:
            return None
        return EffectCounters(connect(url, retry_s=self.dep.settings.redis.retry_s), self.dep.keys)

    def _isolation_wanted(self, _turn_id: str) -> None:
        self._poke(self.directory.handle(self.dep.isolation_slot))

    def _poke(self, host: Coroutine[Any, Any, HostRef | None]) -> None:
        """Ask another host to adopt now, without waiting for it (best effort: the
        supervisor's periodic adopt is the fallback)."""

        async def go() -> None:
            with contextlib.suppress(PhaselineError, RayActorError):
                handle = await host
                if handle is not None:
                    await handle.adopt()

        task = asyncio.ensure_future(go())
        self._pokes.add(task)
        task.add_done_callback(self._pokes.discard)

    # -- turn tasks ---------------------------------------------------------------------------

    def _spawn(self, turn_id: str, coro: Coroutine[Any, Any, TurnOutcome]) -> bool:
        if turn_id in self._tasks or self._closed:
            coro.close()
            return False
        task = asyncio.ensure_future(coro)
        self._tasks[turn_id] = task
        task.add_done_callback(functools.partial(self._finished, turn_id))
        return True

    def _finished(self, turn_id: str, task: asyncio.Task[TurnOutcome]) -> None:
        self._tasks.pop(turn_id, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("turn %s failed in host %s: %r", turn_id, self.slot, exc)
            return
        outcome = task.result()
        if outcome.outcome is RunStop.RELEASED:  # counted once, by the host that ends it
            self._poke(self.directory.handle_for(turn_id))
        else:
            self.engine.stats.add(outcome)  # a turn run outside run_new: counted
        if "/" in turn_id and not isinstance(outcome.outcome, RunStop):  # a session is free
            self._background(self._open_queued(turn_id.split("/")[0]))

    async def _open_queued(self, session_id: str) -> None:
        """The session's next queued turn, opened and handed to its host (this one, or the
        one its slot names: poked to adopt it now)."""
        opened = await self.engine.open_queued(session_id)
        if opened is None:
            return
        turn_id = opened[0].turn_id
        if self.dep.slot_of(turn_id) == self.slot:
            self._spawn(turn_id, self._run_submitted(turn_id))
        else:
            self._poke(self.directory.handle_for(turn_id))

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        async def go() -> None:
            try:
                await coro
            except PhaselineError as exc:  # Redis away: the next adopt tries again
                log.warning("host slot %d: %s", self.slot, exc)

        task = asyncio.ensure_future(go())
        self._pokes.add(task)
        task.add_done_callback(self._pokes.discard)

    async def _run_submitted(self, turn_id: str) -> TurnOutcome:
        started = await self.engine.start_submitted(turn_id)
        return started if started is not None else await self._resume(turn_id)

    async def _resume(self, turn_id: str) -> TurnOutcome:
        (plan,) = await self._plan([turn_id])
        return await self.engine.resume(turn_id, plan)

    async def _resume_planned(
        self, turn_id: str, index: int, plans: asyncio.Future[list[ResumePlan]]
    ) -> TurnOutcome:
        return await self.engine.resume(turn_id, (await plans)[index])

    async def _plan(self, turn_ids: list[str]) -> list[ResumePlan]:
        """Ask the RecoveryActor; while it restarts, plan here with the same function."""
        actor = RecoveryRef.named(self.dep.name("recovery"))
        why = "it is not registered"
        if actor is not None:
            try:
                return await actor.plan_many(turn_ids)
            except RayActorError as exc:
                why = str(exc)
        log.warning("recovery actor unavailable (%s); planning %d locally", why, len(turn_ids))
        return list(await asyncio.gather(*(self.engine.plan(t) for t in turn_ids)))
