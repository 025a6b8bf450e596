"""Generations that outlive the process that asked for them: the wire between a turn and the
model worker running its call, and the table of generations a worker runs.

A turn hosted on Ray does not run its model calls itself: it asks a model worker
(``actors.cluster.model_workers``) and listens. The request travels as msgpack
(:class:`GenerationAsk`, validated on arrival, never a pickle), and its bytes name the
generation (:func:`generation_id`): a resumed turn that asks for the same request (the same
transcript, attempt and tools) names the same generation, so it finds one still streaming, or
finished with nobody to take it, and adopts it instead of asking (and paying) again. Finding it
costs no Redis write: the name is the request's digest, and the worker is placed by it.

:class:`GenerationTable` is the worker's side without Ray: it starts a generation once, lets the
owner of the newest epoch take its answer (a fenced incarnation gets
:attr:`ModelFailure.FENCED`, so no two owners take one reply), cancels one on request, and drops
what no turn will take (its turn no longer in progress, or kept past ``keep_s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from typing import Any, Protocol

from pydantic import Field

from actors.turn.llm import LLMClient, LLMReply, LLMRequest
from actors.turn.tools import ToolSpec
from bus.errors import (
    AgentCodeError,
    AwaitingAdmission,
    ContextLengthError,
    FatalLLMError,
    HardIdleTimeout,
    LLMError,
    RateLimitedLLMError,
    RecordError,
    RetryableLLMError,
    StaleOwner,
)
from bus.messages import FrozenModel, Message, Usage
from store.codec import pack_model, unpack_model
from store.records import CheckpointRecord, TurnInput, TurnSpec

__all__ = [
    "Answered",
    "Ask",
    "GenerationAnswer",
    "GenerationAsk",
    "GenerationTable",
    "ModelFailure",
    "RemoteModels",
    "ToolDescriptor",
    "answer_of",
    "failure_of",
    "generation_id",
    "pack_ask",
    "reply_of",
    "unpack_answer",
    "unpack_ask",
]


class ToolDescriptor(FrozenModel):
    """A tool as the model is told of it (the worker never runs tools)."""

    name: str
    """Name the model calls it by."""
    description: str = ""
    """What the model is told the tool does."""
    parameters: dict[str, Any] = Field(default_factory=dict)
    """JSON schema of its arguments."""


class GenerationAsk(FrozenModel):
    """One model call as a worker receives it."""

    turn_id: str
    """The turn that asks."""
    messages: tuple[Message, ...]
    """The whole transcript the model sees."""
    tools_enabled: bool
    """False for the wrap-up call after a force stop."""
    attempt: int
    """0 for a call's first try, then 1, 2, 3."""
    more_room: bool = False
    """The last reply was cut by the client's ``max_tokens`` cap: ask for more this time."""
    tools: tuple[ToolDescriptor, ...] = ()
    """The tools the model may call."""
    input: TurnInput
    """The turn's input (what the agent's model factory may read)."""
    baseline: int
    """Messages before the turn's own."""

    @classmethod
    def of(cls, request: LLMRequest, turn_input: TurnInput, baseline: int) -> GenerationAsk:
        return cls(
            input=turn_input,
            baseline=baseline,
            turn_id=request.turn_id,
            messages=request.messages,
            tools_enabled=request.tools_enabled,
            attempt=request.attempt,
            more_room=request.more_room,
            tools=tuple(
                ToolDescriptor(
                    name=t.name, description=t.description, parameters=dict(t.parameters)
                )
                for t in request.tools
            ),
        )

    def request(self, on_text: Callable[[str], None] | None) -> LLMRequest:
        """The request to give the model client (its tools' functions never run here)."""
        return LLMRequest(
            turn_id=self.turn_id,
            messages=self.messages,
            tools_enabled=self.tools_enabled,
            attempt=self.attempt,
            tools=tuple(
                ToolSpec(
                    name=t.name,
                    fn=_never_run,
                    idempotent=True,
                    description=t.description,
                    parameters=t.parameters,
                )
                for t in self.tools
            ),
            more_room=self.more_room,
            on_text=on_text,
        )


async def _never_run(args: Mapping[str, Any], ctx: Any) -> str:
    raise FatalLLMError("a model worker does not run tools")


