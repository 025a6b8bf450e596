"""The model interface: a small async protocol with typed errors.

Implementations raise :class:`~bus.errors.RetryableLLMError`,
:class:`~bus.errors.ContextLengthError` or :class:`~bus.errors.FatalLLMError`; the turn loop
maps those onto the recovery policy and never sees a client library's own exceptions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from actors.turn.tools import ToolSpec
from store.records import Message, Usage


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """One model call."""

    turn_id: str
    """Turn making the call (for tracing and per-turn state in test models)."""
    messages: tuple[Message, ...]
    """The whole transcript the model sees."""
    tools_enabled: bool
    """False for the wrap-up call after a force stop: the model must answer in text."""
    attempt: int
    """0 for the first try of this call, then 1, 2, 3 for retries."""
    tools: tuple[ToolSpec, ...] = ()
    """The tools the model may call (their descriptions and argument schemas)."""
    more_room: bool = False
    """The last reply to this call was cut by the caller's ``max_tokens`` cap: a client with
    such a cap asks for twice as many tokens this time."""
    on_text: Callable[[str], None] | None = None
    """A streaming client hands each piece of reply text here as it arrives (for watchers;
    advisory, must not block). A client that does not stream leaves it alone: the loop then
    reports the whole reply text at once."""


@dataclass(frozen=True, slots=True)
class LLMReply:
    """One model answer."""

    message: Message
    """The assistant message: text and/or tool calls."""
    usage: Usage | None = None
    """Tokens the call used, if the endpoint said."""
    truncated: bool = False
    """The reply stopped at the caller's ``max_tokens`` cap (``finish_reason: length``): its
    text is usable as far as it goes, its tool calls are not (their arguments may be cut)."""


class LLMClient(Protocol):
    async def complete(self, request: LLMRequest) -> LLMReply:
        """Return one assistant reply or raise a typed LLMError."""
        ...
