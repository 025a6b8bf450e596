"""The model interface: a small async protocol with typed errors.

Implementations raise :class:`~bus.errors.RetryableLLMError`,
:class:`~bus.errors.ContextLengthError` or :class:`~bus.errors.FatalLLMError`; the turn loop
maps those onto the recovery policy and never sees a client library's own exceptions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from actors.turn.tools import ToolSpec
from bus.messages import Message, Usage


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
    finish_reason: str = ""
    """Why the reply stopped, as the endpoint said (``stop``, ``tool_calls``, ``length``)."""
    published: bool = False
    """Its text already went to watchers where it was generated (a generation on a model
    worker publishes its own deltas): the loop does not publish it again."""
    adopted: bool = False
    """It comes from a generation an earlier incarnation of the turn asked for and this one
    adopted (it was not asked for, nor paid, again)."""


#: The slowest rate a limit may name, a minute: one a day. Slower ones overflow the limiter's
#: arithmetic (at 1e-15 a minute its wait came out negative: "go now").
MIN_PER_MINUTE = 1 / 1440
#: The fastest rate a limit may name, a minute.
MAX_PER_MINUTE = 1e9
#: The most calls a burst or an in-flight limit may name.
MAX_COUNT = 1_000_000


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What an endpoint allows, declared by the agent (``OpenAIChat(limits=...)``): every host
    and process of the cluster admits its calls through one limiter in Redis that keeps them."""

    requests_per_minute: float | None = None
    """Requests a minute; None: no request limit."""
    burst: int = 1
    """Requests that may go at once (what the provider's bucket holds); the rest are spaced
    at the rate."""
    tokens_per_minute: float | None = None
    """Tokens a minute (prompt and reply, estimated before the call from its size and
    ``max_tokens``, corrected from the reply's usage); None: no token limit."""
    max_in_flight: int | None = None
    """Calls in flight at once; None: no limit."""

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not MIN_PER_MINUTE <= value <= MAX_PER_MINUTE:
                raise ValueError(
                    f"ModelLimits.{name} must be from {MIN_PER_MINUTE:.6g} (one a day) to "
                    f"{MAX_PER_MINUTE:.0e} a minute (or None), got {value!r}"
                )
        if self.max_in_flight is not None and not 1 <= self.max_in_flight <= MAX_COUNT:
            raise ValueError(
                f"ModelLimits.max_in_flight must be from 1 to {MAX_COUNT:,} (or None), got "
                f"{self.max_in_flight!r}"
            )
        if not 1 <= self.burst <= MAX_COUNT:
            raise ValueError(f"ModelLimits.burst must be from 1 to {MAX_COUNT:,}, got {self.burst}")


class Admission(Protocol):
    """The cluster's admission to model endpoints (``actors.engine.models.admission`` on Redis). A
    model client asks before each call; ``endpoint`` is a stable id of the endpoint and model,
    ``ticket`` the call (asked again with each retry of it, so it keeps its place in line)."""

    async def admit(
        self,
        endpoint: str,
        ticket: str,
        limits: ModelLimits | None,
        tokens: int,
        hold_s: float,
        label: str = "",
    ) -> float:
        """0 when the call may go now, else the seconds to wait before asking again
        (``label``: the endpoint as a person reads it)."""
        ...

    async def settle(
        self, endpoint: str, ticket: str, limits: ModelLimits | None, token_delta: int
    ) -> None:
        """The admitted call ended (``token_delta``: tokens used minus estimated)."""
        ...

    async def pause(self, endpoint: str, seconds: float, sent_s_ago: float) -> None:
        """The provider refused a call for its rate limit: hold every host back ``seconds``
        (0: the provider did not say) and learn its rate; the call was admitted
        ``sent_s_ago``."""
        ...


class LLMClient(Protocol):
    """A model client. It may also say who serves the model and which (``system``, such as
    ``openai``, and ``model`` attributes: what traces and the console show of its calls);
    an agent's own client without them is shown as ``unknown``."""

    async def complete(self, request: LLMRequest) -> LLMReply:
        """Return one assistant reply or raise a typed LLMError."""
        ...


class ResponseJournal(Protocol):
    """Where a client whose endpoint keeps its generations (OpenAI's Responses API with
    ``background``) notes the provider's id of the turn's call in flight, so that a resumed turn
    asking for the same ``generation`` (the request's digest) follows that response instead of
    paying for another (``store.domain.responses`` on Redis)."""

    async def note(self, turn_id: str, generation: str, response_id: str) -> None: ...

    async def find(self, turn_id: str, generation: str) -> str | None:
        """The response id noted for ``generation``, or None."""
        ...


@runtime_checkable
class RemoteCalls(Protocol):
    """A model client whose calls run elsewhere (a model worker) and outlive the asker's
    cancellation: a resumed incarnation may adopt them. The loop ends one where it runs only
    when the turn itself decided to (an operator's cancel, the hard idle timeout)."""

    def end_call(self) -> None:
        """End the call in flight where it runs (not awaited)."""
        ...

    def take_repaid(self) -> int:
        """Generations lost with the worker that ran them, and asked for again, since the last
        take: each was paid (its partial tokens unknown) and is paid again. Taken after every
        call, whatever came of it (a call asked again may then be held back or fail)."""
        ...
