"""The turn engine: many turns as asyncio tasks in one event loop, against Redis.

Used as is by the single-process mode (``phaseline run --in-process``) and, with a checkpoint
client, Ray tool runner and bus publisher plugged in, by every Ray ``TurnActor``. It wires a
:class:`~actors.turn.loop.TurnLoop` per turn to the store, ledger, inbox and approvals; with a
:class:`~actors.turn.watchdog.WatchdogSettings` it also runs the watchdog rules on a local ticker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from actors.engine.builtin_tools import BUILTIN_TOOLS
from actors.engine.config import Settings
from actors.engine.resume import ResumePlan, died_inside, plan_resume
from actors.engine.scenario import Scenario
from actors.engine.scripted import ScriptedLLM
from actors.engine.toolrun import BatchExecutor, LocalToolRunner, ToolRunner
from actors.turn.loop import (
    Checkpointer,
    LoopSettings,
    ProbationHooks,
    TurnDeps,
    TurnLoop,
    TurnOutcome,
)
from actors.turn.poison import SUSPENDED_POISON, isolation_backoff_s
from actors.turn.tools import ToolRegistry
from actors.turn.watchdog import HardCancel, SoftIdle, WatchdogRules, WatchdogSettings
from bus.errors import StaleOwner, StoreError
from bus.phase import Transition, TurnPhase
from store.approvals import Approvals
from store.checkpoint import RedisCheckpointStore
from store.codec import DEFAULT_MAX_RECORD_BYTES
from store.durability import Durability
from store.effects import EffectCounters
from store.inbox import Inbox
from store.isolation import Isolation
from store.keys import KeyLayout
from store.ledger import ToolLedger
from store.records import CheckpointRecord, Message, MessageMeta, TurnSpec

log = logging.getLogger(__name__)

#: Loop outcomes that leave the turn's record in progress (someone must still end it).
NOT_ENDED = frozenset({"interrupted", "fenced", "unusable", "released", "isolate"})

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


def new_turn(
    scenario: Scenario, turn_id: str, *, session_id: str | None = None
) -> tuple[TurnSpec, CheckpointRecord]:
    """Spec and first record of a turn, ready for ``RedisCheckpointStore.submit_many``."""
    now = int(time.time() * 1000)
    session = session_id or f"session-{turn_id}"
    spec = TurnSpec(
        turn_id=turn_id,
        session_id=session,
        scenario=scenario.model_dump(mode="json"),
        created_at=now,
    )
    return spec, initial_record(turn_id, session, scenario, now_ms=now)


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
    host_rss_mib: list[float] = field(default_factory=list)
    """Resident memory of each TurnActor at the end of a Ray run (empty in-process)."""
    unfinished: list[str] = field(default_factory=list)
    """Turns without a final record when the run ended (interrupted by Redis, fenced by an
    owner that had not finished yet, unreadable); ``phaseline resume`` picks them up."""
    suspended: list[str] = field(default_factory=list)
    """Turns parked as ``suspended:poison``; ``phaseline resume TURN`` runs one again."""

    @property
    def all_final(self) -> bool:
        """Every turn of the run reached a final record (what exit status 0 promises)."""
        return not self.unfinished and not self.quarantined and not self.suspended

    def add(self, outcome: TurnOutcome) -> None:
        self.turns += 1
        self.outcomes[outcome.outcome] += 1
        if outcome.outcome == SUSPENDED_POISON:
            self.suspended.append(outcome.turn_id)
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
            "host_rss_mib": self.host_rss_mib,
            "unfinished": len(self.unfinished),
            "suspended": len(self.suspended),
        }


class TurnEngine:
    """Runs turns in this event loop. Callers hold turn ids, never loop objects."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: KeyLayout,
        *,
        loop_settings: LoopSettings = LoopSettings(),
        watchdog: WatchdogSettings | None = WatchdogSettings(),
        registry: ToolRegistry = BUILTIN_TOOLS,
        checkpoints: Checkpointer | None = None,
        runner: ToolRunner | None = None,
        on_transition: Callable[[Transition], None] | None = None,
        on_status: Callable[[SoftIdle], None] | None = None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        durability: Durability = Durability(),
        on_isolate: Callable[[str], None] | None = None,
        probation_patience_s: float = 30.0,
    ) -> None:
        """``on_isolate`` hears of every turn this engine queued for the isolation host."""
        self.keys = keys
        self.store = RedisCheckpointStore(
            client, keys, max_record_bytes=max_record_bytes, durability=durability
        )
        self.ledger = ToolLedger(client, keys)
        self.effects = EffectCounters(client, keys)
        self.inbox = Inbox(client, keys)
        self.approvals = Approvals(client, keys)
        self.isolation = Isolation(client, keys)
        self.checkpoints: Checkpointer = checkpoints or self.store
        self.loop_settings = loop_settings
        self.registry = registry
        self.runner: ToolRunner = runner or LocalToolRunner()
        self.rules = None if watchdog is None else WatchdogRules(watchdog)
        self.stats = RunStats()
        self._loops: dict[str, TurnLoop] = {}
        self.on_transition = on_transition
        self._on_status = on_status
        self._on_isolate = on_isolate
        self.probation_patience_s = probation_patience_s
        self._notes: _ProbationNotes | None = None
        """The hooks of the probation running now (detached when patience runs out)."""
        self._died_first: str | None = None
        """The turn inside whose step the previous isolation host died: it runs first."""
        self._unended: tuple[str, int] | None = None
        """A probation whose marker could not be cleared yet (Redis was away): cleared before
        the next one starts, or its leftover marker would read as a death."""

    @classmethod
    def from_settings(cls, client: aioredis.Redis, settings: Settings, **kw: Any) -> TurnEngine:
        kw.setdefault("watchdog", settings.watchdog)
        kw.setdefault("max_record_bytes", settings.checkpoint.max_record_bytes)
        kw.setdefault("durability", settings.redis.durability_policy())
        kw.setdefault("probation_patience_s", settings.supervisor.probation_patience_s)
        return cls(
            client,
            KeyLayout(settings.redis.namespace, settings.redis.shards),
            loop_settings=settings.loop_settings(),
            **kw,
        )

    # -- submitting and running ---------------------------------------------------------------

    async def submit(
        self, scenario: Scenario, turn_id: str, *, session_id: str | None = None
    ) -> CheckpointRecord:
        """Create one turn in Redis (spec + first record, atomically)."""
        (record,) = await self.submit_many(scenario, [turn_id], session_id=session_id)
        return record

    async def submit_many(
        self, scenario: Scenario, turn_ids: Iterable[str], *, session_id: str | None = None
    ) -> list[CheckpointRecord]:
        """Create turns in Redis, grouped per shard; a duplicate id raises TurnExists."""
        self.registry.require(scenario.tools)
        turns = [new_turn(scenario, t, session_id=session_id) for t in turn_ids]
        for result in await self.store.submit_many(turns):
            if isinstance(result, Exception):
                raise result
        return [record for _, record in turns]

    async def run_new(self, scenario: Scenario, turn_ids: Iterable[str]) -> RunStats:
        """Submit and run turns concurrently; returns the stats of this batch."""
        records = await self.submit_many(scenario, turn_ids)
        return await self._run_all([self.start(r, scenario) for r in records])

    async def resume_all(self) -> RunStats:
        """Resume every in-progress turn in the store (after its process died): the shared ones
        together, then the isolated ones alone, one at a time (``actors.turn.poison``)."""
        await self.note_predecessor(died=True)
        scan = await self.store.load_in_progress()
        self.stats.quarantined.extend(e.key for e in scan.errors)
        return await self.resume_turns([r.turn_id for r in scan.records])

    async def resume_turns(self, turn_ids: Sequence[str]) -> RunStats:
        """Resume these turns; those the policy isolates (now or before) run alone after."""
        queued = await self.isolation.members()
        shared = [t for t in turn_ids if t not in queued]
        isolated = [t for t in turn_ids if t in queued]

        async def everything() -> list[TurnOutcome]:
            first = list(await asyncio.gather(*(self.resume(t) for t in shared)))
            isolated.extend(o.turn_id for o in first if o.outcome == "isolate")
            return [o for o in first if o.outcome != "isolate"] + await self._alone(isolated)

        return await self._run_all_from(everything)

    async def _alone(self, turn_ids: list[str]) -> list[TurnOutcome]:
        """Probation runs of queued turns, one at a time in queue order (waiting out their
        backoff); a released turn, or one that outlasted the patience, goes on beside the
        next probation."""
        wanted = set(turn_ids)
        ended: list[TurnOutcome] = []
        going: list[asyncio.Task[TurnOutcome]] = []
        while wanted:
            turn_id, wait_s = await self.next_probation(among=wanted)
            if turn_id is None:
                wanted &= await self.isolation.members()  # others may have taken some off
                if not wanted or wait_s is None:
                    break
                await asyncio.sleep(wait_s)  # the backoff of the next isolated attempt
                continue
            wanted.discard(turn_id)
            task = await self.probation_settled(turn_id)
            if task.done() and task.result().outcome == "interrupted":
                ended.append(task.result())
                break  # Redis is away: the next resume carries on
            going.append(asyncio.ensure_future(self._after_probation(task)))
        return ended + [o for o in await asyncio.gather(*going) if o.turn_id in turn_ids]

    async def probation_settled(self, turn_id: str) -> asyncio.Task[TurnOutcome]:
        """Start the probation of ``turn_id`` and return once it ended or the patience ran out
        (then it is detached: no longer on probation, it goes on like any resumed turn)."""
        task = asyncio.ensure_future(self.probation(turn_id))
        await asyncio.wait({task}, timeout=self.probation_patience_s)
        if not task.done():
            log.warning(
                "turn %s: no checkpoint after %.0f s alone; not a crash loop, it goes on beside "
                "the next probation", turn_id, self.probation_patience_s,
            )  # fmt: skip
            await self.detach_probation()
        return task

    async def _after_probation(self, task: asyncio.Task[TurnOutcome]) -> TurnOutcome:
        outcome = await task
        if outcome.outcome == "released":
            return await self.resume(outcome.turn_id)
        return outcome

    async def detach_probation(self) -> None:
        """End the running probation early: its marker and queue entry go, its steps are no
        longer noted, it is no longer released at its checkpoint."""
        notes = self._notes
        if notes is None:
            return
        notes.detached = True
        self._notes = None
        self._unended = None
        await self.isolation.end(notes.turn_id, notes.epoch)
        await self.isolation.remove(notes.turn_id)

    async def resume(self, turn_id: str, plan: ResumePlan | None = None) -> TurnOutcome:
        """Continue a turn from its last checkpoint under a new epoch (claimed by the plan).
        A turn the policy isolates is queued for the isolation host instead (``isolate``)."""
        if plan is None:
            plan = await plan_resume(self.store, self.ledger, self.inbox, turn_id)
        if plan.action == "isolate":
            await self.isolation.enqueue(turn_id)
            log.warning("turn %s: %s", turn_id, plan.detail)
            if self._on_isolate is not None:
                self._on_isolate(turn_id)
            return TurnOutcome(turn_id, "isolate", 0, 0, 0, 0)
        return await self._run_plan(plan)

    async def _run_plan(self, plan: ResumePlan, **loop_kw: Any) -> TurnOutcome:
        turn_id = plan.turn_id
        if plan.action == "unusable":
            self.stats.quarantined.append(turn_id)
        if plan.action == "suspended" and plan.record is not None:
            log.error("turn %s suspended: %s", turn_id, plan.record.counters.isolated_deaths)
            return TurnOutcome(turn_id, plan.detail, plan.record.epoch, 1, 0, 0)
        if plan.action != "resume" or plan.record is None or plan.scenario is None:
            log.warning("turn %s not resumed: %s (%s)", turn_id, plan.action, plan.detail)
            return TurnOutcome(turn_id, plan.action, 0, 0, 0, 0)
        self.stats.resumed += 1
        loop = self.build_loop(plan.record, plan.scenario, resume_from=plan.resume_from, **loop_kw)
        return await self.drive(loop)

    # -- isolation ----------------------------------------------------------------------------

    async def note_predecessor(self, *, died: bool) -> None:
        """Start of an isolation host (or of an in-process resume): read the probation marker
        the previous one left. After a death, its turn goes first, once its backoff is over
        (no other probation may replace the marker before that turn's claim has recorded the
        death); after a freeze (``died`` False) the marker is no evidence and is dropped."""
        marker = await self.isolation.current()
        if marker is None:
            return
        if not died:
            await self.isolation.forget()
            return
        try:
            record = await self.store.load(marker.turn_id)
        except StoreError:  # RecordNotFound and RecordError included: nothing to count
            return
        if died_inside(marker, record) is not None:
            deaths = len(record.counters.isolated_deaths) + 1
            await self.isolation.enqueue(marker.turn_id, delay_s=isolation_backoff_s(deaths))
            self._died_first = marker.turn_id

    async def next_probation(
        self, among: Collection[str] | None = None
    ) -> tuple[str | None, float | None]:
        """The queued turn to run alone next (of ``among``, if given), or None and the seconds
        until one is due (None: nothing queued). The turn whose isolation host died goes
        first."""
        ready, wait_s = await self.isolation.due()
        if among is not None:
            ready = [t for t in ready if t in among]
        first = self._died_first
        if first is not None and (among is None or first in among) and first not in ready:
            if first in await self.isolation.members():
                return None, wait_s  # still in its backoff: nothing else may run before it
            self._died_first = first = None
        if first is not None and first in ready:
            return first, None
        return (ready[0], None) if ready else (None, wait_s)

    async def probation(self, turn_id: str) -> TurnOutcome:
        """Claim a queued turn for the isolation host and run it alone until its first
        checkpoint (``released``), its end, or suspension; takes it off the queue unless Redis
        cut the run short."""
        if self._unended is not None:
            await self.isolation.end(*self._unended)
            self._unended = None
        plan = await plan_resume(
            self.store, self.ledger, self.inbox, turn_id,
            isolated=True, marker=await self.isolation.current(),
        )  # fmt: skip
        if turn_id == self._died_first:
            self._died_first = None  # its claim has recorded the death: it went first
        if plan.action != "resume" or plan.record is None:
            outcome = await self._run_plan(plan)
            await self.isolation.remove(turn_id)
            return outcome
        epoch = plan.record.epoch
        await self.isolation.begin(turn_id, epoch)
        self._unended = (turn_id, epoch)
        notes = self._notes = _ProbationNotes(self.isolation, turn_id, epoch)
        outcome = await self._run_plan(plan, probation=notes)
        if notes.detached:
            return outcome  # released from probation early: its marker and entry are gone
        self._notes = None
        try:
            await self.isolation.end(turn_id, epoch)
            self._unended = None
        except StoreError as exc:
            log.warning("probation marker of %s not cleared yet: %s", turn_id, exc)
        if outcome.outcome != "interrupted":
            await self.isolation.remove(turn_id)
        return outcome

    async def _run_all(self, coros: Sequence[Awaitable[TurnOutcome]]) -> RunStats:
        async def together() -> list[TurnOutcome]:
            return list(await asyncio.gather(*coros))

        return await self._run_all_from(together)

    async def _run_all_from(self, work: Callable[[], Awaitable[list[TurnOutcome]]]) -> RunStats:
        started = time.monotonic()
        ticker = None if self.rules is None else asyncio.ensure_future(self._watchdog())
        try:
            outcomes = await work()
        finally:
            if ticker is not None:
                ticker.cancel()
        for outcome in outcomes:
            self.stats.add(outcome)
        self.stats.wall_s += time.monotonic() - started
        self.stats.unfinished.extend(await self._still_in_progress(outcomes))
        return self.stats

    async def _still_in_progress(self, outcomes: Sequence[TurnOutcome]) -> list[str]:
        """Turns this run did not end, and that no other owner has ended since either."""
        left = []
        for o in outcomes:
            if o.outcome not in NOT_ENDED or o.turn_id in self.stats.quarantined:
                continue
            try:
                if (await self.store.load(o.turn_id)).in_progress:
                    left.append(o.turn_id)
            except StoreError:  # RecordNotFound included
                left.append(o.turn_id)  # unreadable now: certainly not known to be final
        return left

    def build_loop(
        self,
        record: CheckpointRecord,
        scenario: Scenario,
        *,
        resume_from: str | None = None,
        settings: LoopSettings | None = None,
        probation: ProbationHooks | None = None,
        **deps: Any,
    ) -> TurnLoop:
        """A loop for ``record`` wired to this engine; ``deps`` replace TurnDeps members."""
        registry = self.registry.with_approval(scenario.require_approval)
        wired = TurnDeps(
            llm=ScriptedLLM(scenario, baseline=record.baseline),
            tools=BatchExecutor(registry, self.runner, self.ledger, self.effects),
            registry=registry,
            checkpoints=self.checkpoints,
            inbox=self.inbox,
            approvals=self.approvals,
            listener=self._transition,
        )
        return TurnLoop(
            record,
            dataclasses.replace(wired, **deps),
            settings or self.loop_settings,
            resume_from=resume_from,
            probation=probation,
        )

    async def drive(self, loop: TurnLoop) -> TurnOutcome:
        """Run a loop to its end, reachable by :meth:`cancel_llm` while it runs."""
        self._loops[loop.turn_id] = loop
        try:
            return await loop.run()
        except StoreError as exc:
            # Redis failed under this turn. Its last checkpoint is intact and still marked in
            # progress, so a resume picks it up; the other turns go on.
            log.error("turn %s interrupted: %s", loop.turn_id, exc)
            return loop.interrupted()
        finally:
            self._loops.pop(loop.turn_id, None)

    async def start(
        self, record: CheckpointRecord, scenario: Scenario, *, resume_from: str | None = None
    ) -> TurnOutcome:
        return await self.drive(self.build_loop(record, scenario, resume_from=resume_from))

    # -- what watchdogs and operators may ask -------------------------------------------------

    def running(self) -> list[str]:
        return list(self._loops)

    def phases(self) -> list[Transition]:
        """The current phase of every running turn, as the transition that entered it."""
        out = []
        for loop in self._loops.values():
            t = loop.tracker
            out.append(
                Transition(t.turn_id, t.epoch, t.seq, t.phase, t.phase, int(t.entered_at * 1000))
            )
        return out

    def cancel_llm(self, turn_id: str, epoch: int, cause: str) -> bool:
        """Cancel a running turn's model call, if it is still that epoch's."""
        loop = self._loops.get(turn_id)
        if loop is None or loop.epoch != epoch:
            return False
        cancelled = loop.cancel_llm(cause)
        self.stats.hard_cancels += cancelled
        return cancelled

    def pending_approval(self, turn_id: str) -> str | None:
        """Call key a running turn waits on for approval, if any."""
        loop = self._loops.get(turn_id)
        return None if loop is None else loop.pending_approval

    # -- local watchdog -----------------------------------------------------------------------

    def _transition(self, t: Transition) -> None:
        if self.rules is not None:
            self.rules.observe(t)
        if self.on_transition is not None:
            self.on_transition(t)

    async def _watchdog(self) -> None:
        assert self.rules is not None
        while True:
            await asyncio.sleep(self.rules.config.tick_s)  # the watchdog's own tick period
            for action in self.rules.tick(time.time()):
                if isinstance(action, HardCancel):
                    self.cancel_llm(action.turn_id, action.epoch, action.cause)
                else:
                    self.stats.idle_soft += 1
                    log.info("turn %s: %s", action.turn_id, action.label)
                    if self._on_status is not None:
                        self._on_status(action)


@dataclass(slots=True)
class _ProbationNotes:
    """The probation hooks of one isolated run: its steps go to the probation marker."""

    isolation: Isolation
    turn_id: str
    epoch: int
    detached: bool = False
    """Patience ran out: it goes on as an ordinary run (no notes, no release)."""

    @property
    def releases(self) -> bool:
        return not self.detached

    async def step(self, step: str) -> None:
        if self.detached:
            return
        if not await self.isolation.step(self.turn_id, self.epoch, step):
            # A successor isolation host replaced this one's marker: stop before the step.
            raise StaleOwner(f"probation of {self.turn_id} epoch {self.epoch} taken over")


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


def turn_ids(run_id: str, n: int) -> list[str]:
    return [f"{run_id}-t{i:06d}" for i in range(n)]