#: One call of a host's batch to a model worker: the host's token for it, the generation's
#: name, the agent's import path, the asker's epoch, the request's bytes.
Ask = tuple[int, str, str, int, bytes]

#: One answer a host collects: the call's token and the answer's bytes.
Answered = tuple[int, bytes]


def generation_id(wire: bytes) -> str:
    """The name of the generation a request's bytes ask for: the same request (transcript,
    attempt, tools) of the same turn names the same generation, whoever asks."""
    return hashlib.blake2b(wire, digest_size=16).hexdigest()


class RemoteModels(Protocol):
    """Where a host's model calls run when not in the host (``EngineHooks.models``)."""

    def client(self, local: LLMClient, spec: TurnSpec, record: CheckpointRecord) -> LLMClient:
        """The model client of the incarnation of a turn that ``record`` (its epoch) starts:
        ``local``'s calls, run there."""
        ...


class ModelFailure(StrEnum):
    """How a generation ended without a reply, as the wire carries it."""

    RETRYABLE = "retryable"
    """A transient failure of the endpoint (5xx, a drop, a timeout)."""
    RATE_LIMITED = "rate_limited"
    """The endpoint refused for its rate limit (``retry_after_s`` says how long it asked)."""
    AWAITING_ADMISSION = "awaiting_admission"
    """The cluster's limiter held the call back; nothing was sent."""
    CONTEXT_LENGTH = "context_length"
    """The transcript does not fit the model's window."""
    FATAL = "fatal"
    """Retrying will not help (a bad request, auth)."""
    HARD_IDLE = "hard_idle"
    """Cancelled by the watchdog's hard idle timeout."""
    CANCELLED = "cancelled"
    """Cancelled where it ran (the turn's cancel, a force stop, a purge)."""
    FENCED = "fenced"
    """A newer incarnation of the turn adopted the generation: its answer is not this one's."""
    AGENT_CODE = "agent_code"
    """The agent's own model code raised (a bug): the asker's run fails with it."""
    BUSY = "busy"
    """The isolation worker runs another call: ask again soon (nothing was started)."""


class GenerationAnswer(FrozenModel):
    """What a worker answers: a reply, or how the generation failed."""

    message: Message | None = None
    """The assistant message, unless it failed."""
    usage: Usage | None = None
    """Tokens, if the endpoint said."""
    truncated: bool = False
    """Stopped at the caller's ``max_tokens`` cap."""
    finish_reason: str = ""
    """Why the reply stopped, as the endpoint said."""
    adopted: bool = False
    """The generation was asked for by an earlier incarnation of the turn."""
    failure: ModelFailure | None = None
    """How it failed (None: it replied)."""
    error: str = ""
    """The failure's message."""
    status: int | None = None
    """The endpoint's HTTP status, if any."""
    code: str | None = None
    """The provider's error code, if any."""
    request_id: str | None = None
    """The provider's request id, if any."""
    retry_after_s: float | None = None
    """How long a rate limit asked to wait."""
    held_s: float = 0.0
    """Seconds the worker held the call for the cluster's limiter before it answered that it
    still waits (the asker counts them against its rate-limit cap)."""
    repaid: int = 0
    """Generations its client asked for again on the worker (a provider that no longer had the
    response it had kept): paid twice, as a worker's death is."""


_FAILURES: tuple[tuple[type[LLMError], ModelFailure], ...] = (
    (AwaitingAdmission, ModelFailure.AWAITING_ADMISSION),
    (RateLimitedLLMError, ModelFailure.RATE_LIMITED),
    (RetryableLLMError, ModelFailure.RETRYABLE),
    (ContextLengthError, ModelFailure.CONTEXT_LENGTH),
    (HardIdleTimeout, ModelFailure.HARD_IDLE),
    (FatalLLMError, ModelFailure.FATAL),
)


def answer_of(reply: LLMReply) -> GenerationAnswer:
    """A reply as the wire carries it."""
    return GenerationAnswer(
        message=reply.message,
        usage=reply.usage,
        truncated=reply.truncated,
        finish_reason=reply.finish_reason,
        adopted=reply.adopted,
    )


