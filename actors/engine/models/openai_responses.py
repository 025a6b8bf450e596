"""A model client for OpenAI's Responses API, whose ``background`` mode keeps each generation
at the provider: a turn resumed after a crash follows the response it had asked for instead of
paying for another.

:class:`OpenAIResponses` takes the settings of :class:`~actors.engine.models.openai_chat.
OpenAIChat` (endpoint, key, limits, timeouts) and ``background``. Each call is named as a model
worker names a generation (the request's digest, :func:`~actors.engine.models.generations.
generation_id`); with ``background`` the provider's response id is noted under that name in the
turn's ``response`` key (``store.domain.responses``) as soon as the stream says it
(``response.created``), before any of its text is read. A resumed turn asking for the same
request finds the id and follows the response (``GET /responses/{id}?stream=true``): still
generating, it goes on; finished, its answer comes back at once. Either way the call counts as
adopted, not paid again. A response the provider no longer has (404) is asked for again and
counted repaid. Watchers see the followed response's text again from its start, after the
``Restarted`` marker (what they saw of it before the crash is not known here).

An operator's cancel and the watchdog's hard timeout cancel the response at the provider
(``POST /responses/{id}/cancel``: a background response does not stop when its stream is
closed); anything else that ends the wait (the process dying, a successor's claim) leaves it
running for the next incarnation, so the client is :class:`~actors.turn.llm.RemoteCalls`.

Errors map as the chat client's do (``openai_errors``): 429 waits, 5xx and cuts are retried, a
``failed`` response is transient, ``incomplete`` for ``max_output_tokens`` is a truncated reply,
for ``content_filter`` fatal. Without ``stream`` a background response is polled until it ends.
What servers do: llama.cpp's ``llama-server`` serves ``/v1/responses`` but keeps nothing; a
``background`` request is answered in full at once and ``GET /v1/responses/{id}`` is 404, so
there a crash asks again (counted repaid), as with Chat Completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

import openai

from actors.engine.models.generations import GenerationAsk, generation_id, pack_ask
from actors.engine.models.openai_chat import (
    OpenAIChat,
    OpenAIChatClient,
    arguments,
    options,
    sdk_client,
)
from actors.engine.models.openai_errors import scrub, sdk_errors
from actors.turn.agent import ModelContext
from actors.turn.llm import LLMReply, LLMRequest
from actors.turn.tools import ToolSpec
from bus.errors import FatalLLMError, LLMError, RetryableLLMError, StoreError
from bus.messages import Message, ToolCall, Usage

__all__ = ["OpenAIResponses", "OpenAIResponsesClient", "wire_input"]

log = logging.getLogger(__name__)

#: Seconds between polls of a background response read without streaming.
POLL_S = 0.5

#: States after which a response changes no more.
_ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})

#: The stream events that end a response, with it in its final state.
_ENDED_EVENTS = frozenset(f"response.{state}" for state in _ENDED)

#: Cancels sent to a provider and not awaited (kept referenced until done).
_CANCELS: set[asyncio.Task[None]] = set()


@dataclass(frozen=True, slots=True)
class OpenAIResponses(OpenAIChat):
    """Settings of an endpoint that speaks OpenAI's Responses API; called per turn, it returns
    that turn's client."""

    background: bool = True
    """Ask for background responses, kept by the provider, and note their ids so a resumed turn
    follows the one it asked for. False: plain responses (``store`` off), asked again after a
    crash."""

    def __call__(self, ctx: ModelContext) -> OpenAIResponsesClient:
        return OpenAIResponsesClient(self, sdk_client(self), ctx)


