"""When a tool worker pool grows or shrinks. Pure: the Supervisor applies it each watch tick.

A pool grows by one worker while calls wait for it on any host (the hosts admit at most the
tools' per-worker limit x pool size calls at once and queue the rest), at most once per
``interval_s``; it gives one back after it has had nothing waiting and nothing running for
``idle_s``. A removed worker is drained before it is killed: hosts stop sending to it as soon as
they read the smaller size, and the Supervisor kills it only once it runs no call.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolLoad", "ScaleRule", "next_size"]


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """What the hosts report about one pool, summed over them."""

    queued: int
    """Calls waiting on the hosts for a free slot of the pool."""
    running: int
    """Calls the hosts have running on the pool."""


@dataclass(frozen=True, slots=True)
class ScaleRule:
    """The bounds and pace of resizing (``[tools]`` settings)."""

    min_workers: int
    """Fewest workers."""
    max_workers: int
    """Most workers."""
    interval_s: float
    """Least time between two resizes."""
    idle_s: float
    """Time with nothing waiting or running before one worker is given back."""


def next_size(
    size: int, load: PoolLoad, rule: ScaleRule, *, since_resize_s: float, idle_for_s: float
) -> int:
    """The pool's size after this tick (``idle_for_s``: how long it has had no call waiting or
    running; 0 if it has one now)."""
    bounded = min(max(size, rule.min_workers), rule.max_workers)
    if bounded != size:
        return bounded
    if since_resize_s < rule.interval_s:
        return size
    if load.queued > 0 and size < rule.max_workers:
        return size + 1
    if load.queued == 0 and load.running == 0 and idle_for_s >= rule.idle_s:
        return max(size - 1, rule.min_workers)
    return size
