"""OpenAI's Responses API on the scripted endpoint (:mod:`actors.harness.model_endpoint`), with
``background`` mode: the provider keeps the generation, so a client that lost its connection
(its process died) retrieves the response, or follows its events again, instead of asking for
another.

``POST /v1/responses`` takes ``input`` (messages, ``function_call`` and
``function_call_output`` items), ``instructions``, flat ``function`` tools, ``tool_choice`` and
``max_output_tokens``, and answers what the chat endpoint's script says for the same
conversation (its replies, its ``latency_ms``, the provider's rate limit and the faults that
answer before any reply: ``429``, ``500``, ``fatal``, ``context``, ``hang``; a cut reply is
``incomplete``), as a ``response`` object or, with
``stream: true``, its events (``response.created``, ``response.output_text.delta``,
``response.output_item.done``, ``response.completed`` or ``response.incomplete``), each with
its ``sequence_number``. With ``background: true`` the generation runs on the server whatever
becomes of the connection that asked (a dropped client does not stop it), and is kept:
``GET /v1/responses/{id}`` answers its state, ``?stream=true[&starting_after=N]`` its events
after N, following it live until it ends, and ``POST /v1/responses/{id}/cancel`` ends it.
Without ``background`` nothing is kept (``GET`` is 404), as llama.cpp's server does.
``/_stats`` counts ``responses_created``, ``responses_retrieved`` and ``responses_cancelled``
beside ``requests`` (a create is a request; a retrieval is not a generation).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from functools import partial
from typing import Any
from urllib.parse import parse_qs

__all__ = ["RESPONSES", "chat_body", "retrieve", "start"]

#: What the Responses API saw: ``created``, ``retrieved``, ``cancelled``.
RESPONSES: Counter[str] = Counter()

#: The background responses kept, by id.
_KEPT: dict[str, _Generation] = {}

#: Statuses after which a response changes no more.
_ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses request as the chat endpoint's script reads a conversation."""
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    items = body.get("input") or []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content") or ""
            if isinstance(content, list):  # input_text / output_text parts
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({"role": item["role"], "content": str(content)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            messages.append(out)
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages}
    if body.get("tools"):
        chat["tools"] = body["tools"]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = body["tool_choice"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


class _Generation:
    """One response: its events as they are made, and the task making them."""

    def __init__(self, rid: str, model: str) -> None:
        self.id = rid
        self.model = model
        self.status = "queued"
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Condition()
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.task: asyncio.Task[None] | None = None

    def state(self) -> dict[str, Any]:
        """The response object, as it stands."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": 0,
            "model": self.model,
            "status": self.status,
            "output": self.output,
            "usage": self.usage,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            **({"incomplete_details": {"reason": "max_output_tokens"}}
               if self.status == "incomplete" else {}),
        }  # fmt: skip

    async def emit(self, kind: str, **fields: Any) -> None:
        async with self.changed:
            self.events.append({"type": kind, "sequence_number": len(self.events), **fields})
            self.changed.notify_all()

    async def run(self, reply: dict[str, Any], latency_s: float, cut: bool, usage: Any) -> None:
        """The generation: half its text, the wait, the rest, its calls, its end."""
        self.status = "in_progress"
        await self.emit("response.created", response=self.state())
        text = reply["content"]
        half = len(text) // 2
        delta = {"item_id": "msg_0", "output_index": 0, "content_index": 0, "logprobs": []}
        if text[:half]:
            await self.emit("response.output_text.delta", delta=text[:half], **delta)
        await asyncio.sleep(latency_s)  # the generation's time, from the script
        if text[half:]:
            await self.emit("response.output_text.delta", delta=text[half:], **delta)
        if text:
            message = {
                "type": "message",
                "id": "msg_0",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
            self.output.append(message)
            await self.emit("response.output_item.done", item=message, output_index=0)
        for call_id, name, args in reply["tool_calls"]:
            item = {
                "type": "function_call",
                "id": f"fc_{call_id}",
                "call_id": call_id,
                "name": name,
                "arguments": args,
                "status": "completed",
            }
            self.output.append(item)
            await self.emit("response.output_item.done", item=item, output_index=len(self.output))
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        self.status = "incomplete" if cut else "completed"
        await self.emit(f"response.{self.status}", response=self.state())

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.status not in _ENDED:
            self.status = "cancelled"
            RESPONSES["cancelled"] += 1
            await self.emit("response.cancelled", response=self.state())

    def _past(self, at: int) -> bool:
        return len(self.events) > at

    async def follow(self, send: Any, after: int) -> None:
        """Stream the events after ``after`` (-1: all), live until the response ends."""
        head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        at = after + 1
        while True:
            async with self.changed:
                await self.changed.wait_for(partial(self._past, at))
                fresh = self.events[at:]
            for event in fresh:
                data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
                await send({"type": "http.response.body", "body": data, "more_body": True})
            at += len(fresh)
            if self.status in _ENDED and at >= len(self.events):
                break
        await send({"type": "http.response.body", "body": b""})


async def start(
    send: Any,
    body: dict[str, Any],
    reply: dict[str, Any],
    cut: bool,
    usage: dict[str, int],
    latency_s: float,
) -> None:
    """Answer a create: the generation runs in a task of its own (kept when ``background``);
    the caller streams its events or, without ``stream``, gets the response object (at once,
    queued, for a background one; when it ends otherwise)."""
    RESPONSES["created"] += 1
    gen = _Generation(f"resp_{random.getrandbits(64):016x}", str(body.get("model", "")))
    gen.task = asyncio.ensure_future(gen.run(reply, latency_s, cut, usage))
    if body.get("background"):
        _KEPT[gen.id] = gen
    if body.get("stream"):
        try:
            await gen.follow(send, -1)
        finally:
            if not body.get("background"):  # a plain stream's generation ends with it
                await gen.cancel()
        return
    if not body.get("background"):
        await gen.task
    await _json(send, 200, gen.state())


async def retrieve(scope: dict[str, Any], send: Any) -> None:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""
    parts = scope["path"].split("/")  # '', 'v1', 'responses', id[, 'cancel']
    gen = _KEPT.get(parts[3]) if len(parts) > 3 else None
    if gen is None:
        err = {"message": "No response found", "type": "invalid_request_error", "code": None}
        await _json(send, 404, {"error": err})
        return
    if scope["method"] == "POST" and parts[-1] == "cancel":
        await gen.cancel()
        await _json(send, 200, gen.state())
        return
    RESPONSES["retrieved"] += 1
    query = parse_qs(scope.get("query_string", b"").decode())
    if query.get("stream", ["false"])[0] == "true":
        await gen.follow(send, int(query.get("starting_after", ["-1"])[0]))
        return
    await _json(send, 200, gen.state())


async def _json(send: Any, status: int, payload: Any) -> None:
    head = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
