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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from actors.engine.agents import (
    AgentChanged,
    agent_fingerprint,
    load_agent,
    record_on,
    refuse_unrunnable,
)
from actors.engine.listeners import Listeners
from actors.engine.models.context import ModelServices
from actors.engine.on_finish import load_on_finish, on_finish_of
from actors.engine.probation import Probations
from actors.engine.resume import (
    Parked,
    ResumePlan,
    Skipped,
    claim_for_resume,
    plan_resume,
)
from actors.engine.run_stats import RunStats, still_in_progress
from actors.engine.running import RunningTurns
from actors.engine.setbacks import Setbacks
from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineHooks, EngineSettings
from actors.engine.submission import new_turns, queued_turn, session_turn
from actors.engine.tools.local_tools import LocalToolRunner
from actors.engine.tools.toolrun import (
    BatchExecutor,
    ToolRunner,
)
from actors.engine.turn_checkpoints import TurnCheckpoints
from actors.turn.deps import Checkpointer, ProbationHooks, TurnDeps
from actors.turn.loop import TurnLoop
from actors.turn.run_result import RunStop, TurnOutcome
from actors.turn.settings import LoopSettings
from actors.turn.watchdog import HardCancel, SoftIdle, WatchdogRules
from bus.errors import BudgetExhausted, ConfigError, PhaselineError, StaleOwner, StoreError
from bus.outcomes import Outcome, SaveReason
from bus.phase import Transition
from store.domain.approvals import Approvals
from store.domain.effects import EffectCounters
from store.domain.inbox import Inbox
from store.domain.isolation import Isolation, Probation
from store.domain.ledger import ToolLedger
from store.domain.sessions import Sessions
from store.keys import KeyLayout
from store.records import CheckpointRecord, ReplyJournal, TurnInput, TurnSpec
from store.redis.connection import StoreClient
from store.write.group_commit import GroupCommit

log = logging.getLogger(__name__)


