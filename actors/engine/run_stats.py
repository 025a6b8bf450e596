"""What a batch of turns did (:class:`RunStats`), and the ids of a run's turns."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Sequence, Set
from dataclasses import dataclass, field

from actors.turn.run_result import RunStop, TurnOutcome
from bus.errors import StoreError, StoreUnavailable
from bus.outcomes import Outcome
from store.records import TurnError
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["RunStats", "new_run_id", "still_in_progress", "turn_ids"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunStats:
    """What a batch of turns did, for the CLI summary and reports."""

    turns: int = 0
    resumed: int = 0
    outcomes: Counter[Outcome | RunStop] = field(default_factory=Counter)
    checkpoints: int = 0
    """Checkpoints of the turns that ended, each counted once: the seq of every final record
    (every save by every owner, resume claims included), read from the loop in process and
    from the records on Ray."""
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
    errors: Counter[str] = field(default_factory=Counter)
    """The last error of each turn that ended ``aborted:*`` (one line each), counted: why the
    turns that failed failed."""
    on_finish_failures: int = 0
    """Calls of the ``on_finish`` hook that raised (each logged with its traceback)."""

    @property
    def aborted(self) -> int:
        """Turns that ended ``aborted:*``."""
        return sum(n for o, n in self.outcomes.items() if isinstance(o, Outcome) and o.aborted)

    @property
    def finished(self) -> int:
        """Turns whose final record this run wrote or read (an outcome, not a stop)."""
        return sum(n for o, n in self.outcomes.items() if isinstance(o, Outcome))

    def note_error(self, outcome: Outcome | RunStop, error: TurnError | None) -> None:
        """Count the error of a turn that ended ``aborted:*``."""
        if isinstance(outcome, Outcome) and outcome.aborted:
            self.errors[error.line() if error is not None else f"{outcome} (no error kept)"] += 1

    @property
    def all_final(self) -> bool:
        """Every turn of the run reached a final record (what exit status 0 promises)."""
        return not self.unfinished and not self.quarantined and not self.suspended

    def add(self, outcome: TurnOutcome) -> None:
        self.turns += 1
        self.outcomes[outcome.outcome] += 1
        if isinstance(outcome.outcome, Outcome) and outcome.outcome.suspended:
            self.suspended.append(outcome.turn_id)
        if isinstance(outcome.outcome, Outcome):
            self.checkpoints += outcome.seq
        self.failed_saves += outcome.failed_saves
        self.note_error(outcome.outcome, outcome.error)

    def as_dict(self) -> dict[str, object]:
        return {
            "turns": self.turns,
            "resumed": self.resumed,
            "outcomes": {str(k): n for k, n in self.outcomes.items()},
            "checkpoints": self.checkpoints,
            "failed_saves": self.failed_saves,
            "idle_soft": self.idle_soft,
            "hard_cancels": self.hard_cancels,
            "quarantined": self.quarantined,
            "wall_s": round(self.wall_s, 3),
            "turns_per_s": (
                round(self.finished / self.wall_s, 2) if self.wall_s and self.finished else None
            ),
            "host_rss_mib": self.host_rss_mib,
            "unfinished": len(self.unfinished),
            "suspended": len(self.suspended),
            "aborted": self.aborted,
            "errors": dict(self.errors.most_common(10)),
        }


def new_run_id() -> str:
    """A short random prefix for the ids of one run's turns."""
    return uuid.uuid4().hex[:8]


def turn_ids(run_id: str, n: int) -> list[str]:
    """``n`` turn ids of run ``run_id``, in order."""
    return [f"{run_id}-t{i:06d}" for i in range(n)]


async def still_in_progress(
    store: RedisCheckpointStore, outcomes: Sequence[TurnOutcome], *, skip: Set[str]
) -> list[str]:
    """Turns a run did not end (but those in ``skip``), and that no other owner has ended
    since either. Redis unreachable is asked about once, not once per turn (each ask retries
    for ``[redis] retry_s``): the rest are counted as not known to be final."""
    left = []
    gone: StoreUnavailable | None = None
    for o in outcomes:
        if not o.leaves_in_progress or o.turn_id in skip:
            continue
        if gone is not None:
            left.append(o.turn_id)
            continue
        try:
            if (await store.load(o.turn_id)).in_progress:
                left.append(o.turn_id)
        except StoreUnavailable as exc:
            gone = exc
            left.append(o.turn_id)
        except StoreError:  # RecordNotFound included
            left.append(o.turn_id)  # unreadable now: certainly not known to be final
    if gone is not None:
        log.error("Redis is unreachable (%s): %d turns are not known to be final", gone, len(left))
    return left
