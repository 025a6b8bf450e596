"""A model client for any endpoint that speaks OpenAI Chat Completions, on the official SDK.

OpenAI, vLLM, Ollama, a LiteLLM proxy and llama.cpp's server all speak it. :class:`OpenAIChat` is
an agent's model factory (``Agent(model=OpenAIChat(model="gpt-4o-mini"), ...)``); every turn
gets a light :class:`OpenAIChatClient` over one shared ``AsyncOpenAI`` (one connection pool per
process and event loop).

Errors map onto the recovery policy, and the SDK's own retries are off (``max_retries=0``): the
loop's ``retrying_llm`` phase owns retries and their backoff, so a retry is visible, counted and
survives a crash.

* 429, or a 4xx with the code ``rate_limit_exceeded``, is :class:`~bus.errors.RateLimitedLLMError`
  carrying how long the endpoint asked to wait (``retry-after-ms``, ``retry-after``,
  ``x-ratelimit-reset-requests`` / ``-tokens``): the loop waits that long (bounded per call)
  without spending a transient-error attempt.
* 408, 409, any 5xx, a connection error, a timeout, a stream cut mid-way and a reply the
  SDK cannot read are :class:`~bus.errors.RetryableLLMError` (retried up to 3 times, then the
  turn aborts). A cut stream's partial reply is dropped: the retry
  asks again from the same transcript.
* 400 with code ``context_length_exceeded`` is :class:`~bus.errors.ContextLengthError`
  (compaction, then one more try): only the endpoint's own error means the prompt is too long.
* ``finish_reason = "length"`` is the caller's ``max_tokens`` cap, not the context: the reply
  comes back marked ``truncated`` and the loop decides (a cut text reply is kept, a cut tool
  call is asked again once with twice the cap).
* ``finish_reason = "content_filter"`` and every other 4xx are :class:`~bus.errors.FatalLLMError`.

Every error carries the HTTP status, the provider's code, an excerpt of its message and the
request id, which the loop keeps in the turn's record (``Counters.last_error``).

What real servers do, and what this client does about it (each seen against llama.cpp's server):

* An assistant message that carries tool calls is sent with ``"content": ""``, never ``null``
  or absent: llama.cpp's server answers 500 to both.
* A stream that ends with nothing in it (no text, no call, no finish reason) is an endpoint
  that cannot stream this request (llama.cpp with tools offered; any prompt too long for its
  context): the call is made again without streaming, and the endpoint is remembered for the
  rest of the process (one log line), so later calls with tools go straight to JSON.
* A streamed tool call's name is set once: a server that repeats it in every delta does not
  make ``addaddadd``. Arguments accumulate across deltas.

The watchdog's hard cancel cancels the task awaiting the request; the SDK closes the HTTP
connection under it, so the endpoint stops generating.

The API key is read from the environment variable the agent names, in the process that makes
the call; it is never part of a record, a spec, a log line or a report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import openai

from actors.engine.models.openai_errors import scrub, sdk_errors, with_cause
from actors.turn.agent import ModelContext
from actors.turn.llm import LLMReply, LLMRequest, ModelLimits
from actors.turn.tools import ToolSpec
from bus.errors import (
    AwaitingAdmission,
    ConfigError,
    FatalLLMError,
    LLMError,
    RateLimitedLLMError,
    RetryableLLMError,
    StoreError,
)
from bus.messages import Message, ToolCall, Usage
from store.domain.limiter import endpoint_id
from store.redis.urls import redact_url

__all__ = ["OpenAIChat", "OpenAIChatClient"]

log = logging.getLogger(__name__)

#: Endpoints (base URL, model) that answered an empty stream when tools were offered: in this
#: process, their calls with tools are made without streaming.
_NO_TOOL_STREAMS: set[tuple[str, str]] = set()

#: The host of OpenAI's own API: the one endpoint that always needs a key.
OPENAI_HOST = "api.openai.com"

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
    require_key: bool | None = None
    """Refuse to call without the key. None: only OpenAI's own API requires one; a local
    server (llama.cpp, Ollama, vLLM) is called without a key when the variable is unset."""
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
    limits: ModelLimits | None = None
    """What the endpoint allows (requests and tokens a minute, calls in flight): the whole
    cluster keeps to it through one limiter in Redis. None: no declared limit; a provider's
    429 still pauses the endpoint for every host for as long as it asks."""

    def __call__(self, ctx: ModelContext) -> OpenAIChatClient:
        return OpenAIChatClient(self, sdk_client(self), ctx)

    def endpoint(self) -> str:
        """The base URL calls go to, as this process resolves it."""
        return self.base_url or os.environ.get("OPENAI_BASE_URL") or f"https://{OPENAI_HOST}/v1"

    def api_key(self) -> str:
        if self.api_key_env is None:
            return "unused"  # the SDK wants a string; such endpoints ignore it
        key = os.environ.get(self.api_key_env)
        if key:
            return key
        required = self.require_key
        if required is None:
            required = OPENAI_HOST in self.endpoint()
        if required:
            raise ConfigError(
                f"model {self.model!r}: the API key variable ${self.api_key_env} is not set here"
            )
        where = redact_url(self.endpoint())
        log.info("$%s is not set: calling %s without a key", self.api_key_env, where)
        return "unused"


_CLIENTS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str | None, str | None, float], openai.AsyncOpenAI]
] = weakref.WeakKeyDictionary()


def sdk_client(cfg: OpenAIChat) -> openai.AsyncOpenAI:
    """One SDK client per event loop and endpoint: its connection pool belongs to the loop."""
    of_loop = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    key = (cfg.base_url, cfg.api_key_env, cfg.timeout_s)
    client = of_loop.get(key)
    if client is None:
        client = of_loop[key] = openai.AsyncOpenAI(
            api_key=cfg.api_key(),
            base_url=cfg.endpoint(),
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
            # "" rather than null or absent: llama.cpp's server answers 500 to both
            out.append({"role": "assistant", "content": m.text, "tool_calls": calls})
        else:
            out.append({"role": m.role, "content": m.text})
    return out


def options(cfg: OpenAIChat, request: LLMRequest, cap_field: str) -> dict[str, Any]:
    """What every request of either API carries beside its input: whether tools may be called,
    the sampling temperature, the reply's cap (named ``cap_field``; twice as much when the last
    reply was cut) and the agent's extra fields."""
    out: dict[str, Any] = {}
    if request.tools:
        out["tool_choice"] = "auto" if request.tools_enabled else "none"
    if cfg.temperature is not None:
        out["temperature"] = cfg.temperature
    if cfg.max_tokens is not None:
        out[cap_field] = cfg.max_tokens * (2 if request.more_room else 1)
    if cfg.extra_body:
        out["extra_body"] = dict(cfg.extra_body)
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


