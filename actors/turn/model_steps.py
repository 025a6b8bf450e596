"""A turn loop's model calls: the request (streamed text published as it comes), the
watchdog's and an operator's cancel of a call in flight, metering a reply's tokens and keeping
a model error in the record. What the recovery policy does about a failed call is the loop's
(:mod:`actors.turn.loop`)."""

from __future__ import annotations

import asyncio
import logging

from actors.turn.llm import LLMReply, LLMRequest, RemoteCalls
from actors.turn.loop_state import CancelNow, LoopState
from bus.errors import (
    AwaitingAdmission,
    ContextLengthError,
    HardIdleTimeout,
    LLMError,
    PoisonGeneration,
    RateLimitedLLMError,
    RetryableLLMError,
)
from bus.events import ModelReplied, TextDelta
from bus.messages import Message, Usage
from bus.outcomes import Problem, SaveReason
from bus.phase import TurnPhase
from store.records import TurnError

log = logging.getLogger(__name__)
P = TurnPhase


class ModelSteps(LoopState):
    """The model side of a turn loop."""

    async def _call_llm(self, *, tools_enabled: bool, more_room: bool = False) -> LLMReply:
        await self._note_step()
        streamed = False

        def on_text(piece: str) -> None:
            nonlocal streamed
            streamed = True
            self._emit(TextDelta(self.turn_id, self.epoch, piece, self._now_ms()))

        request = LLMRequest(
            turn_id=self.turn_id,
            messages=self.messages,
            tools_enabled=tools_enabled,
            attempt=self._counters.retry_attempts,
            tools=tuple(self.deps.registry),
            more_room=more_room,
            on_text=on_text if self.deps.events is not None else None,
        )
        self._hard_cancelled = False
        started = self._now_ms()
        task = asyncio.ensure_future(self._replied(request, started))
        self._llm_task = task
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self._llm_task = None
        if task.cancelled():
            if isinstance(self.deps.llm, RemoteCalls) and (
                self._cancel.is_set() or self._hard_cancelled
            ):
                self.deps.llm.end_call()  # the turn's own decision: not for a successor
            if self._cancel.is_set():
                raise CancelNow
            if self._hard_cancelled:
                raise HardIdleTimeout("model call cancelled by the watchdog's hard idle timeout")
            raise asyncio.CancelledError()
        try:
            reply = task.result()
        except PoisonGeneration:
            # the turn is parked next (Setbacks), from its last stored record: the progress a
            # debounced save left in memory (the last batch's results) is saved first
            await self._checkpoint(SaveReason.TOOL_BATCH, force=True)
            raise
        if reply.adopted:
            c = self._counters
            self._counters = c.model_copy(update={"generations_adopted": c.generations_adopted + 1})
        if not streamed and not reply.published and reply.message.text:  # all at once
            on_text(reply.message.text)
        return reply

    async def _replied(self, request: LLMRequest, started_ms: int) -> LLMReply:
        """The model's reply; either way the call ends, a :class:`ModelReplied` says how.
        A call the cluster's limiter held back was never sent: it is not a model call (the
        counter is what the endpoint was asked, whatever came of it)."""
        llm = self.deps.llm
        system = str(getattr(llm, "system", "unknown"))  # optional: see LLMClient
        model = str(getattr(llm, "model", "unknown"))
        sent = True
        try:
            reply = await llm.complete(request)
        except AwaitingAdmission:
            sent = False
            raise
        except LLMError as exc:
            self._emit(
                ModelReplied(
                    self.turn_id,
                    self.epoch,
                    system,
                    model,
                    started_ms,
                    self._now_ms(),
                    error=problem_of(exc).value,
                )
            )
            raise
        finally:
            c = self._counters
            repaid = llm.take_repaid() if isinstance(llm, RemoteCalls) else 0
            self._counters = c.model_copy(
                update={
                    # a call cancelled in flight was sent all the same
                    "model_calls": c.model_calls + sent,
                    "generations_repaid": c.generations_repaid + repaid,
                }
            )
        u = reply.usage or Usage()
        self._emit(
            ModelReplied(
                self.turn_id,
                self.epoch,
                system,
                model,
                started_ms,
                self._now_ms(),
                finish_reason=reply.finish_reason,
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
            )
        )
        return reply

    def _meter(self, usage: Usage | None) -> None:
        """Count a reply's tokens (or that its endpoint reported none) as it arrives."""
        c = self._counters
        self._counters = c.model_copy(
            update={
                "tokens": c.tokens if usage is None else c.tokens.plus(usage),
                "unmetered_calls": c.unmetered_calls + (usage is None),
            }
        )

    def _note_error(self, problem: Problem, message: str, exc: LLMError | None = None) -> None:
        """Keep a model error in the record: what ``inspect``, ``watch`` and a run's summary
        show for a turn that did not answer."""
        self._counters = self._counters.model_copy(
            update={
                "last_error": TurnError(
                    source="model",
                    kind=problem.value,
                    message=message[:500],
                    status=None if exc is None else exc.status,
                    code=None if exc is None else exc.code,
                    request_id=None if exc is None else exc.request_id,
                    attempt=self._counters.retry_attempts,
                    at_ms=self._now_ms(),
                )
            }
        )
        self._dirty = True


def reply_bytes(reply: Message) -> int:
    """A model reply's size as the cap counts it: its text and its calls' arguments, UTF-8
    (a lone surrogate counted as the three bytes it would take)."""
    parts = [reply.text or "", *(c.arguments_json() for c in reply.tool_calls)]
    return sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)


def problem_of(exc: LLMError) -> Problem:
    """The recovery problem a model error is."""
    if isinstance(exc, HardIdleTimeout):
        return Problem.HARD_IDLE_TIMEOUT
    if isinstance(exc, ContextLengthError):
        return Problem.CONTEXT_LENGTH
    if isinstance(exc, RateLimitedLLMError):
        return Problem.RATE_LIMITED
    if isinstance(exc, RetryableLLMError):
        return Problem.RETRYABLE
    return Problem.FATAL  # FatalLLMError and any other LLMError
