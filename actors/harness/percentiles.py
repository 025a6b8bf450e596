"""Latency summaries shared by the chaos and bench reports (nearest-rank percentiles)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def percentile(values: Iterable[float], p: float) -> float | None:
    """The nearest-rank ``p`` quantile (0 < p <= 1) of ``values``; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def summarize(values: Iterable[float], *, digits: int = 1) -> dict[str, float | int | None]:
    """``n``, ``p50``, ``p99``, ``max`` and ``mean`` of ``values``, rounded to ``digits``."""
    data = list(values)

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, digits)

    return {
        "n": len(data),
        "p50": r(percentile(data, 0.5)),
        "p99": r(percentile(data, 0.99)),
        "max": r(max(data)) if data else None,
        "mean": r(statistics.fmean(data)) if data else None,
    }
