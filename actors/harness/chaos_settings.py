"""What a chaos run is told (``phaseline chaos``, the demo's faults): its work, its length,
its fault targets and their pace, its seed."""

from __future__ import annotations

from dataclasses import dataclass

from actors.harness.targets import ChaosTarget
from actors.harness.verdict import VerdictMode
from actors.harness.work import Work
from bus.errors import ConfigError

__all__ = ["ChaosSettings"]


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    """One chaos run, as the CLI or the demo describes it."""

    work: Work
    """What every turn runs (a scenario, or an agent on an input)."""
    turns: int
    """Turns submitted, spread evenly over the first half of ``duration_s``."""
    duration_s: float
    """How long faults are injected."""
    kill_interval_s: float
    """Mean seconds between two faults (each interval is drawn from 0.5x..1.5x)."""
    targets: tuple[ChaosTarget, ...]
    """Kinds of victim."""
    seed: int
    """Seeds the victim and interval choices, so a failing run can be replayed."""
    poison: int = 0
    """Turns among ``turns`` that run the scenario's poison variant
    (:func:`~actors.harness.chaos.poison_variant`; scripted work only)."""
    verdict: VerdictMode = VerdictMode.EXACT
    """What the verdict compares (``promises`` for a model that is not deterministic)."""

    def __post_init__(self) -> None:
        if self.poison and self.work.scenario is None:
            raise ConfigError("poison turns are a scenario's (the scripted agent): use --scenario")
