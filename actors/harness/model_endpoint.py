"""A scripted OpenAI-compatible endpoint, Chat Completions and the Responses API
(:mod:`actors.harness.responses_endpoint`, ``background`` mode too), an ASGI app run by uvicorn
(the ``console`` extra): what the tests, the chaos runs on the HTTP model path
(``scripts/http_chaos``) and the model benchmarks (``scripts/rate_limit_bench.py``,
``scripts/model_overhead.py``) point their HTTP agents (:mod:`actors.harness.http_agents`) at.

It speaks the real protocol: JSON replies and SSE streams (``stream: true``, tool call arguments
split across deltas, a usage chunk when ``stream_options.include_usage``), and error bodies in
OpenAI's shape. Its replies are scripted per conversation, so a fault-free run is deterministic
and a run with faults can be compared with it. The script is a line of a system or user message::

    #script {"rounds": 2, "tool": "add", "faults": {"2": {"kind": "429", "times": 1}}}

``latency_ms`` delays every answer (``"latency_spread": 0.5`` draws each delay uniformly
within 50 % of it, as generation times vary); ``say`` is the final answer, as given; ``"call_text":
false`` sends tool calls without text (as small models do). At model call N of a conversation
(counted through compaction summaries) the server asks for one ``tool`` call with arguments
``{"a": N, "b": 1}`` (or the script's ``args``) until ``rounds`` tool rounds are done, then
answers ``results: <every tool output it can see>`` (with ``"quote": false``: ``read <n> tool
results``, so a chaos run whose calls caught in flight read ``outcome_unknown`` still answers
as the fault-free run does). Progress counts from the latest message with a script (a session's
later turns bring their own). A fault at call N fires ``times`` times for that conversation
(keyed by that message), then the call succeeds:

``429`` (with ``retry-after``), ``500``, ``fatal`` (400), ``context`` (400
``context_length_exceeded`` until the transcript holds a compaction summary), ``length``
(``finish_reason: length``), ``drop`` (the connection closes mid-reply), ``hang`` (no answer
until the client goes away; counted in ``disconnects``).

It also behaves as real servers were seen to (llama.cpp's, through ``llama-cpp-python``):

* an assistant message with ``tool_calls`` whose ``content`` is ``null`` or absent is refused
  with a 500 (always);
* ``max_tokens`` cuts the reply (a token is 4 characters here): the text and the tool call's
  arguments are cut and ``finish_reason`` is ``length`` (always);
* script ``"stream_tools": false``: a streamed request that offers tools gets 200 and an empty
  stream (llama.cpp: "Automatic streaming tool choice is not supported");
* script ``"drop_after_empty": true``: the request that follows an empty stream loses its
  connection before any answer (llama.cpp's server raises inside the empty stream's response and
  drops the requests that arrive then);
* script ``"repeat_names": true``: a streamed tool call repeats its name in every delta;
* script ``"n_ctx": N``: a prompt over N tokens gets, streamed, 200 and an empty stream, and
  without streaming a 400 ``context_length_exceeded`` (until the transcript is compacted);
* every error answer carries an ``x-request-id``;
* script ``"sample": true``: each tool call's ``a`` is drawn at random, as a sampling model
  answers the same conversation differently every time (a reply asked for again calls
  otherwise).

A provider-like rate limit for the whole server: ``POST /_limit`` with ``{"rpm": 600, "burst":
100, "headers": true}`` (``{}`` lifts it) sets a token bucket of ``burst`` requests refilled at
``rpm`` a minute; a request over it gets 429 ``rate_limit_exceeded`` with OpenAI's headers
(``retry-after``, ``retry-after-ms``, ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests``), or with none of them when
``"headers": false``; ``"refusal_latency_ms": N`` answers each refusal N ms after the request
arrived (a far provider's round trip: what the client learns is that old). ``/_stats`` counts
``accepted`` and ``refused``.

``GET /_stats`` answers what the server saw (requests, faults fired, disconnects, the last
request's ``Authorization`` header). Run: ``python -m actors.harness.model_endpoint PORT``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import time
from collections import Counter
from typing import Any

from actors.engine.settings.extras import Extra, needs
from actors.harness import responses_endpoint

Scope = dict[str, Any]
Receive = Any
Send = Any

_SUMMARY = re.compile(r"^\[compacted: \d+ messages, (\d+) replies, (\d+) rounds\]")


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.fired: Counter[str] = Counter()
        self.disconnects = 0
        self.authorization = ""
        self.bodies: list[dict[str, Any]] = []
        self.errors = 0
        self.drop_next = 0
        self.accepted = 0
        self.refused = 0


class Bucket:
    """A provider's request limit: ``burst`` requests, refilled at ``rpm`` a minute."""

    def __init__(
        self, rpm: float, burst: int, headers: bool, refusal_latency_ms: float = 0.0
    ) -> None:
        self.rate = rpm / 60.0
        self.rpm = rpm
        self.burst = burst
        self.headers = headers
        self.refusal_latency_s = refusal_latency_ms / 1000
        """How long a refusal takes to arrive (a far provider's round trip): the bucket is
        read when the request arrives, its answer comes this much later."""
        self.tokens = float(burst)
        self.at = time.monotonic()

    def take(self) -> float:
        """0 if a request may go now (and takes its token), else the seconds until it may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate

    def refusal_headers(self, wait_s: float) -> list[tuple[bytes, bytes]]:
        if not self.headers:
            return []
        return [
            (b"retry-after", str(math.ceil(wait_s)).encode()),
            (b"retry-after-ms", str(math.ceil(wait_s * 1000)).encode()),
            (b"x-ratelimit-limit-requests", str(int(self.rpm)).encode()),
            (b"x-ratelimit-remaining-requests", b"0"),
            (b"x-ratelimit-reset-requests", f"{wait_s:.3f}s".encode()),
        ]


LIMIT: list[Bucket] = []


STATS = Stats()
_FIRED: Counter[tuple[str, int]] = Counter()


def _script(messages: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """(index, script) of the last system or user message with a ``#script`` line: the
    conversation's latest request (a session's later turns bring their own), or (0, {})."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") in ("system", "user"):
            for line in str(m.get("content") or "").splitlines():
                if line.startswith("#script "):
                    return i, dict(json.loads(line[len("#script ") :]))
    return 0, {}


