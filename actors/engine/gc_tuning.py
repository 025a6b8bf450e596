"""The garbage collector of a process that runs turns.

A round of a turn allocates thousands of short-lived objects (messages, encoded records,
replies) and keeps few: with Python's default first-generation threshold (700 net allocations)
the collector runs several times per round and each run traverses every young object. Raising
the threshold lets the young objects die of their reference counts first; raised too far, each
young collection grows long again. The default is the best of the thresholds
``scripts/client_costs.py`` compares (docs/DECISIONS.md has the figures).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["DEFAULT_GC_THRESHOLD", "gc_tuned", "tune_gc"]

#: First-generation threshold of a turn-running process (``[host] gc_threshold``).
DEFAULT_GC_THRESHOLD = 20_000


def tune_gc(threshold: int) -> None:
    """Set this process's first-generation threshold (0: leave Python's default); the older
    generations keep their ratios to it."""
    if threshold:
        gc.set_threshold(threshold, *gc.get_threshold()[1:])


@contextlib.contextmanager
def gc_tuned(threshold: int) -> Iterator[None]:
    """:func:`tune_gc` for a block (a bench figure that stands for a host), restored after."""
    before = gc.get_threshold()
    tune_gc(threshold)
    try:
        yield
    finally:
        gc.set_threshold(*before)