def arguments(raw: str) -> dict[str, Any]:
    try:
        args = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {INVALID_ARGUMENTS: raw}
    return args if isinstance(args, dict) else {INVALID_ARGUMENTS: raw}


class OpenAIChatClient:
    """One turn's :class:`~actors.turn.llm.LLMClient` on a shared SDK client."""

    system = "openai"
    """The OpenAI API's shape, as the GenAI conventions name it (whatever server speaks it)."""

    def __init__(
        self, cfg: OpenAIChat, sdk: openai.AsyncOpenAI, ctx: ModelContext | None = None
    ) -> None:
        self.cfg = cfg
        self.sdk = sdk
        self.admission = None if ctx is None else ctx.admission
        self.ticket = "" if ctx is None else ctx.turn_id
        self.endpoint_id = endpoint_id(cfg.endpoint(), cfg.model)
        self.model = cfg.model

    def _request(self, request: LLMRequest, *, stream: bool) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {"model": cfg.model, "messages": wire_messages(request.messages)}
        if request.tools:
            body["tools"] = wire_tools(request.tools)
        body.update(options(cfg, request, "max_tokens"))
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _streams(self, request: LLMRequest) -> bool:
        """Stream this call, unless the endpoint showed it cannot stream a call with tools."""
        no_tool_streams = (self.cfg.endpoint(), self.cfg.model) in _NO_TOOL_STREAMS
        return self.cfg.stream and not (request.tools and no_tool_streams)

    async def complete(self, request: LLMRequest) -> LLMReply:
        admission = self.admission
        if admission is None:
            return await self._complete(request)
        cfg = self.cfg
        estimate = estimate_tokens(request, cfg.max_tokens)
        wait = await admission.admit(
            self.endpoint_id,
            self.ticket,
            cfg.limits,
            estimate,
            cfg.timeout_s,
            f"{cfg.model} at {redact_url(cfg.endpoint())}",
        )
        if wait > 0:
            raise AwaitingAdmission(
                f"the cluster's limiter holds calls to {cfg.model} back for {wait:.2f} s",
                retry_after_s=wait,
            )
        used: int | None = None
        sent = time.monotonic()
        try:
            reply = await self._complete(request)
            if reply.usage is not None:
                used = reply.usage.total
            return reply
        except RateLimitedLLMError as exc:
            with _advisory("pause"):  # the provider's word holds every host back
                await admission.pause(
                    self.endpoint_id, exc.retry_after_s or 0.0, time.monotonic() - sent
                )
            raise
        finally:
            delta = 0 if used is None else used - estimate
            with _advisory("settle"):  # a place not freed expires with its hold
                await admission.settle(self.endpoint_id, self.ticket, cfg.limits, delta)

    async def _complete(self, request: LLMRequest) -> LLMReply:
        with sdk_errors():
            if self._streams(request):
                try:
                    return await self._streamed(self._request(request, stream=True), request)
                except _EmptyStream:
                    self._remember_empty_stream(request)
                    return await self._after_empty_stream(request)
            whole = await self.sdk.chat.completions.create(**self._request(request, stream=False))
            return self._whole(whole)

    async def _after_empty_stream(self, request: LLMRequest) -> LLMReply:
        """The call again without streaming. llama.cpp's server ends an empty stream by
        raising inside its response, and drops the connections of the requests that arrive
        at that moment ("Server disconnected", a read error): a request that meets that is
        sent once more at once, on a new connection, before the loop sees an error."""
        body = self._request(request, stream=False)
        try:
            return self._whole(await self.sdk.chat.completions.create(**body))
        except openai.APIConnectionError as exc:
            if isinstance(exc, openai.APITimeoutError):
                raise
            log.info(
                "%s dropped the request after an empty stream; sending it again: %s",
                redact_url(self.cfg.endpoint()),
                with_cause(exc),
            )
            return self._whole(await self.sdk.chat.completions.create(**body))

    def _remember_empty_stream(self, request: LLMRequest) -> None:
        where = (self.cfg.endpoint(), self.cfg.model)
        if not request.tools:
            log.info(
                "%s answered an empty stream; asking again without streaming", redact_url(where[0])
            )
            return
        if where not in _NO_TOOL_STREAMS:
            _NO_TOOL_STREAMS.add(where)
            log.warning(
                "%s (model %s) answered an empty stream to a request with tools: it cannot "
                "stream tool calls, so calls with tools to it are made without streaming from "
                "now on in this process",
                redact_url(where[0]),
                where[1],
            )

    def _whole(self, completion: Any) -> LLMReply:
        if not completion.choices:
            raise RetryableLLMError("the endpoint answered no choices")
        choice = completion.choices[0]
        msg = choice.message
        calls = tuple(
            ToolCall(
                id=c.id or f"call_{i}",
                name=c.function.name,
                args=arguments(c.function.arguments or ""),
            )
            for i, c in enumerate(msg.tool_calls or ())
        )
        return _reply(choice.finish_reason, msg.content or "", calls, completion.usage)

    async def _streamed(self, body: dict[str, Any], request: LLMRequest) -> LLMReply:
        """The streamed reply; :class:`_EmptyStream` when the endpoint sent nothing at all."""
        stream = await self.sdk.chat.completions.create(**body)
        on_text = request.on_text
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
                        if d.id and not call["id"]:
                            call["id"] = d.id
                        if d.function is not None:
                            if d.function.name and not call["name"]:  # set once: some servers
                                call["name"] = d.function.name  # repeat it in every delta
                            call["arguments"] += d.function.arguments or ""
                    finish = choice.finish_reason or finish
        except (LLMError, asyncio.CancelledError):
            raise
        except openai.APIStatusError:
            raise
        except Exception as exc:  # the transport's own errors: the stream was cut
            what = scrub(f"{type(exc).__name__}: {exc}")
            raise RetryableLLMError(f"stream cut mid-way ({what})") from None
        if finish is None:
            if not text and not calls:
                raise _EmptyStream()
            raise RetryableLLMError("stream ended without a finish reason (cut mid-way)")
        tool_calls = tuple(
            ToolCall(id=c["id"] or f"call_{i}", name=c["name"], args=arguments(c["arguments"]))
            for i, c in sorted(calls.items())
        )
        return _reply(finish, "".join(text), tool_calls, usage)


