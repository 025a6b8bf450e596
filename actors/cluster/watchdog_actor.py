"""The WatchdogActor: the watchdog rules over the bus, a restartable singleton.

It keeps nothing that Redis or the hosts cannot give back: a restarted watchdog rebuilds its
timers from every host's current phases and carries on consuming the bus (reclaiming what its
dead predecessor left pending). Soft idle publishes ``idle_soft``; hard idle cancels the model
call on whichever host runs the turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

import ray
from ray.exceptions import RayActorError

from actors.cluster.deployment import Deployment, HostDirectory
from actors.cluster.info import ServiceInfo
from actors.cluster.metrics import metrics
from actors.turn.watchdog import HardCancel, WatchdogAction, WatchdogRules
from bus.errors import PhaselineError
from bus.events import Status, StatusEvent
from bus.phase import Transition
from store.views.streams import RedisBus

log = logging.getLogger(__name__)

WATCHDOG_GROUP = "watchdog"


class WatchdogActor:
    """The watchdog rules over the bus: soft -> ``idle_soft`` status event, hard -> cancel."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,
        "max_restarts": -1,  # it rebuilds its timers from the hosts
        "max_task_retries": -1,
    }

    def __init__(self, deployment_json: str) -> None:
        self.dep = Deployment.from_wire(deployment_json)
        self.client = self.dep.connect(max_connections=16)
        self.bus = RedisBus(self.client, self.dep.keys, live=self.dep.settings.events.live())
        self.hosts = HostDirectory(self.dep, self.client)
        self.rules = WatchdogRules(self.dep.settings.watchdog)
        self.consumer = f"watchdog-{uuid.uuid4().hex[:8]}"
        self.soft = 0
        self.hard = 0
        self._task: asyncio.Task[None] | None = None
        # Start consuming as soon as the actor is up, also after Ray restarted it.
        ray.get_runtime_context().current_actor.hello.remote()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def hello(self) -> dict[str, Any]:
        self._ensure_running()
        counts = {
            "watched": self.rules.watched(),
            "idle_soft": self.soft,
            "hard_cancels": self.hard,
        }
        return ServiceInfo.here(counts)

    async def _run(self) -> None:
        tick = self.dep.settings.watchdog.tick_s
        while True:
            try:
                await self.bus.ensure_group(WATCHDOG_GROUP)
                await self._rebuild()
                last_reclaim = 0.0
                while True:
                    got = await self.bus.read(
                        WATCHDOG_GROUP, self.consumer, block_ms=max(1, int(tick * 1000))
                    )
                    if time.monotonic() - last_reclaim > 5:
                        got += await self.bus.reclaim(
                            WATCHDOG_GROUP, self.consumer, min_idle_ms=5000
                        )
                        last_reclaim = time.monotonic()
                    for d in got:
                        if isinstance(d.event, Transition):
                            self.rules.observe(d.event)
                            metrics().phase_entries.inc(1, tags={"phase": d.event.dst.value})
                    await self.bus.ack(WATCHDOG_GROUP, got)
                    await self._act(self.rules.tick(time.time()))
            except (PhaselineError, RayActorError) as exc:
                log.warning("watchdog: %s; retrying", exc)
                await asyncio.sleep(1)  # Redis or a host is away: back off, then rebuild

    async def _rebuild(self) -> None:
        """Arm timers for every turn running right now, from the hosts themselves."""
        for host in (await self.hosts.handles()).values():
            try:
                for transition in await host.phases():
                    self.rules.observe(transition)
            except RayActorError:
                continue

    async def _act(self, actions: list[WatchdogAction]) -> None:
        now_ms = int(time.time() * 1000)
        events: list[StatusEvent] = []
        for a in actions:
            if isinstance(a, HardCancel):
                self.hard += 1
                metrics().watchdog.inc(1, tags={"kind": "hard"})
                # The turn runs on its slot's host, or alone on the isolation host; each
                # cancels only a call of that very epoch.
                hosts = (
                    await self.hosts.handle_for(a.turn_id),
                    await self.hosts.handle(self.dep.isolation_slot),
                )
                replies = await asyncio.gather(
                    *(h.cancel_llm(a.turn_id, a.epoch) for h in hosts if h),
                    return_exceptions=True,
                )
                for reply in replies:
                    # a host that died meanwhile: its turns are being resumed anyway
                    if isinstance(reply, BaseException) and not isinstance(reply, RayActorError):
                        raise reply
                events.append(
                    StatusEvent(
                        a.turn_id, a.epoch, Status.HARD_IDLE_TIMEOUT, "model call cancelled", now_ms
                    )
                )
            else:
                self.soft += 1
                metrics().watchdog.inc(1, tags={"kind": "soft"})
                events.append(StatusEvent(a.turn_id, 0, Status.IDLE_SOFT, a.label, now_ms))
        await self.bus.publish(events)