def failure_of(exc: LLMError) -> GenerationAnswer:
    """A model client's typed error as the wire carries it."""
    kind = next((k for cls, k in _FAILURES if isinstance(exc, cls)), ModelFailure.FATAL)
    return GenerationAnswer(
        failure=kind,
        error=str(exc),
        status=exc.status,
        code=exc.code,
        request_id=exc.request_id,
        retry_after_s=getattr(exc, "retry_after_s", None),
        held_s=getattr(exc, "held_s", 0.0),
    )


def reply_of(answer: GenerationAnswer) -> LLMReply:
    """The reply an answer carries, or the typed error it stands for (:class:`StaleOwner`
    for a fenced one; one cancelled where it ran, not by this asker, is a transient error)."""
    if answer.failure is None and answer.message is not None:
        return LLMReply(
            answer.message,
            answer.usage,
            truncated=answer.truncated,
            finish_reason=answer.finish_reason,
            published=True,
            adopted=answer.adopted,
        )
    kw: dict[str, Any] = {
        "status": answer.status,
        "code": answer.code,
        "request_id": answer.request_id,
    }
    match answer.failure:
        case ModelFailure.FENCED:
            raise StaleOwner(answer.error or "a newer incarnation adopted the generation")
        case ModelFailure.AGENT_CODE:
            raise AgentCodeError(answer.error)
        case ModelFailure.BUSY:
            raise RetryableLLMError("the isolation model worker runs another call")
        case ModelFailure.CANCELLED:
            raise RetryableLLMError(f"the generation was cancelled where it ran: {answer.error}")
        case ModelFailure.AWAITING_ADMISSION:
            raise AwaitingAdmission(
                answer.error, retry_after_s=answer.retry_after_s, held_s=answer.held_s, **kw
            )
        case ModelFailure.RATE_LIMITED:
            raise RateLimitedLLMError(answer.error, retry_after_s=answer.retry_after_s, **kw)
        case ModelFailure.RETRYABLE:
            raise RetryableLLMError(answer.error, **kw)
        case ModelFailure.CONTEXT_LENGTH:
            raise ContextLengthError(answer.error, **kw)
        case ModelFailure.HARD_IDLE:
            raise HardIdleTimeout(answer.error, **kw)
        case _:
            raise FatalLLMError(answer.error or "a model worker answered nothing", **kw)


def pack_ask(ask: GenerationAsk) -> bytes:
    return pack_model(ask)


def unpack_ask(wire: bytes) -> GenerationAsk:
    """:class:`~bus.errors.RecordError` for bytes that are not a request."""
    return unpack_model(GenerationAsk, wire, key="generation request")


def unpack_answer(wire: bytes) -> GenerationAnswer:
    """An answer, or a retryable error for bytes that are not one (a worker of another build)."""
    try:
        return unpack_model(GenerationAnswer, wire, key="generation answer")
    except RecordError as exc:
        raise RetryableLLMError(f"a model worker's answer did not decode: {exc}") from exc


@dataclass(slots=True, eq=False)
class Generation:
    """One generation a worker runs or holds."""

    gen_id: str
    """Its name (:func:`generation_id`)."""
    turn_id: str
    """The turn it answers."""
    started_by: int
    """The epoch of the incarnation that asked for it first."""
    owner: int
    """The newest epoch that asked for it: the only one that may take its answer."""
    task: asyncio.Task[GenerationAnswer]
    """The call itself, independent of whoever waits on it."""
    waiting: int = 0
    """Callers waiting on it now (0: its asker died, or took the answer)."""
    delivered: bool = False
    """Its owner took its answer (kept a little longer, in case the owner died before it
    journaled it)."""
    done_at: float | None = None
    """When it ended (monotonic)."""


#: How long a generation whose owner took its answer is kept: the owner dying between taking
#: it and journaling it is resumed within seconds, and takes it again.
DELIVERED_KEEP_S = 60.0

#: A turn's state as the sweep reads it: whether it is in progress; None: no record.
TurnState = bool | None


