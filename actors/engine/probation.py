"""Probations: the turns the poison-turn policy isolated, run alone one at a time.

The isolation host (and ``phaseline resume --in-process``, after its shared turns) runs each
queued turn by itself until its first checkpoint (the loop stops ``released``), its end, or its
suspension. Before every step of a probation the probation marker names that step, so a
successor that finds the marker after a death knows where the turn killed its host
(``store.domain.isolation`` keeps the facts, ``actors.turn.poison`` decides what they mean). A
probation that saves nothing within the patience is detached: it goes on as an ordinary run,
so a slow turn cannot hold the queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from actors.engine.resume import Resume, ResumePlan, died_inside
from actors.turn.poison import isolation_backoff_s
from actors.turn.run_result import RunStop, TurnOutcome
from bus.errors import StaleOwner, StoreError
from store.domain.isolation import Isolation, Probation
from store.records import CheckpointRecord


class ProbationEngine(Protocol):
    """What probation runs need of the engine that drives them (``TurnEngine``)."""

    @property
    def isolation(self) -> Isolation: ...
    async def load(self, turn_id: str) -> CheckpointRecord: ...
    async def plan(
        self, turn_id: str, *, isolated: bool = False, marker: Probation | None = None
    ) -> ResumePlan: ...
    async def run_plan(self, plan: ResumePlan, **loop_kw: Any) -> TurnOutcome: ...
    async def resume(self, turn_id: str, plan: ResumePlan | None = None) -> TurnOutcome: ...


__all__ = ["Probations"]

log = logging.getLogger(__name__)


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


class Probations:
    """The probation runs of one engine; at most one runs at a time."""

    def __init__(self, engine: ProbationEngine, *, patience_s: float) -> None:
        self.engine = engine
        self.isolation = engine.isolation
        self.patience_s = patience_s
        self._notes: _ProbationNotes | None = None
        """The hooks of the probation running now (detached when patience runs out)."""
        self._died_first: str | None = None
        """The turn inside whose step the previous isolation host died: it runs first."""
        self._unended: tuple[str, int] | None = None
        """A probation whose marker could not be cleared yet (Redis was away): cleared before
        the next one starts, or its leftover marker would read as a death."""

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
            record = await self.engine.load(marker.turn_id)
        except StoreError:  # RecordNotFound and RecordError included: nothing to count
            return
        if died_inside(marker, record) is not None:
            deaths = len(record.counters.isolated_deaths) + 1
            await self.isolation.enqueue(marker.turn_id, delay_s=isolation_backoff_s(deaths))
            self._died_first = marker.turn_id

    async def next_turn(
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

    async def run(self, turn_id: str) -> TurnOutcome:
        """Claim a queued turn for the isolation host and run it alone until its first
        checkpoint (``released``), its end, or suspension; takes it off the queue unless Redis
        cut the run short."""
        if self._unended is not None:
            await self.isolation.end(*self._unended)
            self._unended = None
        engine = self.engine
        plan = await engine.plan(turn_id, isolated=True, marker=await self.isolation.current())
        if turn_id == self._died_first:
            self._died_first = None  # its claim has recorded the death: it went first
        if not isinstance(plan, Resume):
            outcome = await engine.run_plan(plan)
            await self.isolation.remove(turn_id)
            return outcome
        epoch = plan.record.epoch
        await self.isolation.begin(turn_id, epoch)
        self._unended = (turn_id, epoch)
        notes = self._notes = _ProbationNotes(self.isolation, turn_id, epoch)
        outcome = await engine.run_plan(plan, probation=notes)
        if notes.detached:
            return outcome  # released from probation early: its marker and entry are gone
        self._notes = None
        try:
            await self.isolation.end(turn_id, epoch)
            self._unended = None
        except StoreError as exc:
            log.warning("probation marker of %s not cleared yet: %s", turn_id, exc)
        if outcome.outcome is not RunStop.INTERRUPTED:
            await self.isolation.remove(turn_id)
        return outcome

    async def run_settled(self, turn_id: str) -> asyncio.Task[TurnOutcome]:
        """Start the probation of ``turn_id`` and return once it ended or the patience ran out
        (then it is detached: no longer on probation, it goes on like any resumed turn)."""
        task = asyncio.ensure_future(self.run(turn_id))
        await asyncio.wait({task}, timeout=self.patience_s)
        if not task.done():
            log.warning(
                "turn %s: no checkpoint after %.0f s alone; not a crash loop, it goes on beside "
                "the next probation",
                turn_id,
                self.patience_s,
            )
            await self.detach()
        return task

    async def detach(self) -> None:
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

    async def run_queued(self, turn_ids: list[str]) -> list[TurnOutcome]:
        """Probation runs of these queued turns, one at a time in queue order (waiting out
        their backoff); a released turn, or one that outlasted the patience, goes on beside the
        next probation. The in-process counterpart of the isolation host's loop."""
        wanted = set(turn_ids)
        ended: list[TurnOutcome] = []
        going: list[asyncio.Task[TurnOutcome]] = []
        while wanted:
            turn_id, wait_s = await self.next_turn(among=wanted)
            if turn_id is None:
                wanted &= await self.isolation.members()  # others may have taken some off
                if not wanted or wait_s is None:
                    break
                await asyncio.sleep(wait_s)  # the backoff of the next isolated attempt
                continue
            wanted.discard(turn_id)
            task = await self.run_settled(turn_id)
            if task.done() and task.result().outcome is RunStop.INTERRUPTED:
                ended.append(task.result())
                break  # Redis is away: the next resume carries on
            going.append(asyncio.ensure_future(self._after(task)))
        return ended + [o for o in await asyncio.gather(*going) if o.turn_id in turn_ids]

    async def _after(self, task: asyncio.Task[TurnOutcome]) -> TurnOutcome:
        outcome = await task
        if outcome.outcome is RunStop.RELEASED:
            return await self.engine.resume(outcome.turn_id)
        return outcome
