"""The chaos timeline picture: one row per sampled turn, coloured by phase, kills marked."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
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


#: Kill markers closer than this fraction of the time axis go on separate levels.
LABEL_GAP = 1 / 45
#: Kill key entries per line under the plot.
KEY_PER_LINE = 6


def label_levels(times: list[float], gap: float) -> list[int]:
    """A level per kill marker so that markers on one level are at least ``gap`` apart (in the
    order given, each on the lowest level where it fits)."""
    last: list[float] = []
    out = []
    for at in times:
        level = next((i for i, x in enumerate(last) if at - x >= gap), len(last))
        if level == len(last):
            last.append(at)
        last[level] = at
        out.append(level)
    return out


def _draw_rows(
    ax: Axes,
    rows: list[str],
    by_turn: dict[str, list[Transition]],
    t0_unix: float,
    highlight: Collection[str],
) -> None:
    """One row per turn: a bar per phase it was in (coloured by phase), red behind a
    highlighted row."""
    for y, tid in enumerate(rows):
        if tid in highlight:
            ax.axhspan(y - 0.5, y + 0.5, color="red", alpha=0.08, linewidth=0)
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


def plot_timeline(
    moves: list[Transition],
    kills: list[tuple[float, str]],
    recoveries: list[tuple[str, float]],
    t0_unix: float,
    path: str | Path,
    *,
    sample: list[str],
    title: str,
    highlight: Collection[str] = frozenset(),
) -> None:
    """``kills``: (seconds since start, label); ``recoveries``: (turn id, seconds). Kills are
    numbered on the plot and spelled out in a key under it, so labels never overlap each other
    or the legend; ``highlight`` rows (failed, suspended, most resumed) are marked in red."""
    by_turn: dict[str, list[Transition]] = defaultdict(list)
    for t in sorted(moves, key=lambda t: (t.at_ms, t.epoch, t.seq)):
        if t.turn_id in sample:
            by_turn[t.turn_id].append(t)
    # The first sampled turn on the top row.
    rows = [tid for tid in reversed(sample) if by_turn.get(tid)]
    end_s = max([at for at, _ in kills] + [m.at_ms / 1000 - t0_unix for m in moves] + [1.0])
    levels = label_levels([at for at, _ in kills], LABEL_GAP * end_s)
    top = len(rows) + 0.4 + 0.9 * (max(levels, default=-1) + 1)
    key_lines = -(-len(kills) // KEY_PER_LINE)
    height = max(3.0, 0.22 * len(rows) + 2.0 + 0.16 * key_lines)
    fig, ax = plt.subplots(figsize=(14, height))
    _draw_rows(ax, rows, by_turn, t0_unix, highlight)
    for n, ((at, _), level) in enumerate(zip(kills, levels, strict=True), 1):
        ax.axvline(at, color="red", linewidth=1, alpha=0.7)
        ax.text(
            at,
            len(rows) + 0.4 + 0.9 * level,
            str(n),
            fontsize=6,
            color="red",
            ha="center",
            va="bottom",
        )
    index = {tid: y for y, tid in enumerate(rows)}
    pts = [(at, index[tid]) for tid, at in recoveries if tid in index]
    if pts:
        ax.scatter(
            [p[0] for p in pts], [p[1] for p in pts], marker="|", color="black", s=60, zorder=3
        )
    ax.set_yticks(range(len(rows)), rows, fontsize=6)
    for tick in ax.get_yticklabels():
        if tick.get_text() in highlight:
            tick.set_color("red")
            tick.set_fontweight("bold")
    ax.set_xlabel(
        "seconds since start (red line: numbered fault, black tick: first move after recovery, "
        "red rows: failed, suspended or most resumed turns)"
    )
    ax.set_ylim(-1, top + 0.5)
    ax.set_title(title)
    key = [f"{n}: {label} @{at:.1f}s" for n, (at, label) in enumerate(kills, 1)]
    lines = ["    ".join(key[i : i + KEY_PER_LINE]) for i in range(0, len(key), KEY_PER_LINE)]
    legend = [Patch(color=c, label=p.value) for p, c in COLOURS.items() if p is not TurnPhase.DONE]
    bottom = (0.45 + 0.16 * key_lines) / height
    fig.legend(handles=legend, loc="lower center", fontsize=7, ncol=len(legend), frameon=False)
    if lines:
        fig.text(
            0.01,
            0.3 / height,
            "\n".join(lines),
            fontsize=6,
            color="red",
            va="bottom",
            family="monospace",
        )
    fig.tight_layout(rect=(0, bottom + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