class GenerationTable:
    """The generations of one worker, by name."""

    def __init__(self, *, keep_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self._clock = clock
        """Seconds, for when a generation ended and how long ago."""
        self._gens: dict[str, Generation] = {}
        self.started = 0
        """Generations started here."""
        self.adopted = 0
        """Answers taken by an incarnation that did not ask first."""
        self.dropped = 0
        """Generations dropped unanswered (their turn ended, or nobody came within keep_s)."""

    def __len__(self) -> int:
        return len(self._gens)

    async def answer(
        self,
        gen_id: str,
        turn_id: str,
        epoch: int,
        start: Callable[[Callable[[], int]], Coroutine[Any, Any, GenerationAnswer]],
    ) -> GenerationAnswer:
        """The answer of generation ``gen_id`` for the incarnation ``epoch`` of ``turn_id``:
        started with ``start`` (handed a function that says the owner's epoch now, for the
        events it publishes) unless it runs or ran here already. A newer epoch adopts it; an
        older one is fenced."""
        g = self._gens.get(gen_id)
        if g is not None and _failed(g):
            # Asked again after a failure (a rate limit, the limiter's hold, a transient
            # error): a new try, not the kept failure.
            del self._gens[gen_id]
            g = None
        if g is None:
            task = asyncio.create_task(start(lambda: self._owner(gen_id, epoch)))
            g = self._gens[gen_id] = Generation(gen_id, turn_id, epoch, epoch, task)
            task.add_done_callback(partial(self._ended, g))
            self.started += 1
        elif epoch < g.owner:
            return _fenced(g)
        elif epoch > g.owner:
            g.owner = epoch
        g.waiting += 1
        try:
            answer = await asyncio.shield(g.task)
        except asyncio.CancelledError:
            if not g.task.cancelled():
                raise  # the caller went away: the generation goes on
            answer = GenerationAnswer(failure=ModelFailure.CANCELLED, error="cancelled")
        finally:
            g.waiting -= 1
        if epoch != g.owner:
            return _fenced(g)
        g.delivered = True
        if epoch != g.started_by:
            self.adopted += 1
            return answer.model_copy(update={"adopted": True})
        return answer

    def _owner(self, gen_id: str, default: int) -> int:
        g = self._gens.get(gen_id)
        return default if g is None else g.owner

    def _ended(self, g: Generation, _task: object) -> None:
        g.done_at = self._clock()

    def cancel(self, gen_id: str, epoch: int) -> bool:
        """End generation ``gen_id`` where it runs, if ``epoch`` may (not a fenced one)."""
        g = self._gens.get(gen_id)
        if g is None or epoch < g.owner:
            return False
        g.task.cancel()
        del self._gens[gen_id]
        return True

    def unattended(self) -> list[Generation]:
        """Generations nobody waits on and nobody took: their asker died."""
        return [g for g in self._gens.values() if g.waiting == 0 and not g.delivered]

    def sweep(self, states: Mapping[str, TurnState]) -> list[str]:
        """Drop what no turn will take: an unattended generation whose turn is gone or no
        longer in progress (cancelled, finished, purged; ``states``: each one's turn, as its
        record says), one finished past ``keep_s``, and one its owner took past
        :data:`DELIVERED_KEEP_S`. The names dropped."""
        now = self._clock()
        dropped = []
        for g in list(self._gens.values()):
            if g.waiting:
                continue
            done_for = None if g.done_at is None else now - g.done_at
            if g.delivered:
                drop = done_for is not None and done_for > DELIVERED_KEEP_S
            else:
                drop = not states.get(g.turn_id) or (
                    done_for is not None and done_for > self.keep_s
                )
            if drop:
                g.task.cancel()
                del self._gens[g.gen_id]
                dropped.append(g.gen_id)
        self.dropped += len(dropped)
        return dropped

    def turns_unattended(self) -> Sequence[str]:
        """The turns whose state a sweep needs: those of unattended generations only (a turn
        that took its answer costs the sweep nothing)."""
        return sorted({g.turn_id for g in self.unattended()})


def _failed(g: Generation) -> bool:
    """The generation ended without a reply."""
    return g.task.done() and (g.task.cancelled() or g.task.result().failure is not None)


def _fenced(g: Generation) -> GenerationAnswer:
    return GenerationAnswer(
        failure=ModelFailure.FENCED,
        error=f"generation {g.gen_id} of {g.turn_id} answers epoch {g.owner}",
    )
