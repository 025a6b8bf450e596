"""The chaos timeline picture: one row per sampled turn, coloured by phase, kills marked."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from bus.phase import Transition, TurnPhase

COLOURS = {
    TurnPhase.INIT: "#dddddd",
    TurnPhase.SETUP: "#bbbbbb",
    TurnPhase.AWAITING_LLM: "#4c78a8",
    TurnPhase.RETRYING_LLM: "#f58518",
    TurnPhase.COMPACTING: "#b279a2",
    TurnPhase.AWAITING_APPROVAL: "#eeca3b",
    TurnPhase.EXECUTING_TOOLS: "#54a24b",
    TurnPhase.INJECTING_MESSAGE: "#9d755d",
    TurnPhase.FORCE_STOP: "#e45756",
    TurnPhase.DONE: "#ffffff",
}


def plot_timeline(
    moves: list[Transition],
    kills: list[tuple[float, str]],
    recoveries: list[tuple[str, float]],
    t0_unix: float,
    path: str | Path,
    *,
    sample: list[str],
    title: str,
) -> None:
    """``kills``: (seconds since start, label); ``recoveries``: (turn id, seconds)."""
    by_turn: dict[str, list[Transition]] = defaultdict(list)
    for t in sorted(moves, key=lambda t: (t.at_ms, t.epoch, t.seq)):
        if t.turn_id in sample:
            by_turn[t.turn_id].append(t)
    rows = [tid for tid in sample if by_turn.get(tid)]
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.22 * len(rows) + 1.5)))
    for y, tid in enumerate(rows):
        seq = by_turn[tid]
        for a, b in zip(seq, [*seq[1:], None], strict=True):
            start = a.at_ms / 1000 - t0_unix
            end = (b.at_ms / 1000 - t0_unix) if b is not None else start + 0.2
            if a.dst is not TurnPhase.DONE:
                ax.barh(
                    y,
                    max(end - start, 0.01),
                    left=start,
                    color=COLOURS[a.dst],
                    height=0.8,
                    linewidth=0,
                )
    for at, label in kills:
        ax.axvline(at, color="red", linewidth=1, alpha=0.7)
        ax.text(at, len(rows) + 0.2, label, rotation=90, fontsize=7, color="red", va="bottom")
    index = {tid: y for y, tid in enumerate(rows)}
    pts = [(at, index[tid]) for tid, at in recoveries if tid in index]
    if pts:
        ax.scatter(
            [p[0] for p in pts], [p[1] for p in pts], marker="|", color="black", s=60, zorder=3
        )
    ax.set_yticks(range(len(rows)), rows, fontsize=6)
    ax.set_xlabel("seconds since start (red: kill, black tick: first move after recovery)")
    ax.set_ylim(-1, len(rows) + 3)
    ax.set_title(title)
    legend = [Patch(color=c, label=p.value) for p, c in COLOURS.items() if p is not TurnPhase.DONE]
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