class _EmptyStream(Exception):
    """Internal: the endpoint answered 200 and a stream with nothing in it."""


def _reply(finish: str | None, text: str, calls: tuple[ToolCall, ...], usage: Any) -> LLMReply:
    if finish == "content_filter":
        raise FatalLLMError("the endpoint's content filter stopped the reply")
    used = None
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        used = Usage(
            prompt_tokens=usage.prompt_tokens or 0,
            completion_tokens=usage.completion_tokens or 0,
            cached_tokens=getattr(details, "cached_tokens", None) or 0,
        )
    message = Message(role="assistant", text=text, tool_calls=calls)
    return LLMReply(message, usage=used, truncated=finish == "length", finish_reason=finish or "")


@contextlib.contextmanager
def _advisory(what: str) -> Iterator[None]:
    """A limiter write after the call: Redis failing it must not hide the call's own result."""
    try:
        yield
    except StoreError as exc:
        log.warning("could not %s a model call in the cluster's limiter: %s", what, exc)


def estimate_tokens(request: LLMRequest, max_tokens: int | None) -> int:
    """A call's tokens before it is made: its text at 4 characters a token, and the reply's cap
    (256 when there is none); the reply's usage corrects it afterwards."""
    size = sum(
        len(m.text)
        + len(m.tool_result.output if m.tool_result else "")
        + sum(len(c.arguments_json()) for c in m.tool_calls)
        for m in request.messages
    )
    reply = max_tokens or 256
    return size // 4 + reply * (2 if request.more_room else 1)
