"""The RecoveryActor: a restartable singleton that hosts the recovery policy and plans resumes.

It has no state of its own: a plan is a pure read of Redis (checkpoint, tool ledger, inbox)
plus the fencing claim (``actors.engine.resume``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from actors.cluster.deployment import Deployment
from actors.cluster.info import ServiceInfo
from actors.cluster.metrics import metrics
from actors.engine.resume import plan_resume, plan_to_wire
from actors.turn.recovery import Situation, decide_recovery
from bus.outcomes import Problem
from store.domain.inbox import Inbox
from store.domain.ledger import ToolLedger
from store.write.checkpoint import RedisCheckpointStore

log = logging.getLogger(__name__)


class RecoveryActor:
    """Hosts the recovery policy and builds resume plans (checkpoint + ledger + inbox)."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,
        "max_restarts": -1,
        "max_task_retries": -1,  # a plan is a claim under a new epoch: asking again is safe
    }

    def __init__(self, deployment_json: str) -> None:
        self.dep = Deployment.from_wire(deployment_json)
        self.client = self.dep.connect(max_connections=32)
        keys = self.dep.keys
        self.store = RedisCheckpointStore(self.client, keys)
        self.ledger = ToolLedger(self.client, keys)
        self.inbox = Inbox(self.client, keys)
        self.plans = 0

    async def plan_many(self, turn_ids: list[str]) -> list[bytes]:
        """Claim each turn for a new owner; the plans in msgpack wire form, in order. One call
        for a whole host's turns: a new host adopts hundreds at once."""
        self.plans += len(turn_ids)
        started = time.monotonic()
        plans = await asyncio.gather(
            *(plan_resume(self.store, self.ledger, self.inbox, t) for t in turn_ids)
        )
        m = metrics()
        m.adoption.observe((time.monotonic() - started) * 1000)
        m.resumes.inc(len(turn_ids))
        return [plan_to_wire(p) for p in plans]

    async def decide(self, problem: str, situation: dict[str, Any]) -> dict[str, Any]:
        """``decide_recovery`` for callers outside a turn loop (operators, tests), its
        :class:`Decision` as builtins; loops call the pure function in process.
        ``ValueError`` for an unknown problem or field."""
        try:
            decision = decide_recovery(Situation(Problem(problem), **situation))
        except TypeError as exc:  # an unknown Situation field
            raise ValueError(str(exc)) from exc
        return {
            "action": decision.action.value,
            "cause": decision.cause.value,
            "backoff_s": decision.backoff_s,
            "more_room": decision.more_room,
        }

    async def hello(self) -> dict[str, Any]:
        return ServiceInfo.here({"plans": self.plans})
