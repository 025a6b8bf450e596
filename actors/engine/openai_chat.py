"""A model client for any endpoint that speaks OpenAI Chat Completions, on the official SDK.

OpenAI, vLLM, Ollama, a LiteLLM proxy and llama.cpp's server all speak it. :class:`OpenAIChat` is
an agent's model factory (``Agent(model=OpenAIChat(model="gpt-4o-mini"), ...)``); every turn
gets a light :class:`OpenAIChatClient` over one shared ``AsyncOpenAI`` (one connection pool per
process and event loop).

Errors map onto the recovery policy, and the SDK's own retries are off (``max_retries=0``): the
loop's ``retrying_llm`` phase owns retries and their backoff, so a retry is visible, counted and
survives a crash.

* 408, 409, 429, any 5xx, a connection error, a timeout, a stream cut mid-way and a reply the
  SDK cannot read are :class:`~bus.errors.RetryableLLMError` (retried up to 3 times, then the
  turn aborts). A cut stream's partial reply is dropped: the retry
  asks again from the same transcript.
* 400 with code ``context_length_exceeded`` is :class:`~bus.errors.ContextLengthError`
  (compaction, then one more try). So is ``finish_reason = "length"``: a reply cut at the token
  limit is never used, since its tool call arguments may be cut too.
* ``finish_reason = "content_filter"`` and every other 4xx are :class:`~bus.errors.FatalLLMError`.

The watchdog's hard cancel cancels the task awaiting the request; the SDK closes the HTTP
connection under it, so the endpoint stops generating.

The API key is read from the environment variable the agent names, in the process that makes
the call; it is never part of a record, a spec, a log line or a report.
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai

from actors.turn.agent import ModelContext
from actors.turn.llm import LLMReply, LLMRequest
from actors.turn.tools import ToolSpec
from bus.errors import (
    ConfigError,
    ContextLengthError,
    FatalLLMError,
    LLMError,
    RetryableLLMError,
)
from store.records import Message, ToolCall, Usage

__all__ = ["OpenAIChat", "OpenAIChatClient"]

#: HTTP statuses worth asking again (OpenAI's own guidance, and what its SDK retries).
RETRYABLE_STATUS = frozenset({408, 409, 429})

#: Key of the arguments of a tool call whose arguments were not a JSON object: the tool's
#: validation refuses it, so the model reads why instead of the turn failing.
INVALID_ARGUMENTS = "__invalid_json__"


@dataclass(frozen=True, slots=True)
class OpenAIChat:
    """Settings of a Chat Completions endpoint; called per turn, it returns that turn's client."""

    model: str
    """The model name the endpoint serves."""
    base_url: str | None = None
    """The endpoint (``http://host:8000/v1``); None: ``$OPENAI_BASE_URL``, else OpenAI's."""
    api_key_env: str | None = "OPENAI_API_KEY"
    """Environment variable holding the API key; None for an endpoint that wants none."""
    timeout_s: float = 120.0
    """Seconds one request may take (a stream: between reads)."""
    temperature: float | None = None
    """Sampling temperature; None: the endpoint's default."""
    max_tokens: int | None = None
    """Cap on the reply's tokens; None: the endpoint's default."""
    stream: bool = True
    """Stream the reply (SSE) rather than wait for it whole."""
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    """Extra JSON fields of every request, for what a server adds (``top_k``, ...)."""

    def __call__(self, ctx: ModelContext) -> OpenAIChatClient:
        return OpenAIChatClient(self, _sdk_client(self))

    def api_key(self) -> str:
        if self.api_key_env is None:
            return "unused"  # the SDK wants a string; such endpoints ignore it
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"model {self.model!r}: the API key variable ${self.api_key_env} is not set here"
            )
        return key


_CLIENTS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str | None, str | None, float], openai.AsyncOpenAI]
] = weakref.WeakKeyDictionary()


def _sdk_client(cfg: OpenAIChat) -> openai.AsyncOpenAI:
    """One SDK client per event loop and endpoint: its connection pool belongs to the loop."""
    of_loop = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    key = (cfg.base_url, cfg.api_key_env, cfg.timeout_s)
    client = of_loop.get(key)
    if client is None:
        client = of_loop[key] = openai.AsyncOpenAI(
            api_key=cfg.api_key(),
            base_url=cfg.base_url or os.environ.get("OPENAI_BASE_URL") or None,
            timeout=cfg.timeout_s,
            max_retries=0,  # retrying_llm owns retries
        )
    return client


