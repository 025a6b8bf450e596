"""The chaos monkey of ``phaseline chaos`` (``actors.harness.chaos``): a seeded loop that deals
fault targets from a shuffled deck at random intervals and injects each (the targets are listed
there), noting what it hit, whom, and the turns in progress it caught."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import ray

from actors.cluster.local_nodes import LocalNodes
from actors.cluster.runtime import Runtime
from actors.engine.turn_engine import TurnEngine
from actors.harness.bad_tools import RAISER
from actors.harness.chaos_report import Fault
from actors.harness.chaos_settings import ChaosSettings
from actors.harness.links import Links
from actors.harness.provider_proxy import ProviderFault
from actors.harness.targets import ChaosTarget
from actors.turn.run_result import TurnOutcome
from bus.errors import ConfigError, PhaselineError
from store.domain.isolation import Isolation
from store.records import TurnInput
from store.redis.embedded import EmbeddedRedis
from store.redis.embedded_cluster import EmbeddedCluster

log = logging.getLogger(__name__)

#: Turns a ``concurrent_resume`` fault takes over at once.
RIVAL_TURNS = 3


class ChaosMonkey:
    """Injects the faults of one run."""

    def __init__(
        self,
        rt: Runtime,
        server: EmbeddedRedis | None,
        cfg: ChaosSettings,
        nodes: LocalNodes | None = None,
        cluster: EmbeddedCluster | None = None,
        links: Links | None = None,
    ) -> None:
        self.rt = rt
        self.links = links
        self.server = server
        self.nodes = nodes
        self.cluster = cluster
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.isolation = Isolation(rt.client, rt.dep.keys)
        self.faults: list[Fault] = []
        self.t0 = time.monotonic()
        self.rivals: list[asyncio.Task[TurnOutcome]] = []
        self.aof_samples: deque[tuple[float, tuple[Path, int] | None]] = deque(maxlen=200)
        self._rival: TurnEngine | None = None
        self.bad_ids: list[str] = []
        """The bad-input turns submitted (``bad_input``)."""
        self._deck: list[ChaosTarget] = []
        """The targets still to draw before each has had its turn."""

    async def run(self) -> None:
        sampler = None
        if ChaosTarget.POWER_LOSS in self.cfg.targets and self.server is not None:
            sampler = asyncio.ensure_future(self._sample_aof())
        try:
            await self._faults()
        finally:
            if sampler is not None:
                sampler.cancel()

    async def _sample_aof(self) -> None:
        """Where the AOF stood over the last seconds: what a power loss under ``everysec`` may
        cut back to."""
        assert self.server is not None
        while True:
            with contextlib.suppress(OSError):
                self.aof_samples.append((time.monotonic(), self.server.aof_tail()))
            await asyncio.sleep(0.02)  # the sampling period

    async def _faults(self) -> None:
        if not self.cfg.targets:
            return
        deadline = self.t0 + self.cfg.duration_s
        while True:
            pause = self.rng.uniform(0.5, 1.5) * self.cfg.kill_interval_s
            if time.monotonic() + pause > deadline:
                return
            await asyncio.sleep(pause)  # the fault schedule itself, not a synchronisation
            if not self._deck:  # every target once, in a seeded order, before any again
                self._deck = self.rng.sample(self.cfg.targets, len(self.cfg.targets))
            target = self._deck.pop()
            try:
                self.faults.append(await self.inject(target))
            except (
                PhaselineError,
                ray.exceptions.RayActorError,
                ValueError,
                ProcessLookupError,
            ) as exc:
                self.faults.append(
                    Fault(self.now(), target, "-", None, note=f"skipped: {exc}"[:200], skipped=True)
                )

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _affected(self, slot: int) -> dict[str, int]:
        """In-progress turn -> epoch of the turns on ``slot`` (the isolation host: the turn on
        probation there, if any)."""
        if slot == self.rt.dep.isolation_slot:
            marker = await self.isolation.current()
            return {} if marker is None else {marker.turn_id: marker.epoch}
        out = {}
        for tid in await self.rt.store.list_in_progress():
            if self.rt.dep.slot_of(tid) == slot:
                out[tid] = (await self.rt.store.load(tid)).epoch
        return out

    async def inject(self, target: ChaosTarget) -> Fault:
        """One fault of ``target``, as its handler makes it."""
        handlers: dict[ChaosTarget, Callable[[], Awaitable[Fault]]] = {
            ChaosTarget.BAD_INPUT: self._bad_input,
            ChaosTarget.HOST: self._kill_host,
            ChaosTarget.FREEZE: self._freeze_host,
            ChaosTarget.TOOL: self._kill_tool_worker,
            ChaosTarget.MODEL: self._kill_model_worker,
            ChaosTarget.CONCURRENT_RESUME: self._rival_resume,
            ChaosTarget.NODE: self._node_loss,
            ChaosTarget.REDIS_FAILOVER: self._redis_failover,
            ChaosTarget.POWER_LOSS: self._power_loss,
            ChaosTarget.REDIS: self._restart_redis,
            ChaosTarget.PROVIDER: self._provider_storm,
            ChaosTarget.PARTITION: self._partition,
        }
        handler = handlers.get(target)
        return await (handler() if handler is not None else self._kill_service(target))

    async def _bad_input(self) -> Fault:
        """Submit a turn whose tools raise what is not an ``Exception`` (judged at the end)."""
        tid = f"chaos{self.cfg.seed}-bad{len(self.bad_ids)}"
        at = self.now()
        await self.rt.submit(RAISER, TurnInput(message="raise"), [tid])
        self.bad_ids.append(tid)
        return Fault(at, ChaosTarget.BAD_INPUT, tid, None, note="tools that raise BaseException")

    async def _kill_host(self) -> Fault:
        slot = self.rng.choice(self.rt.dep.slots())
        affected = await self._affected(slot)
        at = self.now()
        pid = await self.rt.kill_host(slot)
        return Fault(at, ChaosTarget.HOST, self.rt.dep.host_label(slot), pid, affected)

    async def _freeze_host(self) -> Fault:
        """SIGSTOP a host until the supervisor has replaced it and its turns moved."""
        rt = self.rt
        slot = self.rng.choice(rt.dep.slots())
        affected = await self._affected(slot)
        at = self.now()
        before = await rt.respawns()
        pid = await rt.kill_host(slot, signal.SIGSTOP)
        try:
            await self._until_claimed(before, affected)
        finally:
            os.kill(pid, signal.SIGCONT)
        return Fault(
            at,
            ChaosTarget.FREEZE,
            rt.dep.host_label(slot),
            pid,
            affected,
            note="stopped until replaced",
        )

    async def _provider_storm(self) -> Fault:
        """One to three seconds of one provider fault; the requests it met are counted."""
        provider = self.links.provider if self.links is not None else None
        if provider is None:
            raise ConfigError("no provider proxy stands in front of the model endpoint")
        fault = self.rng.choice(list(ProviderFault))
        seconds = self.rng.uniform(1.0, 3.0)
        before = provider.landed[fault]
        at = self.now()
        provider.storm(fault, seconds)
        await asyncio.sleep(seconds)  # the storm's length: the fault itself
        hit = provider.landed[fault] - before
        return Fault(
            at,
            ChaosTarget.PROVIDER,
            f"model endpoint: {fault}",
            None,
            note=f"{seconds:.1f} s, {hit} requests met it",
            skipped=hit == 0,
        )

    async def _partition(self) -> Fault:
        """Cut one host's link (of a host running turns, if one does) to Redis or to the
        model, then restore it: for two to six seconds, or (half the Redis cuts) past
        ``cut_off_s``, so the supervisor replaces the host and what it sent meanwhile arrives
        after its successor's claims, to be fenced."""
        if self.links is None or not self.links.hosts:
            raise ConfigError("the hosts were not started behind links of their own")
        slots = range(len(self.links.hosts))
        # a cut an idle host never sees: one listing says which hosts run turns
        busy = {self.rt.dep.slot_of(t) for t in await self.rt.store.list_in_progress()}
        if await self.isolation.current() is not None:
            busy.add(self.rt.dep.isolation_slot)
        slot = self.rng.choice(sorted(busy & set(slots)) or list(slots))
        affected = await self._affected(slot)
        gen = (await self.rt.hosts.generations()).get(slot, 0)
        host = self.links.of(slot, gen)
        cuttable = [("redis", host.redis)] + ([("model", host.model)] if host.model else [])
        what, link = self.rng.choice(cuttable)
        seconds = self.rng.uniform(2.0, 6.0)
        if what == "redis" and self.rng.random() < 0.5:
            seconds = self.rt.dep.settings.supervisor.cut_off_s + self.rng.uniform(1.0, 3.0)
        caught = link.held_connections
        at = self.now()
        await asyncio.to_thread(link.cut)
        try:
            await asyncio.sleep(seconds)  # the partition's length: the fault itself
        finally:
            await asyncio.to_thread(link.restore)
        replaced = (await self.rt.hosts.generations()).get(slot, 0) > gen
        return Fault(
            at,
            ChaosTarget.PARTITION,
            f"{self.rt.dep.host_label(slot)} - {what}",
            None,
            affected,
            note=f"cut {seconds:.1f} s; {link.held_connections - caught} new "
            f"connections held; {'replaced' if replaced else 'kept'}",
        )

    async def _kill_tool_worker(self) -> Fault:
        rt = self.rt
        index = self.rng.randrange(rt.dep.settings.tools.workers)
        worker = rt.tool_worker("default", index)
        if worker is None:
            return Fault(
                self.now(),
                ChaosTarget.TOOL,
                f"tools{index}",
                None,
                note="the worker is being restarted",
                skipped=True,
            )
        pid = (await worker.hello()).pid
        os.kill(pid, signal.SIGKILL)
        return Fault(self.now(), ChaosTarget.TOOL, f"tools{index}", pid)

    async def _kill_model_worker(self) -> Fault:
        rt = self.rt
        index = self.rng.randrange(rt.dep.settings.models.workers)
        worker = rt.model_worker(index)
        if worker is None or not rt.dep.settings.models.remote:
            return Fault(
                self.now(),
                ChaosTarget.MODEL,
                f"models{index}",
                None,
                note="model calls run in the hosts" if worker is None else "not up",
                skipped=True,
            )
        pid = (await worker.hello()).pid
        os.kill(pid, signal.SIGKILL)
        return Fault(self.now(), ChaosTarget.MODEL, f"models{index}", pid)

    async def _restart_redis(self) -> Fault:
        assert self.server is not None
        at = self.now()
        down = await asyncio.to_thread(self.server.restart)
        return Fault(at, ChaosTarget.REDIS, "redis-server", None, note=f"down {down:.2f} s")

    async def _kill_service(self, target: ChaosTarget) -> Fault:
        """SIGKILL a service actor: a CheckpointActor (one of them), the WatchdogActor, the
        RecoveryActor or the Supervisor."""
        rt = self.rt
        role = (
            self.rng.choice(rt.dep.checkpoint_roles())
            if target is ChaosTarget.CHECKPOINT
            else target.value
        )
        pid = await rt.service_pid(role)
        os.kill(pid, signal.SIGKILL)
        return Fault(self.now(), target, role, pid)

    async def _node_loss(self) -> Fault:
        """Remove a worker node that runs turn hosts (its raylet and every worker on it: hosts,
        standbys, tool workers), then add a fresh node, as a replaced machine joins."""
        assert self.nodes is not None
        workers = set(self.nodes.worker_node_ids())
        hosts = await self.rt.host_info(isolation=True)
        by_node: dict[str, list[int]] = {}
        for h in hosts:
            if h.node_id in workers:
                by_node.setdefault(h.node_id, []).append(h.slot)
        candidates = sorted(by_node) or sorted(workers)
        if not candidates:
            raise ConfigError("no worker node to remove")
        victim = self.rng.choice(candidates)
        affected: dict[str, int] = {}
        for slot in by_node.get(victim, []):
            affected.update(await self._affected(slot))
        before = await self.rt.respawns()
        at = self.now()
        self.nodes.remove_node(victim)
        # The fresh node joins once the lost node's turns have moved, as a replacement machine
        # does (minutes later, on its own hardware): started at once on this one machine, its
        # raylet and workers would take the cores from the recovery being measured.
        if affected:
            await self._until_claimed(before, affected)
        # In this thread: Ray's node start installs signal handlers, which only the main
        # thread may do. The loop stalls for the few seconds a raylet takes to start.
        fresh = self.nodes.add_node()
        note = f"hosts of slots {sorted(by_node.get(victim, []))}; node {fresh[:8]} added"
        return Fault(at, ChaosTarget.NODE, f"node {victim[:8]}", None, affected, note=note)

    async def _redis_failover(self) -> Fault:
        """SIGKILL a primary of the Redis Cluster, wait until its replica serves its slots,
        then start it again and wait until it is back in sync as a replica (so the next
        failover of that pair has a replica to promote)."""
        cluster = self.cluster
        assert cluster is not None
        primaries = sorted(cluster.primary_nodes(), key=lambda n: n.port or 0)
        if not primaries:
            raise ConfigError("no live primary to kill")
        victim = self.rng.choice(primaries)
        at = self.now()
        served_s, rejoined_s = await asyncio.to_thread(cluster.fail_over, victim)
        note = f"failover {served_s:.2f} s, back as a replica {rejoined_s:.2f} s"
        return Fault(at, ChaosTarget.REDIS_FAILOVER, f"primary :{victim.port}", None, note=note)

    async def _power_loss(self) -> Fault:
        server = self.server
        assert server is not None and server.process is not None
        at = self.now()
        server.process.send_signal(signal.SIGSTOP)  # from here on it acknowledges nothing
        keep = server.aof_tail()
        if server.appendfsync != "always":  # everysec: the last second was not yet on disk
            older = [tail for t, tail in self.aof_samples if t <= time.monotonic() - 1.0]
            if older and older[-1] is not None and keep is not None and older[-1][0] == keep[0]:
                keep = older[-1]
        dropped = await asyncio.to_thread(server.power_loss, keep)
        note = f"appendfsync {server.appendfsync}: {dropped} AOF bytes lost"
        return Fault(at, ChaosTarget.POWER_LOSS, "redis-server", None, note=note)

    async def _rival_resume(self) -> Fault:
        """Claim and run a few turns of one host from here, as a second resumer would."""
        if self._rival is None:
            self._rival = TurnEngine.from_settings(
                self.rt.client, self.rt.dep.settings, watchdog=False, publish=False
            )
        slot = self.rng.randrange(self.rt.dep.hosts)
        running = await self._affected(slot)  # turn -> epoch
        taken = self.rng.sample(sorted(running), min(RIVAL_TURNS, len(running)))
        affected = {t: running[t] for t in taken}
        at = self.now()
        self.rivals += [asyncio.ensure_future(self._rival.resume(t)) for t in taken]
        return Fault(
            at,
            ChaosTarget.CONCURRENT_RESUME,
            f"host{slot}",
            None,
            affected,
            note=f"rival resumed {len(taken)}",
        )

    async def rivals_done(self) -> Counter[str]:
        """Wait for every rival turn; how each ended (``fenced``: the host won it back)."""
        ended = await asyncio.gather(*self.rivals, return_exceptions=True)
        return Counter(o.outcome if isinstance(o, TurnOutcome) else type(o).__name__ for o in ended)

    async def _until_claimed(self, respawns_before: int, affected: dict[str, int]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if await self.rt.respawns() > respawns_before:
                    records = [await self.rt.store.load(t) for t in affected]
                    # A turn the successor handed to the isolation host is not claimed until
                    # its probation comes up: that counts as taken over too.
                    queued = await self.isolation.members()
                    if all(
                        r.epoch > affected[r.turn_id] or not r.in_progress or r.turn_id in queued
                        for r in records
                    ):
                        return
            except PhaselineError:
                pass
            await asyncio.sleep(0.1)  # polling the successor's claims, with a deadline
        raise PhaselineError("the turns of a lost host were not taken over within 60 s")
