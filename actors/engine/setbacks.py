"""What becomes of a turn that cannot go on here: a run that failed with an unexpected error
(resumed after a backoff, suspended ``failing`` after three in a row), an agent that does not
load on this host (counted, suspended ``agent_unavailable`` after three), and parking a turn
with its reason (a fenced save), for the engine that runs turns
(:class:`~actors.engine.turn_engine.TurnEngine`)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from actors.turn.poison import step_name
from actors.turn.run_result import RunStop, TurnOutcome
from bus.errors import ConfigError, PoisonGeneration, StoreError
from bus.events import LiveEvent, Recovering
from bus.outcomes import Action, EngineProblem, Outcome, SaveReason
from bus.phase import TurnPhase
from store.records import (
    AGENT_FAILURES_TO_SUSPEND,
    RUN_FAILURES_TO_SUSPEND,
    CheckpointRecord,
    TurnError,
    TurnSpec,
)
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["Setbacks"]

log = logging.getLogger(__name__)


class Setbacks:
    """The setbacks of one engine's turns, and how many runs in a row of each failed here."""

    def __init__(
        self,
        store: RedisCheckpointStore,
        rerun: Callable[[CheckpointRecord], Awaitable[TurnOutcome]],
        *,
        on_event: Callable[[LiveEvent], None] | None,
        backoff_scale: float,
    ) -> None:
        """``rerun`` runs a failed turn again from its last stored record (the engine's)."""
        self.store = store
        self._rerun = rerun
        self.on_event = on_event
        self.backoff_scale = backoff_scale
        self._failures: dict[str, int] = {}

    def succeeded(self, turn_id: str) -> None:
        """A run of the turn ended normally: its failures in a row are over."""
        self._failures.pop(turn_id, None)

    async def run_failed(
        self, record: CheckpointRecord, exc: Exception, *, progressed: bool
    ) -> TurnOutcome:
        """A run of the turn ended in an unexpected error; ``record`` is its last stored one.
        The turn is resumed from it after a backoff (1 s, doubling; the loop's
        ``backoff_scale``), and after :data:`RUN_FAILURES_TO_SUSPEND` runs in a row with no
        checkpoint between them it is suspended with the error, as a poison turn is: it never
        spins on a live host, and the other turns go on."""
        tid = record.turn_id
        if isinstance(exc, PoisonGeneration):  # judged where it ran: parked at once
            return await self.poison_generation(record, exc)
        failures = self._failures[tid] = 1 if progressed else self._failures.get(tid, 0) + 1
        where = f"{socket.gethostname()} (pid {os.getpid()})"
        error = TurnError(
            source="host",
            kind="failed",
            at_ms=int(time.time() * 1000),
            message=f"{type(exc).__name__}: {exc} (on {where})"[:500],
        )
        log.error("turn %s failed (%d in a row): %s", tid, failures, error.message, exc_info=exc)
        if failures >= RUN_FAILURES_TO_SUSPEND:
            self._failures.pop(tid, None)
            return await self.park(record, Outcome.SUSPENDED_FAILING, error)
        wait = 2 ** (failures - 1) * self.backoff_scale
        if self.on_event is not None:
            self.on_event(
                Recovering(
                    tid,
                    record.epoch,
                    EngineProblem.RUN_FAILED,
                    Action.RETRY,
                    f"{error.message}; resuming from its last checkpoint in {wait:g} s",
                    error.at_ms,
                )
            )
        await asyncio.sleep(wait)  # backoff before the next run, not a synchronisation
        return await self._rerun(record)

    async def poison_generation(
        self, record: CheckpointRecord, exc: PoisonGeneration
    ) -> TurnOutcome:
        """A model call that killed its workers: suspended as a poison turn, the deaths kept
        as its evidence (a step each, as the host policy keeps them)."""
        error = TurnError(
            source="model", kind="poison", at_ms=int(time.time() * 1000), message=str(exc)[:500]
        )
        step = step_name(TurnPhase.AWAITING_LLM.value, len(record.messages))
        evidence = record.counters.isolated_deaths + (f"model_worker:{step}",) * exc.deaths
        record = record.model_copy(
            update={"counters": record.counters.model_copy(update={"isolated_deaths": evidence})}
        )
        return await self.park(record, Outcome.SUSPENDED_POISON, error)

    async def park(
        self, record: CheckpointRecord, outcome: Outcome, error: TurnError
    ) -> TurnOutcome:
        """Suspend the turn with ``outcome`` and why (a fenced save)."""
        log.error("turn %s: %s; suspended", record.turn_id, error.message)
        counters = record.counters.model_copy(update={"outcome": outcome, "last_error": error})
        parked = record.model_copy(
            update={
                "seq": record.seq + 1,
                "in_progress": False,
                "reason": SaveReason.SUSPENDED,
                "counters": counters,
                "updated_at": error.at_ms,
            }
        )
        try:
            await self.store.save(parked)
        except StoreError as exc:
            log.warning("turn %s: the suspension was not recorded: %s", record.turn_id, exc)
            return TurnOutcome.stopped(record.turn_id, RunStop.INTERRUPTED, record.epoch)
        return TurnOutcome.parked(record.turn_id, outcome, record.epoch, error)

    async def agent_changed(
        self, record: CheckpointRecord, spec: TurnSpec, changed: Exception
    ) -> TurnOutcome:
        """The turn's agent is not the one it started with (``[loop] on_agent_change =
        "suspend"``): suspended until an operator says to go on with it as it is now."""
        error = TurnError(
            source="agent",
            kind="changed",
            at_ms=int(time.time() * 1000),
            message=f"agent {spec.agent} changed since the turn started ({changed}); "
            f"phaseline resume {record.turn_id} goes on with it as it is now",
        )
        return await self.park(record, Outcome.SUSPENDED_AGENT_CHANGED, error)

    async def agent_unavailable(
        self, record: CheckpointRecord, spec: TurnSpec, exc: ConfigError
    ) -> TurnOutcome:
        """The turn's agent does not load here (a module or a variable this host lacks). The
        failure is counted in the record with its reason, so ``inspect`` and ``watch`` say
        what failed where; the turn stays in progress for another host (or this one, after a
        fix) to try at its next adopt, and after :data:`AGENT_FAILURES_TO_SUSPEND` failures in
        a row it is suspended (``phaseline resume TURN`` runs it again)."""
        c = record.counters
        failures = c.agent_failures + 1
        where = f"{socket.gethostname()} (pid {os.getpid()})"
        error = TurnError(
            source="agent",
            kind="unavailable",
            at_ms=int(time.time() * 1000),
            message=f"agent {spec.agent} cannot run on {where}: {exc}"[:500],
        )
        park = failures >= AGENT_FAILURES_TO_SUSPEND
        outcome = Outcome.SUSPENDED_AGENT_UNAVAILABLE if park else None
        noted = record.model_copy(
            update={
                "seq": record.seq + 1,
                "in_progress": not park,
                "reason": SaveReason.SUSPENDED if park else SaveReason.AGENT_UNAVAILABLE,
                "counters": c.model_copy(
                    update={"agent_failures": failures, "last_error": error, "outcome": outcome}
                ),
                "updated_at": error.at_ms,
            }
        )
        log.error(
            "turn %s: %s (%d in a row%s)",
            record.turn_id,
            error.message,
            failures,
            "; suspended" if park else "",
        )
        try:
            await self.store.save(noted)
        except StoreError as save_failed:  # fenced by a newer owner, or Redis away
            log.warning("turn %s: the failure was not recorded: %s", record.turn_id, save_failed)
            return TurnOutcome.stopped(record.turn_id, RunStop.INTERRUPTED, record.epoch)
        if outcome is not None:
            return TurnOutcome.parked(record.turn_id, outcome, record.epoch, error)
        return TurnOutcome(
            record.turn_id,
            RunStop.INTERRUPTED,
            record.epoch,
            saves=1,
            failed_saves=0,
            messages=0,
            error=error,
        )
