"""How one run of a turn ended (:class:`TurnOutcome`): with an outcome stored in its final
record, or a stop that leaves the turn for a later run (:class:`RunStop`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from bus.outcomes import Outcome
from store.records import TurnError


class RunStop(StrEnum):
    """Why a run returned without an outcome of its own. Reports count these beside the
    :class:`~store.records.Outcome` values."""

    FENCED = "fenced"
    """A newer owner refused this incarnation's save or dispatch."""
    RELEASED = "released"
    """A probation run reached its first checkpoint; its slot resumes it."""
    INTERRUPTED = "interrupted"
    """Redis failed under the run; the turn is resumable from its last checkpoint."""
    ISOLATE = "isolate"
    """Not run (set by the engine): the poison-turn policy queued it for the isolation host."""
    UNUSABLE = "unusable"
    """Not run (set by the engine): its record or spec could not be read (quarantined)."""
    FINISHED = "finished"
    """Not run (set by the engine): the turn had ended already."""

    @property
    def leaves_in_progress(self) -> bool:
        """The turn's record may still be in progress after this run: someone must end it."""
        return self is not RunStop.FINISHED


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """How a run of a turn ended, as seen by the loop (or engine) that ran it."""

    turn_id: str
    """The turn."""
    outcome: Outcome | RunStop
    """How the turn ended (an :class:`Outcome`, stored in its final record), or why this run
    stopped without ending it (a :class:`RunStop`)."""
    epoch: int
    """Epoch that ran it."""
    saves: int
    """Checkpoints this loop wrote."""
    failed_saves: int
    """Saves that failed and were retried at a later site."""
    messages: int
    """Transcript length at the end."""
    error: TurnError | None = None
    """The turn's last model or tool error (the record's ``Counters.last_error``)."""
    seq: int = 0
    """The seq of the turn's last record this run knew (its final one, for an
    :class:`Outcome`): how many checkpoints the record went through, by every owner."""

    @property
    def leaves_in_progress(self) -> bool:
        """The run may have left the turn's record in progress (someone must still end it)."""
        return isinstance(self.outcome, RunStop) and self.outcome.leaves_in_progress

    @classmethod
    def stopped(cls, turn_id: str, stop: RunStop, epoch: int = 0) -> TurnOutcome:
        """A run that ended nothing and saved nothing: why it stopped."""
        return cls(turn_id, stop, epoch, saves=0, failed_saves=0, messages=0)

    @classmethod
    def parked(
        cls, turn_id: str, outcome: Outcome, epoch: int, error: TurnError | None = None
    ) -> TurnOutcome:
        """A turn this run parked (suspended) with one save, and why."""
        return cls(turn_id, outcome, epoch, saves=1, failed_saves=0, messages=0, error=error)
