"""What a chaos run reports: each fault, the verdict, recovery latencies, the timeline plot."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from actors.engine.settings.extras import Extra, needs
from actors.harness.percentiles import summarize
from actors.harness.targets import ChaosTarget
from actors.harness.transitions import first_moves_after
from actors.harness.verdict import Verdict
from bus.phase import Transition

__all__ = ["ChaosReport", "Fault", "plot", "plot_rows"]


@dataclass(slots=True)
class Fault:
    """One fault the monkey injected (or tried to)."""

    at_s: float
    """Seconds into the run."""
    target: ChaosTarget
    """What was hit (one of ``actors.harness.chaos.TARGETS``)."""
    victim: str
    """Which one: a host label, a role, a node, a Redis primary."""
    pid: int | None
    """The process killed or stopped, when there was one."""
    affected: dict[str, int] = field(default_factory=dict)
    """For host faults: in-progress turn -> its epoch at the kill."""
    note: str = ""
    """What a person should know of it (how long Redis was down, why it was skipped)."""
    skipped: bool = False
    """It could not be injected (the note says why)."""

    @property
    def landed(self) -> bool:
        """It did something: injected, and for a rival resume, some turn taken over."""
        rival = self.target is ChaosTarget.CONCURRENT_RESUME
        return not self.skipped and (not rival or bool(self.affected))


@dataclass(slots=True)
class ChaosReport:
    """What a chaos run did and what the verdict found (JSON through :meth:`as_dict`)."""

    config: dict[str, Any]
    verdict: Verdict
    faults: list[Fault]
    wall_s: float
    respawns: int
    started_at: float
    latency_ms: list[float]
    moves: list[Transition]
    """Every transition read from the bus (for the timeline; not in the JSON)."""
    recovered: list[tuple[str, float, float, ChaosTarget]]
    """(turn, seconds since start, latency ms, fault target) per recovered turn."""
    turn_ids: list[str]
    rivals: dict[str, int] = field(default_factory=dict)
    """How the turns a ``concurrent_resume`` rival took over ended for the rival (``fenced``:
    the host's side won them back)."""
    replacements: dict[str, int] = field(default_factory=dict)
    """Host label -> how many times the supervisor replaced it (deaths and freezes)."""
    fenced: dict[str, int] = field(default_factory=dict)
    """Writes Redis refused because a newer owner held the turn, by kind (``store.domain.usage``):
    a zombie's, a cut-off host's arriving late, a rival's."""

    def fault_recovery_ms(self, f: Fault) -> list[float]:
        """Kill -> first move under a newer epoch, per turn the fault affected that moved."""
        kill_ms = (self.started_at + f.at_s) * 1000
        return [
            t.at_ms - kill_ms for t in first_moves_after(self.moves, f.affected, kill_ms).values()
        ]

    def last_turn_ms_by_kind(self) -> dict[str, dict[str, Any]]:
        """Per fault kind, over its faults that affected turns: kill -> the *last* of its turns
        running again (how long the fault held work up, where the per-turn figures say how
        long a typical turn waited)."""
        out: dict[str, list[float]] = {}
        for f in self.faults:
            ms = self.fault_recovery_ms(f)
            if ms:
                out.setdefault(f.target, []).append(max(ms))
        return {kind: summarize(v) for kind, v in sorted(out.items())}

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.verdict.ok,
            "config": self.config,
            "verdict": self.verdict.as_dict(),
            "kills_per_target": dict(Counter(f.target for f in self.faults if f.landed)),
            "faults": [
                {
                    "at_s": round(f.at_s, 2),
                    "target": f.target,
                    "victim": f.victim,
                    "pid": f.pid,
                    "affected_turns": len(f.affected),
                    "recovery_ms": summarize(self.fault_recovery_ms(f)) if f.affected else None,
                    "note": f.note,
                }
                for f in self.faults
            ],
            "recovery_latency_ms": summarize(self.latency_ms),
            "recovery_latency_ms_by_kind": {
                kind: summarize(ms for _, _, ms, k in self.recovered if k == kind)
                for kind in sorted({k for *_, k in self.recovered})
            },
            "recovery_last_turn_ms_by_kind": self.last_turn_ms_by_kind(),
            "respawns": self.respawns,
            "replacements_per_host": self.replacements,
            "rival_outcomes": self.rivals,
            "fenced_writes": self.fenced,
            "wall_s": round(self.wall_s, 2),
            "turns_per_s": round(self.verdict.turns / self.wall_s, 2) if self.wall_s else None,
        }


#: Rows of the timeline: every flagged turn (up to this many), then the most resumed, then a
#: sample of the affected ones and of the rest.
PLOT_ROWS = 40
PLOT_MOST_RESUMED = 8


def plot_rows(report: ChaosReport) -> tuple[list[str], set[str]]:
    """The turns the timeline shows, and those it highlights: every turn the verdict flagged
    and every poison turn, then the most resumed ones, then affected turns, then a sample."""
    v = report.verdict
    order = {t: i for i, t in enumerate(report.turn_ids)}
    flagged = sorted(v.flagged | set(v.poison), key=lambda t: order.get(t, 0))
    by_resumes = sorted(v.resumes, key=lambda t: (-v.resumes[t], order.get(t, 0)))
    most = [t for t in by_resumes if v.resumes[t] > 0][:PLOT_MOST_RESUMED]
    highlighted = set(flagged) | set(most)
    rows = list(dict.fromkeys([*flagged, *most]))
    affected = sorted({t for f in report.faults for t in f.affected} - set(rows))
    room = max(0, PLOT_ROWS - len(rows))
    rows += affected[: room * 3 // 4]
    rest = [t for t in report.turn_ids if t not in set(rows)]
    rows += random.Random(0).sample(rest, min(len(rest), max(0, PLOT_ROWS - len(rows))))
    return rows, highlighted


def plot(report: ChaosReport, path: str) -> None:
    """The timeline PNG (rows chosen by :func:`plot_rows`)."""
    with needs(Extra.PLOTS, "--plot"):
        from actors.harness.timeline import plot_timeline

    rows, highlighted = plot_rows(report)
    kills = [(f.at_s, f"{f.target} {f.victim}") for f in report.faults if f.landed]
    plot_timeline(
        report.moves,
        kills,
        [(t, at) for t, at, *_ in report.recovered],
        report.started_at,
        path,
        sample=rows,
        highlight=highlighted,
        title=f"phaseline chaos: {report.verdict.turns} turns, {len(kills)} faults, "
        f"verdict {'ok' if report.verdict.ok else 'NOT OK'}",
    )