def wire_input(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """The transcript as Responses input items."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool" and m.tool_result is not None:
            r = m.tool_result
            output = r.output if r.status == "ok" else f"[{r.status}] {r.output}"
            out.append({"type": "function_call_output", "call_id": r.call_id, "output": output})
            continue
        if m.text or not m.tool_calls:
            out.append({"role": m.role, "content": m.text})
        for c in m.tool_calls:
            out.append(
                {
                    "type": "function_call",
                    "call_id": c.id,
                    "name": c.name,
                    "arguments": json.dumps(c.args),
                }
            )
    return out


def _wire_tools(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": dict(t.parameters),
        }
        for t in tools
    ]


class OpenAIResponsesClient(OpenAIChatClient):
    """One turn's client of a Responses endpoint (:class:`~actors.turn.llm.RemoteCalls`: its
    background responses outlive the process that asked)."""

    def __init__(
        self, cfg: OpenAIResponses, sdk: openai.AsyncOpenAI, ctx: ModelContext | None = None
    ) -> None:
        super().__init__(cfg, sdk, ctx)
        self.background = cfg.background
        self.ctx = ctx
        self.journal = ctx.responses if ctx is not None and cfg.background else None
        """Where this client notes its responses' ids (None: nowhere, nothing to follow)."""
        self._current: str | None = None
        """The id of the response in flight."""
        self._repaid = 0

    def end_call(self) -> None:
        rid = self._current
        if rid is not None and self.background:
            task = asyncio.ensure_future(self._cancel(rid))
            _CANCELS.add(task)
            task.add_done_callback(_CANCELS.discard)

    async def _cancel(self, rid: str) -> None:
        with contextlib.suppress(openai.OpenAIError):  # gone, or ended already
            await self.sdk.responses.cancel(rid)

    def take_repaid(self) -> int:
        repaid, self._repaid = self._repaid, 0
        return repaid

    def _body(self, request: LLMRequest) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": cfg.model,
            "input": wire_input(request.messages),
            "store": self.background,
        }
        if self.background:
            body["background"] = True
        if request.tools:
            body["tools"] = _wire_tools(request.tools)
        body.update(options(cfg, request, "max_output_tokens"))
        return body

    def _name(self, request: LLMRequest) -> str | None:
        """The call's name for the journal, or None when nothing is noted."""
        ctx = self.ctx
        if self.journal is None or ctx is None:
            return None
        return generation_id(pack_ask(GenerationAsk.of(request, ctx.input, ctx.baseline)))

    async def _complete(self, request: LLMRequest) -> LLMReply:
        with sdk_errors():
            return await self._generation(request)

    async def _generation(self, request: LLMRequest) -> LLMReply:
        # the id stays after the call (a cancel of the task must still find it for end_call);
        # a new call forgets the last one's
        self._current = None
        name = self._name(request)
        if name is not None and self.journal is not None:
            rid = await self.journal.find(request.turn_id, name)
            if rid is not None:
                try:
                    return dataclasses.replace(await self._follow(rid, request), adopted=True)
                except openai.NotFoundError:  # the provider kept nothing: paid again
                    log.info("response %s of %s is gone; asking again", rid, request.turn_id)
                    self._repaid += 1
        body = self._body(request)
        if self.cfg.stream:
            events = await self.sdk.responses.create(**body, stream=True)
            return await self._read(events, request, name)
        response = await self.sdk.responses.create(**body)
        await self._started(request, name, response.id)
        return await self._polled(response)

    async def _started(self, request: LLMRequest, name: str | None, rid: str) -> None:
        """Note the response's id before anything of it is read."""
        self._current = rid
        if name is None or self.journal is None:
            return
        try:
            await self.journal.note(request.turn_id, name, rid)
        except StoreError as exc:  # the call goes on; a crash now would ask again
            log.warning("could not note response %s of %s: %s", rid, request.turn_id, exc)

    async def _follow(self, rid: str, request: LLMRequest) -> LLMReply:
        """The reply of a kept response, followed where it is."""
        self._current = rid
        if self.cfg.stream:
            events = await self.sdk.responses.retrieve(rid, stream=True)
            return await self._read(events, request, None)
        return await self._polled(await self.sdk.responses.retrieve(rid))

    async def _polled(self, response: Any) -> LLMReply:
        while response.status not in _ENDED:
            await asyncio.sleep(POLL_S)  # a background response read without streaming
            response = await self.sdk.responses.retrieve(response.id)
        return _reply_of(response)

    async def _read(self, events: Any, request: LLMRequest, name: str | None) -> LLMReply:
        on_text = request.on_text
        final: Any = None
        try:
            async for event in events:
                kind = event.type
                if kind == "response.created":
                    await self._started(request, name, event.response.id)
                elif kind == "response.output_text.delta" and on_text is not None:
                    on_text(event.delta)
                elif kind in _ENDED_EVENTS:
                    final = event.response
                elif kind == "error":
                    raise RetryableLLMError(f"the stream said: {scrub(str(event.message))}")
        except (LLMError, StoreError, asyncio.CancelledError, openai.APIStatusError):
            raise
        except Exception as exc:  # the transport's own errors: the stream was cut
            what = scrub(f"{type(exc).__name__}: {exc}")
            raise RetryableLLMError(f"stream cut mid-way ({what})") from None
        if final is None:
            raise RetryableLLMError("stream ended before the response did (cut mid-way)")
        return _reply_of(final)


def _reply_of(response: Any) -> LLMReply:
    """The reply a finished response holds, or the typed error its state stands for."""
    status = response.status
    if status == "failed":
        error = getattr(response, "error", None)
        raise RetryableLLMError(f"the response failed: {scrub(str(error))}")
    if status == "cancelled":
        raise RetryableLLMError("the response was cancelled at the provider")
    reason = getattr(getattr(response, "incomplete_details", None), "reason", None)
    if status == "incomplete" and reason == "content_filter":
        raise FatalLLMError("the endpoint's content filter stopped the reply")
    text: list[str] = []
    calls: list[ToolCall] = []
    for item in response.output or ():
        if item.type == "message":
            text += [p.text for p in item.content if p.type == "output_text"]
        elif item.type == "function_call":
            calls.append(
                ToolCall(id=item.call_id, name=item.name, args=arguments(item.arguments or ""))
            )
    truncated = status == "incomplete"
    u = response.usage
    usage = None
    if u is not None:
        details = getattr(u, "input_tokens_details", None)
        usage = Usage(
            prompt_tokens=u.input_tokens or 0,
            completion_tokens=u.output_tokens or 0,
            cached_tokens=getattr(details, "cached_tokens", None) or 0,
        )
    finish = "length" if truncated else "tool_calls" if calls else "stop"
    message = Message(role="assistant", text="".join(text), tool_calls=tuple(calls))
    return LLMReply(message, usage=usage, truncated=truncated, finish_reason=finish)
