"""Compaction: shrink a transcript after a context-length error (reactive) or past an agent's
threshold (proactive, ``AgentSettings.compact_at_chars``). Pure.

Everything between the pre-turn baseline and the last complete tool round is replaced by one
system-injected summary message. The summary states, in a fixed machine-readable form, how many
assistant replies and tool rounds it replaced, so a model (the scripted one included) can keep
counting across a compaction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from bus.messages import Message
from store.records import MessageMeta

_MARK = re.compile(r"^\[compacted: (\d+) messages, (\d+) replies, (\d+) rounds\]")


@dataclass(frozen=True, slots=True)
class Compacted:
    """Counts carried by a summary message."""

    messages: int
    """Messages the summary replaced."""
    replies: int
    """Assistant replies among them."""
    rounds: int
    """Tool rounds (assistant replies with tool calls) among them."""


def read_summary(message: Message) -> Compacted | None:
    """The counts of a compaction summary, or None if ``message`` is not one."""
    if message.role != "system":
        return None
    m = _MARK.match(message.text)
    return Compacted(int(m[1]), int(m[2]), int(m[3])) if m else None


def summary_message(c: Compacted) -> Message:
    return Message(
        role="system",
        text=f"[compacted: {c.messages} messages, {c.replies} replies, {c.rounds} rounds] "
        "Earlier tool rounds of this turn were summarised to fit the context window.",
    )


def compact(
    turn: list[Message], meta: list[MessageMeta], *, at_ms: int, message_id: str
) -> tuple[list[Message], list[MessageMeta]] | None:
    """Compact the turn's own messages (never the baseline). None when nothing can be dropped."""
    last_round = max(
        (i for i, m in enumerate(turn) if m.role == "assistant" and m.tool_calls), default=-1
    )
    if last_round <= 0:
        return None
    summary = summary_message(progress(turn[:last_round]))
    summary_meta = MessageMeta(
        source="system", message_id=message_id, at_ms=at_ms, system_injected=True
    )
    return [summary, *turn[last_round:]], [summary_meta, *meta[last_round:]]


def size_chars(messages: Iterable[Message]) -> int:
    """About how much of a context window ``messages`` fill: their text, tool results and tool
    call arguments, in characters (a model's tokenizer is not known here)."""
    total = 0
    for m in messages:
        total += len(m.text) + sum(len(c.name) + len(json.dumps(c.args)) for c in m.tool_calls)
        if m.tool_result is not None:
            total += len(m.tool_result.output)
    return total


def progress(turn: list[Message] | tuple[Message, ...]) -> Compacted:
    """Replies and tool rounds so far in the turn's messages, counting through summaries."""
    messages = replies = rounds = 0
    for m in turn:
        prior = read_summary(m)
        if prior is not None:
            messages += prior.messages
            replies += prior.replies
            rounds += prior.rounds
            continue
        messages += 1
        if m.role == "assistant":
            replies += 1
            rounds += bool(m.tool_calls)
    return Compacted(messages, replies, rounds)
