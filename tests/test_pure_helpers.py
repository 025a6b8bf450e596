"""Compaction, loop detection and the scripted model: pure pieces the loop relies on."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.scenario import parse_scenario
from actors.engine.scripted import ScriptedLLM
from actors.turn.compaction import compact, progress, read_summary
from actors.turn.llm import LLMRequest
from actors.turn.loopdetect import LoopVerdict, detect_loop
from bus.errors import ContextLengthError, RetryableLLMError
from store.records import Message, MessageMeta, ToolCall, ToolResult


def call(name: str = "echo", text: str = "x") -> ToolCall:
    return ToolCall(id="c", name=name, args={"text": text})


def batch(*calls: ToolCall) -> list[Message]:
    out = [Message(role="assistant", text="r", tool_calls=calls)]
    out += [
        Message(role="tool", tool_result=ToolResult(call_id="c", name=c.name, status="ok"))
        for c in calls
    ]
    return out


def meta_for(msgs: list[Message]) -> list[MessageMeta]:
    return [MessageMeta(source="llm", message_id=str(i), at_ms=i) for i in range(len(msgs))]


def test_compaction_keeps_last_round_and_counts_what_it_dropped() -> None:
    turn = batch(call(text="a")) + batch(call(text="b")) + batch(call(text="c"))
    shrunk = compact(turn, meta_for(turn), at_ms=5, message_id="sum")
    assert shrunk is not None
    msgs, meta = shrunk
    assert len(msgs) == len(meta) == 3
    assert read_summary(msgs[0]) is not None
    assert msgs[1:] == turn[-2:]
    assert meta[0].system_injected and meta[0].message_id == "sum"
    assert progress(msgs).rounds == progress(turn).rounds == 3
    # compacting again folds the earlier summary in
    again = compact([*msgs, *batch(call(text="d"))], meta_for([*msgs, *batch(call(text="d"))]),
                    at_ms=6, message_id="sum2")  # fmt: skip
    assert again is not None and progress(again[0]).rounds == 4


def test_compaction_of_a_single_round_is_impossible() -> None:
    turn = batch(call())
    assert compact(turn, meta_for(turn), at_ms=1, message_id="x") is None


def test_loop_detector_streaks_and_exact_duplicates() -> None:
    turn: list[Message] = []
    verdicts = []
    for _ in range(4):
        turn += batch(call(text="same"))
        verdicts.append(detect_loop(turn))
    assert verdicts == [LoopVerdict.OK, LoopVerdict.SUSPECT, LoopVerdict.SUSPECT, LoopVerdict.STOP]
    # non-consecutive exact duplicates
    turn = []
    for i in range(6):
        turn += batch(call(text="dup"), call(text=f"other{i}"))
        turn += batch(call(text=f"filler{i}"))
    assert detect_loop(turn[:-2]) is LoopVerdict.STOP
    assert detect_loop(batch(call(text="a")) + batch(call(text="b"))) is LoopVerdict.OK


def req(messages: tuple[Message, ...], attempt: int = 0, tools: bool = True) -> LLMRequest:
    return LLMRequest(turn_id="t", messages=messages, tools_enabled=tools, attempt=attempt)


BASE = (Message(role="system", text="s"), Message(role="user", text="u"))


def test_scripted_model_is_a_pure_function_of_the_transcript() -> None:
    sc = parse_scenario(
        {"name": "p", "rounds": 2, "tools_per_round": 3, "tools": ["echo", "sleep"]}
    )
    m1, m2 = ScriptedLLM(sc, baseline=2), ScriptedLLM(sc, baseline=2)
    a = asyncio.run(m1.complete(req(BASE))).message
    assert a == asyncio.run(m2.complete(req(BASE))).message
    assert [c.name for c in a.tool_calls] == ["echo", "sleep", "echo"]
    t = BASE + tuple(batch(*a.tool_calls))
    b = asyncio.run(m1.complete(req(t))).message
    assert [c.name for c in b.tool_calls] == ["sleep", "echo", "sleep"]
    final = asyncio.run(m1.complete(req(t + tuple(batch(*b.tool_calls))))).message
    assert not final.tool_calls and len(final.text) == sc.payload_bytes


def test_scripted_faults_fire_at_the_right_call() -> None:
    sc = parse_scenario({"name": "f", "rounds": 5, "faults": [
        {"at_call": 2, "kind": "retryable", "times": 2},
        {"at_call": 3, "kind": "context_length"},
    ]})  # fmt: skip
    m = ScriptedLLM(sc, baseline=2)
    first = asyncio.run(m.complete(req(BASE))).message
    t = BASE + tuple(batch(*first.tool_calls))
    for attempt in (0, 1):
        with pytest.raises(RetryableLLMError):
            asyncio.run(m.complete(req(t, attempt=attempt)))
    second = asyncio.run(m.complete(req(t, attempt=2))).message
    t2 = t + tuple(batch(*second.tool_calls))
    with pytest.raises(ContextLengthError):
        asyncio.run(m.complete(req(t2)))
    shrunk = compact(list(t2[2:]), meta_for(list(t2[2:])), at_ms=1, message_id="s")
    assert shrunk is not None
    third = asyncio.run(m.complete(req(BASE + tuple(shrunk[0])))).message
    assert third.tool_calls[0].id == "call_2_0"  # the count survived compaction
