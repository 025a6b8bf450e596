"""Loop detection over the turn's tool calls, judged together with their results. Pure.

A loop is the same call getting the same result again, not the same call: an agent that polls
``job_status(id)`` until it changes, re-runs the tests after a fix or re-reads a file it just
edited repeats a call on purpose, and each answer differs. So the detector looks, for each call
of the batch the model asks for now, at that call's earlier runs in the turn (same name, same
arguments) and counts how many of the latest ones in a row returned the very same result
(status and output). A call that was skipped as a suspected loop counts as one more of the
same: asking again for a call that was refused does not break the run.

That count against the agent's :class:`LoopThresholds` gives the verdict: at ``suspect_repeats``
the batch is not run and the model is nudged; at ``stop_repeats`` the turn wraps up in
``force_stop``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from bus.messages import Message, ToolCall, ToolResult


class LoopVerdict(StrEnum):
    OK = "ok"
    """No sign of a loop."""
    SUSPECT = "suspect"
    """Looks like a loop; the batch is skipped and the model nudged."""
    STOP = "stop"
    """A loop for sure; stop the turn."""


@dataclass(frozen=True, slots=True)
class LoopThresholds:
    """When the detector suspects and when it stops (an agent sets its own in
    ``AgentSettings.loop_thresholds``: a polling agent may want more patience)."""

    suspect_repeats: int = 3
    """Runs in a row of one call that returned the same result, after which asking for it again
    is suspected: the batch is skipped and the model nudged."""
    stop_repeats: int = 6
    """Runs in a row (skipped asks included) after which asking again stops the turn."""

    def __post_init__(self) -> None:
        if not 1 <= self.suspect_repeats <= self.stop_repeats:
            raise ValueError(
                "loop thresholds need 1 <= suspect_repeats <= stop_repeats, got "
                f"{self.suspect_repeats} and {self.stop_repeats}"
            )


@dataclass(frozen=True, slots=True)
class LoopFinding:
    """What the detector found about the batch the model asks for."""

    verdict: LoopVerdict
    """What to do about it."""
    repeats: int = 0
    """The longest run of identical results among the batch's calls."""
    call: str = ""
    """That call, as ``name(arguments)`` (for the skip reason and the logs)."""

    def reason(self) -> str:
        """Why the batch is not run, as the model (and a person) reads it."""
        return f"{self.call} returned the same result {self.repeats} times in a row"


def _key(call: ToolCall) -> str:
    return f"{call.name}({call.arguments_json()})"


class CallHistory:
    """Every earlier run of each call of a turn (by name and arguments), in order, with its
    result; kept up to date as the turn grows, so each message is read once rather than at
    every batch (a turn of N rounds read O(N²) messages, each call's arguments serialised
    again). A turn whose messages so far are not the ones read (a compaction rewrote them) is
    read again from its start."""

    def __init__(self) -> None:
        self._read: list[Message] = []
        self._runs: dict[str, list[ToolResult]] = {}
        self._pending: dict[str, str] = {}  # call id -> key, for the batch being answered

    def runs(self, turn: Sequence[Message]) -> dict[str, list[ToolResult]]:
        """The runs in ``turn`` (which must not be changed while the answer is in use)."""
        read = len(self._read)
        if len(turn) < read or any(a is not b for a, b in zip(turn, self._read, strict=False)):
            self._read, self._runs, self._pending, read = [], {}, {}, 0
        for m in turn[read:]:
            if m.role == "assistant":
                self._pending = {c.id: _key(c) for c in m.tool_calls}
            elif m.tool_result is not None and m.tool_result.call_id in self._pending:
                key = self._pending.pop(m.tool_result.call_id)
                self._runs.setdefault(key, []).append(m.tool_result)
            self._read.append(m)
        return self._runs


def _same_in_a_row(results: Sequence[ToolResult]) -> int:
    """Length of the latest run of identical results (a skipped ask extends it)."""
    run = 0
    last: tuple[str, str] | None = None
    for r in results:
        if r.status == "skipped" and last is not None:
            run += 1
            continue
        now = (r.status, r.output)
        run = run + 1 if now == last else 1
        last = now
    return run


def detect_loop(
    turn: Sequence[Message],
    batch: Sequence[ToolCall],
    t: LoopThresholds = LoopThresholds(),
    history: CallHistory | None = None,
) -> LoopFinding:
    """Verdict on running ``batch`` next, given the turn's messages so far (``batch``'s own
    assistant message may be among them: its calls have no results yet). ``history``: what
    an earlier call read of the same turn (a loop keeps one), else the turn is read whole."""
    runs = (history or CallHistory()).runs(turn)
    worst = LoopFinding(LoopVerdict.OK)
    for call in batch:
        key = _key(call)
        repeats = _same_in_a_row(runs.get(key, ()))
        if repeats > worst.repeats:
            worst = LoopFinding(LoopVerdict.OK, repeats, key)
    if worst.repeats >= t.stop_repeats:
        return LoopFinding(LoopVerdict.STOP, worst.repeats, worst.call)
    if worst.repeats >= t.suspect_repeats:
        return LoopFinding(LoopVerdict.SUSPECT, worst.repeats, worst.call)
    return worst
