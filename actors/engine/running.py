"""The turns an engine runs right now, and what watchdogs and operators may ask of them: their
phases, an in-flight model call's cancel, an operator's cancel, the approval a turn waits on.

A base of :class:`~actors.engine.turn_engine.TurnEngine`, which registers each loop while it
drives it."""

from __future__ import annotations

from collections import Counter

from actors.engine.run_stats import RunStats
from actors.turn.loop import TurnLoop
from bus.phase import Transition, TurnPhase

__all__ = ["RunningTurns"]


class RunningTurns:
    """The loops running in this engine, by turn id."""

    _loops: dict[str, TurnLoop]
    """Each running turn's loop (added when driven, removed when it returns)."""
    stats: RunStats
    """What the engine's turns did (hard cancels are counted here)."""

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

    def phase_counts(self) -> Counter[TurnPhase]:
        """How many running turns are in each phase (a host's gauge, read every heartbeat:
        counted without building a transition per turn)."""
        return Counter(loop.tracker.phase for loop in self._loops.values())

    def cancel_llm(self, turn_id: str, epoch: int) -> bool:
        """Cancel a running turn's model call, if it is still that epoch's."""
        loop = self._loops.get(turn_id)
        if loop is None or loop.epoch != epoch:
            return False
        cancelled = loop.cancel_llm()
        self.stats.hard_cancels += cancelled
        return cancelled

    def cancel(self, turn_id: str) -> bool:
        """An operator's cancel, already durable in the turn's inbox (``actors.engine.cancel``):
        end its in-flight model call and waits now. False if the turn does not run here."""
        loop = self._loops.get(turn_id)
        if loop is None:
            return False
        loop.request_cancel()
        return True

    def pending_approval(self, turn_id: str) -> str | None:
        """Call key a running turn waits on for approval, if any."""
        loop = self._loops.get(turn_id)
        return None if loop is None else loop.pending_approval
