"""The bench targets (docs/BENCHMARKS.md): each figure of a report judged against its bound."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Bound", "Target", "targets"]


class Bound(StrEnum):
    """Which side of its bound a target's figure must be on."""

    AT_LEAST = ">="
    """The figure must reach the bound (a rate, a ratio of speeds)."""
    AT_MOST = "<="
    """The figure must stay under it (a size, an overhead, a latency ratio)."""


@dataclass(frozen=True, slots=True)
class Target:
    """One bench target and the figure measured for it."""

    name: str
    """What is measured."""
    value: float | None
    """The figure (None: not measured, or its figure failed)."""
    bound: Bound
    """Which side of ``limit`` it must be on."""
    limit: float
    """The bound itself."""
    note: str
    """How it was measured, or the error of a failed figure."""

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return (
            self.value >= self.limit if self.bound is Bound.AT_LEAST else self.value <= self.limit
        )

    def as_dict(self) -> dict[str, Any]:
        """The report's JSON for it."""
        return {
            "name": self.name,
            "value": self.value,
            "target": f"{self.bound} {self.limit:g}",
            "met": self.met,
            "note": self.note,
        }


def targets(fig: dict[str, Any]) -> list[Target]:
    """The bench targets (docs/BENCHMARKS.md), for the figures measured; a figure that failed
    gives its targets no value, and its error."""
    return [
        *_size_targets(fig.get("bytes_per_checkpoint")),
        *_throughput_targets(fig.get("checkpoint_throughput")),
        *_durability_targets(fig.get("durability_overhead")),
        *_recovery_targets(fig.get("recovery")),
        *_capacity_targets(fig.get("host_capacity")),
        *_loop_targets(fig.get("durable_loop")),
        *_unit_cost_targets(fig.get("unit_costs")),
    ]


def _target(
    name: str, value: Any, side: Bound, limit: float, note: str, data: dict[str, Any]
) -> Target:
    """A target; a failed figure (``data`` with an ``error``) gives its error as the note."""
    return Target(name, value, side, limit, data.get("error", note))


def _size_targets(sizes: list[dict[str, Any]] | dict[str, Any] | None) -> list[Target]:
    if isinstance(sizes, dict):  # a failed figure: its error
        return [
            _target("bytes_per_checkpoint_500_vs_10", None, Bound.AT_MOST, 3, "", sizes),
            _target("redis_bytes_per_transcript_byte_at_500", None, Bound.AT_MOST, 1.5, "", sizes),
        ]
    if not sizes:
        return []
    first, last = sizes[0], sizes[-1]
    return [
        _target(
            f"bytes_per_checkpoint_{last['messages']}_vs_{first['messages']}",
            last["ratio_to_first_length"],
            Bound.AT_MOST,
            3,
            "a save two messages after the last one",
            {},
        ),
        _target(
            f"redis_bytes_per_transcript_byte_at_{last['messages']}",
            last["ratio_memory_to_transcript"],
            Bound.AT_MOST,
            1.5,
            "record and bodies (MEMORY USAGE) over the transcript's text",
            {},
        ),
    ]


def _throughput_targets(thr: dict[str, Any] | None) -> list[Target]:
    if thr is None:
        return []
    row: dict[str, Any] = next((r for r in thr.get("rows", []) if r["turns"] == 1000), {})
    return [
        _target(
            "checkpoint_batched_vs_raw_at_1000_turns",
            row.get("ratio_to_raw"),
            Bound.AT_LEAST,
            0.9,
            f"the same saves in-process, {thr.get('atomic')} path",
            thr,
        ),
        _target(
            "checkpoint_saves_per_s_at_1000_turns",
            row.get("batched_saves_per_s"),
            Bound.AT_LEAST,
            10_000,
            "batched path, through the CheckpointActor; at its CPU "
            f"per save 10,000/s takes {row.get('cores_for_10k_saves_per_s')} cores",
            thr,
        ),
        _target(
            "checkpoint_batched_vs_unbatched_at_1000_turns",
            row.get("ratio_to_unbatched"),
            Bound.AT_LEAST,
            5,
            "ratio of saves/s",
            thr,
        ),
    ]


def _durability_targets(dur: dict[str, Any] | None) -> list[Target]:
    if dur is None:
        return []
    note = f"{dur.get('turns')} concurrent turns of {dur.get('scenario')}"
    return [
        _target("durability_overhead_pct", dur.get("overhead_pct"), Bound.AT_MOST, 10, note, dur)
    ]


def _recovery_targets(rec: dict[str, Any] | None) -> list[Target]:
    if rec is None:
        return []
    note = f"{rec.get('turns')} turns on the killed host; baseline: the median empty-actor restart"
    return [
        _target("recovery_p99_vs_ray_restart", rec.get("ratio_p99"), Bound.AT_MOST, 2, note, rec)
    ]


def _capacity_targets(cap: dict[str, Any] | None) -> list[Target]:
    if cap is None:
        return []
    steps = [r["turns"] for r in cap.get("rows", [])]
    b = cap.get("bytes_per_turn_at_max")
    return [
        _target(
            "concurrent_turns_per_host",
            cap.get("max_turns_held"),
            Bound.AT_LEAST,
            5000,
            f"largest step held of {steps}",
            cap,
        ),
        _target(
            "memory_kib_per_turn_beyond_transcript",
            None if b is None else round(b / 1024, 1),
            Bound.AT_MOST,
            50,
            "at the largest step held",
            cap,
        ),
    ]


#: Durable loop over the same loop in memory: (wanted one turn at a time, wanted 200 at once).
LOOP_TARGETS = (0.3, 0.6)


def _loop_targets(loop: dict[str, Any] | None) -> list[Target]:
    if loop is None:
        return []
    one, many = loop.get("sequential", {}), loop.get("concurrent", {})
    return [
        _target(
            "durable_loop_sequential_vs_memory",
            one.get("ratio"),
            Bound.AT_LEAST,
            LOOP_TARGETS[0],
            f"ceiling here {one.get('ceiling_ratio')}: "
            f"{one.get('round_trips_per_turn')} round trips of "
            f"{one.get('write_round_trip_ms')} ms (a durable write's)",
            loop,
        ),
        _target(
            "durable_loop_concurrent_vs_memory",
            many.get("ratio"),
            Bound.AT_LEAST,
            LOOP_TARGETS[1],
            f"CPU ms per turn {many.get('durable_cpu_ms_per_turn')} "
            f"against {many.get('memory_cpu_ms_per_turn')} in memory",
            loop,
        ),
    ]


#: A host's CPU per round that the scaling model may size deployments with: half of the
#: 3.08 ms measured when issue 32 was filed (docs/SCALING.md).
HOST_CPU_MS_PER_ROUND = 1.54


def _unit_cost_targets(costs: dict[str, Any] | None) -> list[Target]:
    if costs is None:
        return []
    per = costs.get("costs", {})
    return [
        _target(
            "host_cpu_ms_per_round",
            per.get("host_cpu_ms"),
            Bound.AT_MOST,
            HOST_CPU_MS_PER_ROUND,
            f"one host; {per.get('calls_per_round')} tool calls "
            f"and {per.get('saves_per_round')} saves a round",
            costs,
        )
    ]