class TurnEngine(RunningTurns):
    """Runs turns in this event loop. Callers hold turn ids, never loop objects."""

    def __init__(
        self,
        client: StoreClient,
        keys: KeyLayout,
        settings: EngineSettings = EngineSettings(),
        hooks: EngineHooks = EngineHooks(),
    ) -> None:
        self.keys = keys
        self.settings = settings
        self.hooks = hooks
        self.store = settings.checkpoint_store(client, keys)
        self.ledger = ToolLedger(client, keys)
        self.effects = hooks.effects or EffectCounters(client, keys)
        self.inbox = Inbox(client, keys)
        self.approvals = Approvals(client, keys)
        self.model_services = ModelServices(client, keys, self.effects)
        self.isolation = Isolation(client, keys)
        self.sessions = Sessions(self.store)
        self.checkpoints: Checkpointer = hooks.checkpoints or GroupCommit(self.store)
        self.runner: ToolRunner = hooks.runner or LocalToolRunner(
            threads=settings.tool_threads, on_event=hooks.on_event
        )
        self.rules = None if settings.watchdog is None else WatchdogRules(settings.watchdog)
        self.stats = RunStats()
        self._loops: dict[str, TurnLoop] = {}
        self.probations = Probations(self, patience_s=settings.probation_patience_s)
        self.setbacks = Setbacks(
            self.store,
            self._rerun,
            on_event=hooks.on_event,
            backoff_scale=settings.loop.backoff_scale,
        )
        self.listeners: Listeners | None = None
        """Who hears this engine's events (the live streams, the tracer), when it was made
        :meth:`from_settings`."""

    @classmethod
    def from_settings(
        cls,
        client: StoreClient,
        settings: Settings,
        hooks: EngineHooks = EngineHooks(),
        *,
        watchdog: bool = True,
        publish: bool = True,
    ) -> TurnEngine:
        """The engine ``settings`` describe, with ``hooks``, the live streams (``publish``; a
        Ray host brings its own publisher) and the tracer of ``[telemetry]`` listening, and
        ``[retention] on_finish`` loaded unless ``hooks`` has one. ``watchdog=False``: no
        watchdog in this process."""
        if settings.retention.on_finish and hooks.on_finish is None:
            hooks = dataclasses.replace(
                hooks, on_finish=load_on_finish(settings.retention.on_finish)
            )
        listeners = Listeners.of(
            client,
            settings,
            on_transition=hooks.on_transition,
            on_event=hooks.on_event,
            publish=publish,
        )
        engine = cls(
            client,
            settings.redis.key_layout(),
            EngineSettings.of(settings, watchdog=watchdog),
            dataclasses.replace(
                hooks, on_transition=listeners.on_transition(), on_event=listeners.on_event()
            ),
        )
        engine.listeners = listeners
        return engine

    async def aclose(self) -> None:
        """Publish the live events still buffered and export the spans (end of a run)."""
        if self.listeners is not None:
            await self.listeners.aclose()

    # -- submitting and running ---------------------------------------------------------------

    async def submit(
        self, agent: str, turn_input: TurnInput, turn_id: str, *, session_id: str | None = None
    ) -> CheckpointRecord:
        """Create one turn of ``agent`` in Redis (spec + first record, atomically)."""
        ((_, record),) = await self.submit_many(agent, turn_input, [turn_id], session_id=session_id)
        return record

    async def submit_many(
        self,
        agent: str,
        turn_input: TurnInput,
        turn_ids: Iterable[str],
        *,
        session_id: str | None = None,
    ) -> list[tuple[TurnSpec, CheckpointRecord]]:
        """Create turns of ``agent`` in Redis (spec + first record, atomically, grouped per
        shard); a duplicate id raises TurnExists."""
        turns = await self._submit(agent, turn_input, turn_ids, session_id=session_id)
        return [(spec, record) for spec, record, _ in turns]

    async def _submit(
        self,
        agent: str,
        turn_input: TurnInput,
        turn_ids: Iterable[str],
        *,
        session_id: str | None = None,
    ) -> list[tuple[TurnSpec, CheckpointRecord, int | None]]:
        """:meth:`submit_many`, with the turn's inbox length each submission answered: a turn
        started here at once needs no inbox read before its first model call."""
        turns = new_turns(agent, turn_input, turn_ids, session_id=session_id)
        out = []
        for (spec, record), result in zip(turns, await self.store.submit_many(turns), strict=True):
            if isinstance(result, Exception):
                raise result
            out.append((spec, record, result.inbox_len))
        return out

    async def run_one(self, agent: str, turn_input: TurnInput, turn_id: str) -> TurnOutcome:
        """Submit one turn and run it here to its end, with nothing around it (no watchdog
        ticker, no :attr:`stats`): two round trips to Redis per tool round and two more."""
        ((spec, record, inbox_len),) = await self._submit(agent, turn_input, [turn_id])
        return await self.start(record, spec, inbox_len=inbox_len)

    async def open_in_session(
        self, agent: str, turn_input: TurnInput, session_id: str
    ) -> tuple[TurnSpec, CheckpointRecord]:
        """Create the session's next turn (``store.domain.sessions``): its baseline is the previous
        turn's final transcript; :class:`SessionBusy` while that turn is not final."""
        return await self.sessions.open(session_id, session_turn(agent, turn_input, session_id))

    async def open_queued(self, session_id: str) -> tuple[TurnSpec, CheckpointRecord] | None:
        """Open the session's next queued turn (``submit --if-busy queue``) if the session is
        free; None if its queue is empty or its turn still runs. A queued turn whose agent
        cannot load here stays queued (logged) for a host where it can."""
        try:
            return await self.sessions.open_queued(session_id, queued_turn(session_id))
        except (ConfigError, BudgetExhausted) as exc:
            log.error("session %s: its next queued turn cannot open here: %s", session_id, exc)
            return None

    async def open_all_queued(self) -> list[tuple[TurnSpec, CheckpointRecord]]:
        """The next queued turn of every free session with a queue, opened."""
        opened = [await self.open_queued(s) for s in await self.queued_sessions()]
        return [turn for turn in opened if turn is not None]

    async def run_in_session(
        self, agent: str, turn_input: TurnInput, session_id: str
    ) -> TurnOutcome:
        """Open the session's next turn and run it to its end."""
        spec, record = await self.open_in_session(agent, turn_input, session_id)
        return await self.start(record, spec)

    async def run_new(self, agent: str, turn_input: TurnInput, turn_ids: Iterable[str]) -> RunStats:
        """Submit and run turns concurrently; returns the stats of this batch. An agent that
        cannot start in this process (a variable its model needs unset here) is refused with
        :class:`ConfigError` before anything is written: its turns would wait for ever."""
        refuse_unrunnable(agent, turn_input)
        turns = await self._submit(agent, turn_input, turn_ids)
        return await self._run_all(
            [self.start(record, spec, inbox_len=n) for spec, record, n in turns]
        )

    async def resume_all(self) -> RunStats:
        """Resume every in-progress turn in the store (after its process died): the shared ones
        together, then the isolated ones alone, one at a time (``actors.turn.poison``)."""
        await self.open_all_queued()  # sessions whose running turn ended: their next turns
        scan = await self.store.load_in_progress()
        self.stats.quarantined.extend(e.key for e in scan.errors)
        stats = await self.resume_turns([r.turn_id for r in scan.records], after_death=True)
        # what those turns ended freed their sessions: run the queued turns, in order
        while opened := await self.open_all_queued():
            stats = await self._run_all([self.start(record, spec) for spec, record in opened])
        return stats

    async def resume_turns(self, turn_ids: Sequence[str], *, after_death: bool = False) -> RunStats:
        """Resume these turns; those the policy isolates (now or before) run alone after.
        ``after_death``: the process that ran them died, so a probation marker it left is
        evidence (``Probations.note_predecessor``)."""
        if after_death:
            await self.probations.note_predecessor(died=True)
        queued = await self.isolation.members()
        shared = [t for t in turn_ids if t not in queued]
        isolated = [t for t in turn_ids if t in queued]

        async def everything() -> list[TurnOutcome]:
            first = list(await asyncio.gather(*(self.resume(t) for t in shared)))
            isolated.extend(o.turn_id for o in first if o.outcome is RunStop.ISOLATE)
            rest = [o for o in first if o.outcome is not RunStop.ISOLATE]
            return rest + await self.probations.run_queued(isolated)

        return await self._run_all_from(everything)

    async def start_submitted(self, turn_id: str) -> TurnOutcome | None:
        """Start a turn as it was submitted; None if it ran before (somewhere), or its spec is
        gone, and a plan must decide. A record that cannot be read is an ``unusable`` stop."""
        try:
            record, spec, inbox_len = await self.store.load_start(turn_id)
        except PhaselineError as exc:  # not found, undecodable, or Redis away
            log.error("turn %s cannot start: %s", turn_id, exc)
            return TurnOutcome.stopped(turn_id, RunStop.UNUSABLE)
        fresh = record.reason is SaveReason.SUBMITTED and record.epoch == 1 and record.in_progress
        if fresh and spec is not None:
            return await self.start(record, spec, inbox_len=inbox_len)
        return None  # a record without its spec too: the plan quarantines it

    async def adoptable(self) -> list[str]:
        """The in-progress turns in the store that an ordinary host may adopt: all but those
        queued for the isolation host."""
        queued = await self.isolation.members()
        return [t for t in await self.store.list_in_progress() if t not in queued]

    async def queued_sessions(self) -> list[str]:
        """The sessions with turns queued behind their running one (``submit --if-busy queue``)."""
        return await self.sessions.queued_sessions()

    async def load(self, turn_id: str) -> CheckpointRecord:
        """The turn's stored record (:class:`RecordNotFound`, :class:`RecordError`)."""
        return await self.store.load(turn_id)

    async def plan(
        self, turn_id: str, *, isolated: bool = False, marker: Probation | None = None
    ) -> ResumePlan:
        """Load, inspect and claim a turn to resume it (``actors.engine.resume``)."""
        return await plan_resume(
            self.store, self.ledger, self.inbox, turn_id, isolated=isolated, marker=marker
        )

    async def resume(self, turn_id: str, plan: ResumePlan | None = None) -> TurnOutcome:
        """Continue a turn from its last checkpoint under a new epoch (claimed by the plan).
        A turn the policy isolates is queued for the isolation host instead (``isolate``)."""
        if plan is None:
            plan = await self.plan(turn_id)
        if isinstance(plan, Skipped) and plan.stop is RunStop.ISOLATE:
            await self.isolation.enqueue(turn_id)
            log.warning("turn %s: %s", turn_id, plan.detail)
            if self.hooks.on_isolate is not None:
                self.hooks.on_isolate(turn_id)
            return TurnOutcome.stopped(turn_id, RunStop.ISOLATE)
        return await self.run_plan(plan)

    async def run_plan(self, plan: ResumePlan, **loop_kw: Any) -> TurnOutcome:
        """Carry out a plan: run its claimed record (``loop_kw`` go to :meth:`build_loop`), or
        report why there is nothing to run."""
        turn_id = plan.turn_id
        match plan:
            case Parked(record=record):
                log.error("turn %s suspended: %s", turn_id, record.counters.isolated_deaths)
                return TurnOutcome.parked(turn_id, Outcome.SUSPENDED_POISON, record.epoch)
            case Skipped(stop=stop, detail=detail):
                if stop is RunStop.UNUSABLE:
                    self.stats.quarantined.append(turn_id)
                log.warning("turn %s not resumed: %s (%s)", turn_id, stop, detail)
                return TurnOutcome.stopped(turn_id, stop)
        self.stats.resumed += 1
        return await self.start(
            plan.record,
            plan.spec,
            resume_from=plan.resume_from,
            journal=plan.journal,
            lost_reply=plan.lost_reply,
            **loop_kw,
        )

    async def _run_all(self, coros: Sequence[Awaitable[TurnOutcome]]) -> RunStats:
        async def together() -> list[TurnOutcome]:
            return list(await asyncio.gather(*coros))

        return await self._run_all_from(together)

    async def _run_all_from(self, work: Callable[[], Awaitable[list[TurnOutcome]]]) -> RunStats:
        started = time.monotonic()
        ticker = None
        if self.rules is not None:
            ticker = asyncio.ensure_future(
                self.rules.run(hard=self._hard_cancel, soft=self._soft_idle)
            )
        try:
            outcomes = await work()
        finally:
            if ticker is not None:
                ticker.cancel()
        for outcome in outcomes:
            self.stats.add(outcome)
        self.stats.wall_s += time.monotonic() - started
        self.stats.unfinished.extend(
            await still_in_progress(self.store, outcomes, skip=set(self.stats.quarantined))
        )
        return self.stats

    async def build_loop(
        self,
        record: CheckpointRecord,
        spec: TurnSpec,
        *,
        resume_from: SaveReason | None = None,
        settings: LoopSettings | None = None,
        probation: ProbationHooks | None = None,
        inbox_len: int | None = None,
        journal: ReplyJournal | None = None,
        lost_reply: str = "",
        **deps: Any,
    ) -> TurnLoop:
        """A loop for ``record`` running the agent of ``spec``, wired to this engine; ``deps``
        replace TurnDeps members."""
        agent = load_agent(spec.agent)
        registry = await self.runner.registry(spec.agent, agent, spec.input)
        record = record_on(
            record,
            spec.agent,
            agent_fingerprint(agent, registry),
            self.settings.on_agent_change,
            on_event=self.hooks.on_event,
        )
        llm = agent.client(self.model_services.context(record.turn_id, spec.input, record.baseline))
        if self.hooks.models is not None:
            llm = self.hooks.models.client(llm, spec, record)
        wired = TurnDeps(
            llm=llm,
            tools=BatchExecutor(
                registry,
                self.runner,
                self.ledger,
                self.effects,
                agent=spec.agent,
                max_result_bytes=self.settings.max_tool_result_bytes,
                max_record_bytes=self.settings.max_record_bytes,
            ),
            registry=registry,
            checkpoints=TurnCheckpoints(self.checkpoints, self.ledger),
            inbox=self.inbox,
            approvals=self.approvals,
            listener=self._transition,
            events=self.hooks.on_event,
        )
        tuned = agent.settings.tuned(settings or self.settings.loop)
        given = deps.get("checkpoints")
        if given is not None and not isinstance(given, TurnCheckpoints):  # for this turn
            deps["checkpoints"] = TurnCheckpoints(given, self.ledger)
        chosen = dataclasses.replace(wired, **deps)
        return TurnLoop(
            record,
            chosen,
            tuned,
            resume_from=resume_from,
            probation=probation,
            inbox_len=inbox_len,
            journal=journal,
            lost_reply=lost_reply,
        )

    async def drive(self, loop: TurnLoop) -> TurnOutcome:
        """Run a loop to its end, reachable by :meth:`cancel_llm` while it runs."""
        self._loops[loop.turn_id] = loop
        started_at = loop.saved.seq
        how = "failed"  # what a trace calls this run if it raised
        try:
            outcome = await loop.run()
            how = outcome.outcome.value
        except StoreError as exc:
            how = "interrupted"
            # Redis failed under this turn. Its last checkpoint is intact and still marked in
            # progress, so a resume picks it up; the other turns go on.
            log.error("turn %s interrupted: %s", loop.turn_id, exc)
            return loop.interrupted()
        except Exception as exc:  # a bug (the agent's code, phaseline's): this turn's alone
            progressed = loop.saved.seq > started_at
            return await self.setbacks.run_failed(loop.saved, exc, progressed=progressed)
        finally:
            self._loops.pop(loop.turn_id, None)
            if self.listeners is not None and self.listeners.tracer is not None:
                self.listeners.tracer.run_ended(
                    loop.turn_id, loop.epoch, int(time.time() * 1000), how
                )
        self.setbacks.succeeded(loop.turn_id)
        final, hook = loop.saved, self.hooks.on_finish
        ended = isinstance(outcome.outcome, Outcome) and not outcome.outcome.suspended
        if hook is not None and ended and not final.in_progress:
            self.stats.on_finish_failures += not await on_finish_of(hook, final, self.ledger)
        return outcome

    async def start(self, record: CheckpointRecord, spec: TurnSpec, **loop_kw: Any) -> TurnOutcome:
        """Run ``record`` (``loop_kw`` go to :meth:`build_loop`). An agent that does not load
        here leaves the turn in progress for a host where it does."""
        try:
            loop = await self.build_loop(record, spec, **loop_kw)
        except ConfigError as exc:
            return await self.setbacks.agent_unavailable(record, spec, exc)
        except AgentChanged as changed:
            return await self.setbacks.agent_changed(record, spec, changed)
        except Exception as exc:  # the agent's own code failed while its turn was set up
            return await self.setbacks.run_failed(record, exc, progressed=False)
        return await self.drive(loop)

    async def _rerun(self, record: CheckpointRecord) -> TurnOutcome:
        """Run a failed turn again from ``record``, its last stored one, under a new epoch
        (a claim, so whatever its failed run left behind is fenced). Not through the
        poison-turn planner: this host did not die, it caught the failure."""
        claimed = claim_for_resume(record, now_ms=int(time.time() * 1000))
        try:
            await self.store.save(claimed)
            spec = await self.store.load_spec(record.turn_id)
        except StaleOwner:  # another owner took it meanwhile: theirs now
            return TurnOutcome.stopped(record.turn_id, RunStop.FENCED, record.epoch)
        except StoreError as exc:
            log.error("turn %s interrupted: %s", record.turn_id, exc)
            return TurnOutcome.stopped(record.turn_id, RunStop.INTERRUPTED, record.epoch)
        return await self.start(claimed, spec, resume_from=record.reason)

    # -- local watchdog -----------------------------------------------------------------------

    def _transition(self, t: Transition) -> None:
        if self.rules is not None:
            self.rules.observe(t)
        if self.hooks.on_transition is not None:
            self.hooks.on_transition(t)

    def _soft_idle(self, action: SoftIdle) -> None:
        self.stats.idle_soft += 1
        log.info("turn %s: %s", action.turn_id, action.label)
        if self.hooks.on_status is not None:
            self.hooks.on_status(action)

    def _hard_cancel(self, action: HardCancel) -> None:
        self.cancel_llm(action.turn_id, action.epoch)
