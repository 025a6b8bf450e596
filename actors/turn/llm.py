"""The model interface: a small async protocol with typed errors.

Implementations raise :class:`~bus.errors.RetryableLLMError`,
:class:`~bus.errors.ContextLengthError` or :class:`~bus.errors.FatalLLMError`; the turn loop
maps those onto the recovery policy and never sees a client library's own exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from store.records import Message


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


class LLMClient(Protocol):
    async def complete(self, request: LLMRequest) -> Message:
        """Return one assistant message (text and/or tool calls) or raise a typed LLMError."""
        ...
