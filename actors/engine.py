"""The in-process engine: many turns as asyncio tasks in one process, against Redis.

This is the single-process mode (``phaseline run --in-process``) and the reference the Ray
runtime is checked against. It wires a :class:`~actors.loop.TurnLoop` per turn to the Redis
store, ledger, inbox and approvals, and runs the watchdog rules on a ticker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from actors.config import Settings
from actors.loop import LoopSettings, TurnDeps, TurnLoop, TurnOutcome
from actors.recovery import may_resume
from actors.scenario import Scenario, parse_scenario
from actors.scripted import ScriptedLLM
from actors.toolrun import BatchExecutor, LocalToolRunner
from actors.tools import BUILTIN_TOOLS, ToolRegistry
from actors.watchdog import HardCancel, SoftIdle, WatchdogConfig, WatchdogRules
from bus.errors import RecordError, RecordNotFound, StaleOwner, StoreError
from bus.phase import Transition, TurnPhase
from store.approvals import Approvals
from store.checkpoint import RedisCheckpointStore
from store.effects import EffectCounters
from store.inbox import Inbox
from store.keys import KeyLayout
from store.ledger import ToolLedger
from store.records import CheckpointRecord, Message, MessageMeta, TurnSpec

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a phaseline scripted agent. Use the tools, then answer."


def initial_record(
    turn_id: str, session_id: str, scenario: Scenario, *, now_ms: int
) -> CheckpointRecord:
    """The record a turn is created with: the pre-turn baseline, nothing run yet."""
    messages = (
        Message(role="system", text=SYSTEM_PROMPT),
        Message(role="user", text=scenario.prompt),
    )
    meta = (
        MessageMeta(source="prompt", message_id=f"{turn_id}:system", at_ms=now_ms),
        MessageMeta(source="prompt", message_id=f"{turn_id}:user", at_ms=now_ms),
    )
    return CheckpointRecord.model_validate(
        {
            "turn_id": turn_id,
            "session_id": session_id,
            "epoch": 1,
            "seq": 0,
            "phase": TurnPhase.INIT,
            "in_progress": True,
            "reason": "submitted",
            "messages": messages,
            "meta": meta,
            "baseline": len(messages),
            "counters": {},
            "updated_at": now_ms,
        }
    )


def claim_for_resume(record: CheckpointRecord, *, now_ms: int) -> CheckpointRecord:
    """The fencing write of a new owner: same transcript, epoch + 1, one more resume attempt."""
    c = record.counters
    return record.model_copy(
        update={
            "epoch": record.epoch + 1,
            "seq": record.seq + 1,
            "reason": "resume",
            "counters": c.model_copy(update={"resume_attempts": c.resume_attempts + 1}),
            "updated_at": now_ms,
        }
    )


@dataclass(slots=True)
class RunStats:
    """What a batch of turns did, for the CLI summary and reports."""

    turns: int = 0
    resumed: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    checkpoints: int = 0
    failed_saves: int = 0
    idle_soft: int = 0
    hard_cancels: int = 0
    quarantined: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def add(self, outcome: TurnOutcome) -> None:
        self.turns += 1
        self.outcomes[outcome.outcome] += 1
        self.checkpoints += outcome.saves
        self.failed_saves += outcome.failed_saves

    def as_dict(self) -> dict[str, object]:
        return {
            "turns": self.turns,
            "resumed": self.resumed,
            "outcomes": dict(self.outcomes),
            "checkpoints": self.checkpoints,
            "failed_saves": self.failed_saves,
            "idle_soft": self.idle_soft,
            "hard_cancels": self.hard_cancels,
            "quarantined": self.quarantined,
            "wall_s": round(self.wall_s, 3),
            "turns_per_s": round(self.turns / self.wall_s, 2) if self.wall_s else None,
        }


class LocalEngine:
    """Runs turns in this process. Callers hold turn ids, never loop objects."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: KeyLayout,
        *,
        loop_settings: LoopSettings = LoopSettings(),
        watchdog: WatchdogConfig = WatchdogConfig(),
        registry: ToolRegistry = BUILTIN_TOOLS,
        on_transition: Callable[[Transition], None] | None = None,
        on_status: Callable[[SoftIdle], None] | None = None,
    ) -> None:
        self.keys = keys
        self.store = RedisCheckpointStore(client, keys)
        self.ledger = ToolLedger(client, keys)
        self.effects = EffectCounters(client, keys)
        self.inbox = Inbox(client, keys)
        self.approvals = Approvals(client, keys)
        self.loop_settings = loop_settings
        self.registry = registry
        self.runner = LocalToolRunner()
        self.rules = WatchdogRules(watchdog)
        self.stats = RunStats()
        self._loops: dict[str, TurnLoop] = {}
        self.on_transition = on_transition
        self._on_status = on_status

    @classmethod
    def from_settings(cls, client: aioredis.Redis, settings: Settings, **kw: object) -> LocalEngine:
        keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
        return cls(
            client,
            keys,
            loop_settings=settings.loop_settings(),
            watchdog=settings.watchdog,
            **kw,  # type: ignore[arg-type]
        )

    # -- submitting and running ---------------------------------------------------------------

    async def submit(
        self, scenario: Scenario, turn_id: str, *, session_id: str | None = None
    ) -> CheckpointRecord:
        """Create the turn in Redis (spec + first record, atomically)."""
        self.registry.require(scenario.tools)
        now = int(time.time() * 1000)
        session = session_id or f"session-{turn_id}"
        record = initial_record(turn_id, session, scenario, now_ms=now)
        spec = TurnSpec(
            turn_id=turn_id,
            session_id=session,
            scenario=scenario.model_dump(mode="json"),
            created_at=now,
        )
        await self.store.submit(spec, record)
        return record

    async def run_new(self, scenario: Scenario, turn_ids: Iterable[str]) -> RunStats:
        """Submit and run turns concurrently; returns the stats of this batch."""
        records = [await self.submit(scenario, t) for t in turn_ids]
        return await self._run_all([self.start(r, scenario) for r in records])

    async def resume_all(self) -> RunStats:
        """Resume every in-progress turn in the store (after its process died)."""
        scan = await self.store.load_in_progress()
        self.stats.quarantined.extend(e.key for e in scan.errors)
        coros: list[Awaitable[TurnOutcome]] = []
        for record in scan.records:
            try:
                spec = await self.store.load_spec(record.turn_id)
            except (RecordError, RecordNotFound) as exc:
                log.error("turn %s cannot be resumed: %s", record.turn_id, exc)
                await self.store.quarantine(record.turn_id, f"unusable spec: {exc}")
                self.stats.quarantined.append(record.turn_id)
                continue
            scenario = parse_scenario(spec.scenario, source=f"spec of {record.turn_id}")
            coros.append(self._resume(record, scenario))
        return await self._run_all(coros)

    async def _run_all(self, coros: Sequence[Awaitable[TurnOutcome]]) -> RunStats:
        started = time.monotonic()
        ticker = asyncio.ensure_future(self._watchdog())
        try:
            for outcome in await asyncio.gather(*coros):
                self.stats.add(outcome)
        finally:
            ticker.cancel()
        self.stats.wall_s += time.monotonic() - started
        return self.stats

    async def _resume(self, record: CheckpointRecord, scenario: Scenario) -> TurnOutcome:
        claimed = claim_for_resume(record, now_ms=int(time.time() * 1000))
        try:
            await self.store.save(claimed)
        except StaleOwner as exc:
            log.warning("turn %s: another owner resumed it first: %s", record.turn_id, exc)
            return TurnOutcome(record.turn_id, "fenced", claimed.epoch, 0, 0, len(record.messages))
        self.stats.resumed += 1
        if not may_resume(record.counters.resume_attempts):
            loop = self.build_loop(claimed, scenario, resume_from=record.reason)
            return await loop.abort("resume_limit")
        return await self.start(claimed, scenario, resume_from=record.reason)

    def build_loop(
        self,
        record: CheckpointRecord,
        scenario: Scenario,
        *,
        resume_from: str | None = None,
        settings: LoopSettings | None = None,
        **deps: Any,
    ) -> TurnLoop:
        """A loop for ``record`` wired to this engine; ``deps`` replace TurnDeps members."""
        registry = self.registry.with_approval(scenario.require_approval)
        wired = TurnDeps(
            llm=ScriptedLLM(scenario, baseline=record.baseline),
            tools=BatchExecutor(registry, self.runner, self.ledger, self.effects),
            registry=registry,
            checkpoints=self.store,
            inbox=self.inbox,
            approvals=self.approvals,
            listener=self._transition,
        )
        return TurnLoop(
            record,
            dataclasses.replace(wired, **deps),
            settings or self.loop_settings,
            resume_from=resume_from,
        )

    async def drive(self, loop: TurnLoop) -> TurnOutcome:
        """Run a loop to its end, reachable by the watchdog while it runs."""
        self._loops[loop.turn_id] = loop
        try:
            return await loop.run()
        except StoreError as exc:
            # Redis failed under this turn. Its last checkpoint is intact and still marked in
            # progress, so `phaseline resume` picks it up; the other turns go on.
            log.error("turn %s interrupted: %s", loop.turn_id, exc)
            return loop.interrupted()
        finally:
            self._loops.pop(loop.turn_id, None)

    async def start(
        self, record: CheckpointRecord, scenario: Scenario, *, resume_from: str | None = None
    ) -> TurnOutcome:
        return await self.drive(self.build_loop(record, scenario, resume_from=resume_from))

    def pending_approval(self, turn_id: str) -> str | None:
        """Call key a running turn waits on for approval, if any."""
        loop = self._loops.get(turn_id)
        return None if loop is None else loop.pending_approval

    # -- watchdog -----------------------------------------------------------------------------

    def _transition(self, t: Transition) -> None:
        self.rules.observe(t)
        if self.on_transition is not None:
            self.on_transition(t)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.rules.config.tick_s)  # the watchdog's own tick period
            for action in self.rules.tick(time.time()):
                if isinstance(action, HardCancel):
                    loop = self._loops.get(action.turn_id)
                    if loop is not None and loop.epoch == action.epoch:
                        self.stats.hard_cancels += loop.cancel_llm(action.cause)
                else:
                    self.stats.idle_soft += 1
                    log.info("turn %s: %s", action.turn_id, action.label)
                    if self._on_status is not None:
                        self._on_status(action)


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


def turn_ids(run_id: str, n: int) -> list[str]:
    return [f"{run_id}-t{i:06d}" for i in range(n)]
