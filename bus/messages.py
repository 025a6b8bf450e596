"""The words of a conversation every layer shares: messages, tool calls and their results,
token usage, and the rule that makes outside text storable.

They live in the bus because they cross every boundary: the loop builds them, the store keeps
them, events and reports show them, and each reads the same types.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "REPLACEMENT",
    "FrozenModel",
    "Message",
    "Role",
    "Source",
    "TextModel",
    "ToolCall",
    "ToolResult",
    "ToolStatus",
    "Usage",
    "canonical_json",
    "storable",
]

log = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant", "tool"]
"""Who speaks a message."""
ToolStatus = Literal["ok", "error", "denied", "timeout", "outcome_unknown", "skipped"]
"""How a tool call came out, as the model reads it: ``ok``; ``error`` (the tool failed, or
was not run because Redis refused its write); ``denied`` (not approved); ``timeout``;
``outcome_unknown`` (in flight when its host died, not idempotent: never re-run);
``skipped`` (not run: a loop, a budget, a limit)."""
Source = Literal["prompt", "llm", "tool", "inbox", "system"]
"""Where a message came from."""


class FrozenModel(BaseModel):
    """Base of every stored value: frozen (a snapshot handed to the store cannot change under
    it) and strict about fields (a value written by a newer build fails loudly instead of
    losing data)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


#: A lone UTF-16 surrogate: a Python string may hold one (``os.fsdecode`` of a non-UTF-8 file
#: name, a JSON ``\ud800`` escape, a non-UTF-8 byte in argv), UTF-8 (and so msgpack) cannot.
_SURROGATE = re.compile("[\ud800-\udfff]")
#: What stands for each one in stored text.
REPLACEMENT = "\ufffd"


def storable(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (nested in lists and dicts too)
    replaced by U+FFFD, so it can be encoded; anything else as it is."""
    if isinstance(value, str):
        if _SURROGATE.search(value) is None:
            return value
        log.warning(
            "replaced %d unencodable character(s) (lone surrogates) with U+FFFD",
            len(_SURROGATE.findall(value)),
        )
        return _SURROGATE.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(storable(v) for v in value)
    return value


class TextModel(FrozenModel):
    """A value holding text from outside (a model, a tool, a user): made storable when it is
    built, at the boundary, so no text that UTF-8 cannot hold reaches a record or Redis."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        return storable(data) if isinstance(data, dict) else data


class ToolCall(TextModel):
    """One tool invocation requested by the model."""

    id: str
    """Model-assigned call id; tool results refer to it."""
    name: str
    """Registered tool name."""
    args: dict[str, Any] = Field(default_factory=dict)
    """JSON-like arguments; canonicalised (sorted keys) when hashed into the call key."""

    def arguments_json(self) -> str:
        """The arguments as canonical JSON (what the call key hashes): serialised once, though
        the key, the reply's size, the loop detector and the live events each ask. Kept
        beside the fields with the arguments it spells (pydantic compares, dumps and
        validates fields only), so a copy with other arguments spells those."""
        memo = self.__dict__.get("_canonical")
        if memo is None or memo[0] is not self.args:
            memo = self.__dict__["_canonical"] = (self.args, canonical_json(self.args))
        return memo[1]


def canonical_json(value: Any) -> str:
    """One spelling of a JSON value: sorted keys, no spaces, unicode kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ToolResult(TextModel):
    """The outcome of one tool call, as the model will read it."""

    call_id: str
    """The :attr:`ToolCall.id` this answers."""
    name: str
    """Tool name, repeated for readability of stored transcripts."""
    status: ToolStatus
    """``ok``, or why there is no real output (``outcome_unknown``: in flight at a crash)."""
    output: str = ""
    """Text the model sees."""


class Message(TextModel):
    """One transcript entry. Equality of transcripts is equality of these, message for message."""

    role: Role
    """Who speaks."""
    text: str = ""
    """Plain text content (may be empty for a pure tool-call message)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls requested by an assistant message."""
    tool_result: ToolResult | None = None
    """Set on ``tool`` messages only."""

    @model_validator(mode="after")
    def _check_shape(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool calls")
        if (self.role == "tool") != (self.tool_result is not None):
            raise ValueError("tool messages, and only they, carry a tool result")
        return self


class Usage(FrozenModel):
    """Tokens one model call used, as the endpoint reported them."""

    prompt_tokens: int = Field(default=0, ge=0)
    """Tokens of the request."""
    completion_tokens: int = Field(default=0, ge=0)
    """Tokens of the reply."""
    cached_tokens: int = Field(default=0, ge=0)
    """Of the request's tokens, those the endpoint served from its prompt cache (when it
    says)."""

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Usage) -> Usage:
        """Both calls' tokens together."""
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
        )
