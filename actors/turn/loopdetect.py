"""Loop detection over the turn's tool calls. Pure.

Two signals: a *streak* of consecutive identical tool batches, and an *exact duplicate* count
(the same call, name and arguments, anywhere in the turn). Either can make the detector suspect
a loop (the policy nudges) or say stop (the policy force-stops).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from store.records import Message


class LoopVerdict(StrEnum):
    OK = "ok"
    """No sign of a loop."""
    SUSPECT = "suspect"
    """Looks like a loop; worth a nudge."""
    STOP = "stop"
    """A loop for sure; stop the turn."""


@dataclass(frozen=True, slots=True)
class LoopThresholds:
    """When the detector suspects and when it stops."""

    suspect_streak: int = 2
    """Consecutive identical batches that raise suspicion."""
    stop_streak: int = 4
    """Consecutive identical batches that stop the turn."""
    suspect_duplicates: int = 3
    """Occurrences of one exact call that raise suspicion."""
    stop_duplicates: int = 6
    """Occurrences of one exact call that stop the turn."""


def _signature(m: Message) -> str:
    return json.dumps(
        [[c.name, c.args] for c in m.tool_calls], sort_keys=True, separators=(",", ":")
    )


def detect_loop(turn: Sequence[Message], t: LoopThresholds = LoopThresholds()) -> LoopVerdict:
    """Verdict over the turn's messages, judged at the latest assistant batch."""
    batches = [m for m in turn if m.role == "assistant" and m.tool_calls]
    if not batches:
        return LoopVerdict.OK
    sigs = [_signature(m) for m in batches]
    streak = 1
    while streak < len(sigs) and sigs[-1 - streak] == sigs[-1]:
        streak += 1
    calls = Counter(
        json.dumps([c.name, c.args], sort_keys=True) for m in batches for c in m.tool_calls
    )
    latest = {json.dumps([c.name, c.args], sort_keys=True) for c in batches[-1].tool_calls}
    dup = max(calls[k] for k in latest)
    if streak >= t.stop_streak or dup >= t.stop_duplicates:
        return LoopVerdict.STOP
    if streak >= t.suspect_streak or dup >= t.suspect_duplicates:
        return LoopVerdict.SUSPECT
    return LoopVerdict.OK