def _progress(messages: list[dict[str, Any]]) -> tuple[int, int, bool]:
    """(replies, tool rounds, compacted) so far, counting through compaction summaries."""
    replies = rounds = 0
    compacted = False
    for m in messages:
        summary = _SUMMARY.match(str(m.get("content") or "")) if m["role"] == "system" else None
        if summary:
            replies += int(summary[1])
            rounds += int(summary[2])
            compacted = True
        elif m["role"] == "assistant":
            replies += 1
            rounds += bool(m.get("tool_calls"))
    return replies, rounds, compacted


def plan(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The fault to play (or None) and the reply: ``{"content", "tool_calls"}``. Progress
    counts from the message that carries the script."""
    at, script = _script(body["messages"])
    messages = body["messages"][at:]
    replies, rounds, compacted = _progress(messages)
    call = replies + 1
    asked = str(messages[0].get("content")) if messages else ""
    fault = script.get("faults", {}).get(str(call))
    kind = None
    due = fault is not None and _FIRED[(asked, call)] < int(fault.get("times", 1))
    if fault is not None and due and not (fault["kind"] == "context" and compacted):
        _FIRED[(asked, call)] += 1
        kind = str(fault["kind"])
    outputs = [str(m.get("content")) for m in messages if m["role"] == "tool"]
    if rounds < int(script.get("rounds", 0)) and body.get("tool_choice") != "none":
        args = json.dumps(script.get("args", {"a": call, "b": 1}))
        if script.get("sample"):  # as a sampling model: never the same call twice
            args = json.dumps({"a": random.randrange(1 << 30), "b": 1})
        name = str(script.get("tool", "add"))
        text = f"step {call}" if script.get("call_text", True) else ""
        return kind, {"content": text, "tool_calls": [(f"call_{call}", name, args)]}
    if "say" in script:  # the final answer as given (a JSON escape like \ud800 reaches the
        return kind, {"content": str(script["say"]), "tool_calls": []}  # client as it is)
    if script.get("quote", True):
        return kind, {"content": "results: " + ",".join(outputs), "tool_calls": []}
    return kind, {"content": f"read {len(outputs)} tool results", "tool_calls": []}


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        event = await receive()
        chunks.append(event.get("body", b""))
        if not event.get("more_body"):
            return b"".join(chunks)


async def _json(send: Send, status: int, payload: Any, headers: list[Any] | None = None) -> None:
    data = json.dumps(payload).encode()
    head = [(b"content-type", b"application/json"), *(headers or [])]
    if status >= 400:
        STATS.errors += 1
        head.append((b"x-request-id", f"req_{STATS.requests}".encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


def _prompt_tokens(body: dict[str, Any]) -> int:
    return len(json.dumps(body["messages"])) // 4


def _capped(body: dict[str, Any], reply: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The reply cut to the caller's ``max_tokens`` (4 characters a token), and whether it was."""
    cap = body.get("max_tokens")
    if cap is None:
        return reply, False
    room = int(cap) * 4
    text = reply["content"]
    if len(text) + sum(len(a) for _, _, a in reply["tool_calls"]) <= room:
        return reply, False
    calls = []
    left = max(0, room - len(text))
    for call_id, name, args in reply["tool_calls"]:
        calls.append((call_id, name, args[:left]))
        left = max(0, left - len(args))
    return {"content": text[:room], "tool_calls": calls}, True


def _refused_null_content(body: dict[str, Any]) -> bool:
    """llama.cpp's server answers 500 to an assistant tool-call message with null or no
    content."""
    return any(
        m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") is None
        for m in body["messages"]
    )


async def _empty_stream(send: Send) -> None:
    head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": b""})


def _error(message: str, kind: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _usage(body: dict[str, Any], reply: dict[str, Any]) -> dict[str, int]:
    prompt = len(json.dumps(body["messages"])) // 4
    completion = (len(reply["content"]) + sum(len(a) for _, _, a in reply["tool_calls"])) // 4
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _message(reply: dict[str, Any]) -> dict[str, Any]:
    calls = [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
        for i, n, a in reply["tool_calls"]
    ]
    return {
        "role": "assistant",
        "content": reply["content"],
        **({"tool_calls": calls} if calls else {}),
    }


async def _stream(
    send: Send,
    body: dict[str, Any],
    reply: dict[str, Any],
    finish: str,
    drop: bool,
    repeat_names: bool,
) -> None:
    head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    base = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": body["model"],
    }

    async def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> None:
        payload = {
            **base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        data = f"data: {json.dumps(payload)}\n\n".encode()
        await send({"type": "http.response.body", "body": data, "more_body": True})

    text = reply["content"]
    await chunk({"role": "assistant", "content": text[: len(text) // 2]})
    if drop:
        raise ConnectionAbortedError("scripted drop mid-stream")  # uvicorn cuts the connection
    await chunk({"content": text[len(text) // 2 :]})
    for index, (call_id, name, args) in enumerate(reply["tool_calls"]):
        half = len(args) // 2
        await chunk(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": args[:half]},
                    }
                ]
            }
        )
        rest: dict[str, Any] = {"arguments": args[half:]}
        if repeat_names:
            rest["name"] = name
        await chunk({"tool_calls": [{"index": index, "function": rest}]})
    await chunk({}, finish)
    if (body.get("stream_options") or {}).get("include_usage"):
        payload = {**base, "choices": [], "usage": _usage(body, reply)}
        data = f"data: {json.dumps(payload)}\n\n".encode()
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["method"] == "GET" and scope["path"] == "/_stats":
        await _json(
            send,
            200,
            {
                "requests": STATS.requests,
                "fired": dict(STATS.fired),
                "disconnects": STATS.disconnects,
                "authorization": STATS.authorization,
                "errors": STATS.errors,
                "accepted": STATS.accepted,
                "refused": STATS.refused,
                "bodies": STATS.bodies[-20:],
                **{f"responses_{k}": n for k, n in responses_endpoint.RESPONSES.items()},
            },
        )
        return
    if scope["method"] == "POST" and scope["path"] == "/_limit":
        spec = json.loads(await _read_body(receive) or b"{}")
        LIMIT[:] = (
            [
                Bucket(
                    float(spec["rpm"]),
                    int(spec["burst"]),
                    bool(spec.get("headers", True)),
                    float(spec.get("refusal_latency_ms", 0)),
                )
            ]
            if spec
            else []
        )
        STATS.accepted = STATS.refused = 0
        await _json(send, 200, {"limit": spec})
        return
    if scope["path"].startswith("/v1/responses/"):
        await responses_endpoint.retrieve(scope, send)
        return
    asks = scope["path"] if scope["method"] == "POST" else ""
    if asks not in ("/v1/chat/completions", "/v1/responses"):
        await _json(send, 404, _error("not found", "invalid_request_error", None))
        return
    body = json.loads(await _read_body(receive))
    created = body if asks == "/v1/responses" else None  # a Responses API request
    if created is not None:
        body = responses_endpoint.chat_body(created)
    STATS.requests += 1
    STATS.bodies.append(body)
    headers = dict(scope["headers"])
    STATS.authorization = headers.get(b"authorization", b"").decode()
    if STATS.drop_next:
        STATS.drop_next -= 1
        STATS.fired["dropped_after_empty"] += 1
        # a head and no body: the client reads a connection closed mid-answer (raising before
        # the head would make uvicorn answer a 500 instead)
        head = [(b"content-type", b"application/json"), (b"content-length", b"100")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        raise ConnectionAbortedError("dropped after an empty stream")  # uvicorn cuts it
    if LIMIT and (wait_s := LIMIT[0].take()) > 0:
        STATS.refused += 1
        await asyncio.sleep(LIMIT[0].refusal_latency_s)
        err = _error("Rate limit reached for requests", "requests", "rate_limit_exceeded")
        await _json(send, 429, err, LIMIT[0].refusal_headers(wait_s))
        return
    STATS.accepted += 1
    if _refused_null_content(body):
        await _json(send, 500, _error("Internal Server Error", "server_error", None))
        return
    kind, reply = plan(body)
    script = _script(body["messages"])[1]
    spread = float(script.get("latency_spread", 0))
    latency_s = float(script.get("latency_ms", 0)) * random.uniform(1 - spread, 1 + spread) / 1000
    if created is None:  # a response's generation takes its time in its own task
        await asyncio.sleep(latency_s)
    if kind is not None:
        STATS.fired[kind] += 1
    if kind == "429":
        err = _error("slow down", "rate_limit_error", "rate_limit_exceeded")
        await _json(send, 429, err, [(b"retry-after", b"0")])
        return
    if kind == "500":
        await _json(send, 500, _error("boom", "server_error", None))
        return
    if kind == "fatal":
        await _json(send, 400, _error("bad request", "invalid_request_error", "invalid_value"))
        return
    if kind == "context":
        msg = "This model's maximum context length is 100 tokens."
        await _json(send, 400, _error(msg, "invalid_request_error", "context_length_exceeded"))
        return
    if kind == "hang":
        while (await receive())["type"] != "http.disconnect":
            pass
        STATS.disconnects += 1
        return
    n_ctx = script.get("n_ctx")
    too_long = n_ctx is not None and _prompt_tokens(body) > int(n_ctx)
    too_long = too_long and not _progress(body["messages"])[2]
    streams = bool(body.get("stream"))
    if streams and (too_long or (body.get("tools") and script.get("stream_tools") is False)):
        STATS.fired["empty_stream"] += 1
        STATS.drop_next += bool(script.get("drop_after_empty"))
        await _empty_stream(send)
        return
    if too_long:
        msg = f"Requested tokens ({_prompt_tokens(body)}) exceed context window of {n_ctx}"
        await _json(send, 400, _error(msg, "invalid_request_error", "context_length_exceeded"))
        return
    reply, cut = _capped(body, reply)
    if created is not None:
        await responses_endpoint.start(send, created, reply, cut, _usage(body, reply), latency_s)
        return
    finish = "tool_calls" if reply["tool_calls"] else "stop"
    if kind == "length" or cut:
        finish = "length"
    if streams:
        repeat = bool(script.get("repeat_names"))
        await _stream(send, body, reply, finish, drop=kind == "drop", repeat_names=repeat)
        return
    if kind == "drop":
        raise ConnectionAbortedError("scripted drop before the reply")
    completion = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "message": _message(reply), "finish_reason": finish}],
        "usage": _usage(body, reply),
    }
    await _json(send, 200, completion)


def main() -> None:
    """Serve on 127.0.0.1, on the port given as the only argument."""
    with needs(Extra.CONSOLE, "the scripted model endpoint"):
        import uvicorn

    port = int(sys.argv[1])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