def wire_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """The transcript in Chat Completions form."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool" and m.tool_result is not None:
            r = m.tool_result
            content = r.output if r.status == "ok" else f"[{r.status}] {r.output}"
            out.append({"role": "tool", "tool_call_id": r.call_id, "content": content})
        elif m.role == "assistant" and m.tool_calls:
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.args)},
                }
                for c in m.tool_calls
            ]
            out.append({"role": "assistant", "content": m.text or None, "tool_calls": calls})
        else:
            out.append({"role": m.role, "content": m.text})
    return out


def wire_tools(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": dict(t.parameters),
            },
        }
        for t in tools
    ]


def _arguments(raw: str) -> dict[str, Any]:
    try:
        args = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {INVALID_ARGUMENTS: raw}
    return args if isinstance(args, dict) else {INVALID_ARGUMENTS: raw}


class OpenAIChatClient:
    """One turn's :class:`~actors.turn.llm.LLMClient` on a shared SDK client."""

    def __init__(self, cfg: OpenAIChat, sdk: openai.AsyncOpenAI) -> None:
        self.cfg = cfg
        self.sdk = sdk

    def _request(self, request: LLMRequest) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {"model": cfg.model, "messages": wire_messages(request.messages)}
        if request.tools:
            body["tools"] = wire_tools(request.tools)
            body["tool_choice"] = "auto" if request.tools_enabled else "none"
        if cfg.temperature is not None:
            body["temperature"] = cfg.temperature
        if cfg.max_tokens is not None:
            body["max_tokens"] = cfg.max_tokens
        if cfg.extra_body:
            body["extra_body"] = dict(cfg.extra_body)
        if cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, request: LLMRequest) -> LLMReply:
        try:
            if self.cfg.stream:
                return await self._streamed(self._request(request), request.on_text)
            return self._whole(await self.sdk.chat.completions.create(**self._request(request)))
        except openai.APIStatusError as exc:
            raise _status_error(exc) from None
        except openai.APIConnectionError as exc:  # APITimeoutError included
            raise RetryableLLMError(f"{type(exc).__name__}: {exc}") from None
        except openai.OpenAIError as exc:  # e.g. a reply that is not what the protocol says
            raise RetryableLLMError(f"{type(exc).__name__}: {exc}") from None

    def _whole(self, completion: Any) -> LLMReply:
        if not completion.choices:
            raise RetryableLLMError("the endpoint answered no choices")
        choice = completion.choices[0]
        msg = choice.message
        calls = tuple(
            ToolCall(id=c.id, name=c.function.name, args=_arguments(c.function.arguments or ""))
            for c in (msg.tool_calls or ())
        )
        return _reply(choice.finish_reason, msg.content or "", calls, completion.usage)

    async def _streamed(
        self, body: dict[str, Any], on_text: Callable[[str], None] | None
    ) -> LLMReply:
        stream = await self.sdk.chat.completions.create(**body)
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        finish: str | None = None
        usage: Any = None
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices[:1]:
                    delta = choice.delta
                    if delta.content:
                        text.append(delta.content)
                        if on_text is not None:
                            on_text(delta.content)
                    for d in delta.tool_calls or ():
                        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                        if d.id:
                            call["id"] = d.id
                        if d.function is not None:
                            call["name"] += d.function.name or ""
                            call["arguments"] += d.function.arguments or ""
                    finish = choice.finish_reason or finish
        except (LLMError, asyncio.CancelledError):
            raise
        except openai.APIStatusError:
            raise
        except Exception as exc:  # the transport's own errors: the stream was cut
            raise RetryableLLMError(f"stream cut mid-way ({type(exc).__name__}: {exc})") from None
        if finish is None:
            raise RetryableLLMError("stream ended without a finish reason (cut mid-way)")
        tool_calls = tuple(
            ToolCall(id=c["id"] or f"call_{i}", name=c["name"], args=_arguments(c["arguments"]))
            for i, c in sorted(calls.items())
        )
        return _reply(finish, "".join(text), tool_calls, usage)


def _reply(finish: str | None, text: str, calls: tuple[ToolCall, ...], usage: Any) -> LLMReply:
    if finish == "length":
        raise ContextLengthError("the reply was cut at the token limit (finish_reason length)")
    if finish == "content_filter":
        raise FatalLLMError("the endpoint's content filter stopped the reply")
    used = None
    if usage is not None:
        used = Usage(
            prompt_tokens=usage.prompt_tokens or 0, completion_tokens=usage.completion_tokens or 0
        )
    return LLMReply(Message(role="assistant", text=text, tool_calls=calls), usage=used)


def _status_error(exc: openai.APIStatusError) -> LLMError:
    what = f"HTTP {exc.status_code}: {exc.message}"
    if exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500:
        return RetryableLLMError(what)
    if exc.code == "context_length_exceeded" or "context_length_exceeded" in str(exc.body):
        return ContextLengthError(what)
    return FatalLLMError(what)
