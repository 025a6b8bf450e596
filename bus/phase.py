"""The phase model: the single source of truth for where a turn is.

Watchdog, checkpointing, status display and recovery all read the :class:`PhaseTracker` of a
turn (or the :class:`Transition` events it emits); nobody keeps a parallel notion of turn state.
This module is pure: no I/O, no Ray, an injectable clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from bus.errors import IllegalTransition

log = logging.getLogger(__name__)


class TurnPhase(StrEnum):
    """Where a turn is. The string values are what Redis and the bus carry."""

    INIT = "init"
    """Created, nothing run yet."""
    SETUP = "setup"
    """Loading the transcript (fresh or from a checkpoint) and wiring tools."""
    AWAITING_LLM = "awaiting_llm"
    """A model call is in flight; idle from the turn's point of view."""
    RETRYING_LLM = "retrying_llm"
    """Backing off (1 s, 2 s, 4 s) before retrying a retryable model error."""
    COMPACTING = "compacting"
    """Shrinking the transcript after a context-length error."""
    AWAITING_APPROVAL = "awaiting_approval"
    """Transient: a tool call waits for a human decision (capped, then denied)."""
    EXECUTING_TOOLS = "executing_tools"
    """A tool batch is running; each tool has its own timeout."""
    INJECTING_MESSAGE = "injecting_message"
    """Transient: a user or system message is being appended at a boundary."""
    FORCE_STOP = "force_stop"
    """The loop detector stopped the turn; one last tool-less model call wraps it up."""
    DONE = "done"
    """Finished (answered, force-stopped or aborted); the final checkpoint is written."""


P = TurnPhase

_IDLE = frozenset({P.AWAITING_LLM, P.FORCE_STOP})

#: Phases that are entered as interruptions and left with :meth:`PhaseTracker.restore`.
TRANSIENTS = frozenset({P.INJECTING_MESSAGE, P.AWAITING_APPROVAL})

#: The allowed transitions. Entering a transient is listed here; leaving it is ``restore()``,
#: which returns to the phase it interrupted (or ``done`` when the turn is cut short).
ALLOWED: dict[TurnPhase, frozenset[TurnPhase]] = {
    P.INIT: frozenset({P.SETUP, P.DONE}),
    P.SETUP: frozenset({P.AWAITING_LLM, P.FORCE_STOP, P.DONE}),
    P.AWAITING_LLM: frozenset(
        {P.EXECUTING_TOOLS, P.RETRYING_LLM, P.COMPACTING, P.INJECTING_MESSAGE, P.FORCE_STOP, P.DONE}
    ),
    # the force stop's wrap-up call is retried and compacted like any other model call
    P.RETRYING_LLM: frozenset({P.AWAITING_LLM, P.FORCE_STOP, P.DONE}),
    P.COMPACTING: frozenset({P.AWAITING_LLM, P.FORCE_STOP, P.DONE}),
    P.EXECUTING_TOOLS: frozenset({P.AWAITING_LLM, P.AWAITING_APPROVAL, P.FORCE_STOP, P.DONE}),
    P.AWAITING_APPROVAL: frozenset({P.DONE}),
    P.INJECTING_MESSAGE: frozenset({P.DONE}),
    P.FORCE_STOP: frozenset({P.RETRYING_LLM, P.COMPACTING, P.INJECTING_MESSAGE, P.DONE}),
    P.DONE: frozenset(),
}


def counts_as_idle(phase: TurnPhase) -> bool:
    """True where the turn waits on a model with no bound of its own.

    Only these phases are watched by the idle timeouts; every other phase is bounded by its own
    rule (per-tool timeout, approval cap, fixed backoff), so counting them would double-police.
    """
    return phase in _IDLE


def is_allowed(src: TurnPhase, dst: TurnPhase) -> bool:
    """Whether ``src -> dst`` is in the table (restoring a transient is always allowed)."""
    return dst in ALLOWED[src]


@dataclass(frozen=True, slots=True)
class Transition:
    """One phase change of one turn, as published on the bus."""

    turn_id: str
    """The turn that moved."""
    epoch: int
    """Owner incarnation that made the move; consumers drop moves of older epochs."""
    seq: int
    """Per-turn transition number, strictly increasing within an epoch."""
    src: TurnPhase
    """Phase left."""
    dst: TurnPhase
    """Phase entered."""
    at_ms: int
    """Wall-clock time of the move, unix milliseconds."""


Listener = Callable[[Transition], None]


class PhaseTracker:
    """Owns the current phase of one turn, its ``seq``, its entry time and the transient stack.

    ``strict`` (tests, ``--strict``) makes an illegal transition raise :class:`IllegalTransition`;
    otherwise it is logged, counted in :attr:`illegal_count`, and performed anyway, because
    stopping a live turn over a bookkeeping bug would be worse than the bug.
    """

    def __init__(
        self,
        turn_id: str,
        *,
        epoch: int = 1,
        seq: int = 0,
        strict: bool = False,
        clock: Callable[[], float] = time.time,
        listener: Listener | None = None,
    ) -> None:
        self.turn_id = turn_id
        self.epoch = epoch
        self.seq = seq
        self.strict = strict
        self.illegal_count = 0
        self._clock = clock
        self._listener = listener
        self._phase = P.INIT
        self._entered_at = clock()
        self._interrupted: TurnPhase | None = None

    @property
    def phase(self) -> TurnPhase:
        return self._phase

    @property
    def entered_at(self) -> float:
        """Clock reading (seconds) when the current phase was entered."""
        return self._entered_at

    @property
    def interrupted(self) -> TurnPhase | None:
        """The phase a transient interrupted, or None outside a transient."""
        return self._interrupted

    def to(self, dst: TurnPhase) -> Transition:
        """Move to ``dst``; entering a transient remembers the phase to restore."""
        src = self._phase
        if not is_allowed(src, dst):
            self._illegal(src, dst)
        if dst in TRANSIENTS:
            if self._interrupted is not None:
                self._illegal(src, dst)
            self._interrupted = src
        elif dst is P.DONE:
            self._interrupted = None
        return self._move(src, dst)

    def restore(self) -> Transition:
        """Leave the current transient for the phase it interrupted."""
        src = self._phase
        back = self._interrupted
        if src not in TRANSIENTS or back is None:
            self._illegal(src, src)
            return self._move(src, src)
        self._interrupted = None
        return self._move(src, back)

    def _illegal(self, src: TurnPhase, dst: TurnPhase) -> None:
        msg = f"turn {self.turn_id}: illegal transition {src.value} -> {dst.value}"
        if self.strict:
            raise IllegalTransition(msg)
        self.illegal_count += 1
        log.warning(msg)

    def _move(self, src: TurnPhase, dst: TurnPhase) -> Transition:
        self._phase = dst
        self._entered_at = now = self._clock()
        self.seq += 1
        event = Transition(self.turn_id, self.epoch, self.seq, src, dst, int(now * 1000))
        if self._listener is not None:
            self._listener(event)
        return event
