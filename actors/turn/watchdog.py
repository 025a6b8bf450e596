"""Watchdog rules: idle timeouts over the idle phases. Pure; the clock is an argument.

Only phases where ``counts_as_idle`` holds are watched. A soft timeout fires once per transition
and only reports (a friendly status line, no harm done); a hard timeout (0 = off) asks the host
to cancel the turn's model call with cause ``hard_idle_timeout``. Any transition re-arms both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bus.phase import Transition, TurnPhase, counts_as_idle


class WatchdogSettings(BaseModel):
    """Timeouts in seconds. Validated: nothing negative, hard >= soft when both are set."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    tick_s: float = Field(default=1.0, gt=0)
    """How often the rules are evaluated."""
    soft_idle_s: float = Field(default=90.0, ge=0)
    """Idle seconds before an ``idle_soft`` status event (0 = off)."""
    hard_idle_s: float = Field(default=0.0, ge=0)
    """Idle seconds before the model call is cancelled (0 = off)."""

    @model_validator(mode="after")
    def _check(self) -> WatchdogSettings:
        if self.hard_idle_s and self.soft_idle_s and self.hard_idle_s < self.soft_idle_s:
            raise ValueError(
                f"hard_idle_s ({self.hard_idle_s}) must be >= soft_idle_s ({self.soft_idle_s})"
            )
        return self


@dataclass(frozen=True, slots=True)
class SoftIdle:
    """Report only: the turn has been idle past the soft timeout."""

    turn_id: str
    """The idle turn."""
    phase: TurnPhase
    """The idle phase."""
    idle_s: float
    """Seconds idle so far."""
    label: str
    """A line a person can read, e.g. 'still waiting for the model (1m 30s)'."""


@dataclass(frozen=True, slots=True)
class HardCancel:
    """Cancel the turn's model call."""

    turn_id: str
    """The turn to cancel."""
    epoch: int
    """Owner epoch the cancel is aimed at (a newer owner is left alone)."""


WatchdogAction = SoftIdle | HardCancel


def friendly_label(phase: TurnPhase, idle_s: float) -> str:
    minutes, seconds = divmod(int(idle_s), 60)
    took = f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"
    what = "waiting for the model" if phase is TurnPhase.AWAITING_LLM else "wrapping up"
    return f"still {what} ({took}); the turn is alive, no action needed"


@dataclass(slots=True)
class _Armed:
    phase: TurnPhase
    epoch: int
    seq: int
    since: float
    soft_fired: bool = False
    hard_fired: bool = False


class WatchdogRules:
    """Per-turn timers fed by transitions, evaluated by :meth:`tick`."""

    def __init__(self, config: WatchdogSettings) -> None:
        self.config = config
        self._turns: dict[str, _Armed] = {}

    def observe(self, t: Transition) -> None:
        """Feed one transition (duplicates and older epochs/seqs are ignored)."""
        current = self._turns.get(t.turn_id)
        if current is not None and (t.epoch, t.seq) <= (current.epoch, current.seq):
            return
        if t.dst is TurnPhase.DONE:
            self._turns.pop(t.turn_id, None)
            return
        self._turns[t.turn_id] = _Armed(t.dst, t.epoch, t.seq, t.at_ms / 1000)

    def forget(self, turn_id: str) -> None:
        self._turns.pop(turn_id, None)

    def watched(self) -> int:
        return len(self._turns)

    async def run(
        self, *, hard: Callable[[HardCancel], None], soft: Callable[[SoftIdle], None]
    ) -> None:
        """Tick every ``tick_s`` until cancelled, handing each due action to its callback (the
        in-process engine's watchdog; on Ray the WatchdogActor ticks these rules)."""
        while True:
            await asyncio.sleep(self.config.tick_s)  # the watchdog's own tick period
            for action in self.tick(time.time()):
                if isinstance(action, HardCancel):
                    hard(action)
                else:
                    soft(action)

    def tick(self, now: float) -> list[WatchdogAction]:
        """Actions due at ``now`` (unix seconds); each fires at most once per transition."""
        soft, hard = self.config.soft_idle_s, self.config.hard_idle_s
        out: list[WatchdogAction] = []
        for turn_id, a in self._turns.items():
            if not counts_as_idle(a.phase):
                continue
            idle = now - a.since
            if hard and idle >= hard and not a.hard_fired:
                a.hard_fired = True
                out.append(HardCancel(turn_id, a.epoch))
            elif soft and idle >= soft and not a.soft_fired:
                a.soft_fired = True
                out.append(SoftIdle(turn_id, a.phase, idle, friendly_label(a.phase, idle)))
        return out
