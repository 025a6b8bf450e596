"""Compaction, loop detection and the scripted model: pure pieces the loop relies on."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import ScriptedLLM
from actors.turn.compaction import compact, progress, read_summary
from actors.turn.llm import LLMRequest
from actors.turn.loopdetect import CallHistory, LoopThresholds, LoopVerdict, detect_loop
from bus.errors import ContextLengthError, RetryableLLMError
from bus.messages import Message, ToolCall, ToolResult
from store.records import MessageMeta


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


def ran(c: ToolCall, output: str, status: str = "ok") -> list[Message]:
    """One batch of ``c`` that returned ``output``."""
    res = ToolResult(call_id=c.id, name=c.name, status=status, output=output)  # type: ignore[arg-type]
    return [
        Message(role="assistant", text="r", tool_calls=(c,)),
        Message(role="tool", tool_result=res),
    ]


def test_the_same_call_with_the_same_result_is_a_loop() -> None:
    same = call(text="same")
    turn: list[Message] = []
    verdicts = []
    for _ in range(7):
        verdicts.append(detect_loop(turn, [same]).verdict)
        turn += ran(same, "always this")
    assert verdicts == [LoopVerdict.OK] * 3 + [LoopVerdict.SUSPECT] * 3 + [LoopVerdict.STOP]
    found = detect_loop(turn[:6], [same])
    assert found.repeats == 3 and "same result 3 times in a row" in found.reason()


def test_a_call_whose_result_changes_is_polling_not_a_loop() -> None:
    poll = ToolCall(id="p", name="job_status", args={"job": 7})
    turn: list[Message] = []
    for i in range(20):  # a counter, a job's progress, a test run after each fix
        assert detect_loop(turn, [poll]).verdict is LoopVerdict.OK
        turn += ran(poll, f"progress {i}")
    # the same answer twice in a row is still patience, a third time in a row is suspect
    turn += ran(poll, "done") + ran(poll, "done")
    assert detect_loop(turn, [poll]).verdict is LoopVerdict.OK
    turn += ran(poll, "done")
    assert detect_loop(turn, [poll]).verdict is LoopVerdict.SUSPECT


def test_skipped_asks_extend_the_run_and_other_calls_do_not_break_it() -> None:
    same = call(text="same")
    turn = ran(same, "x") + ran(call(text="other"), "y") + ran(same, "x") + ran(same, "x")
    assert detect_loop(turn, [same]).repeats == 3
    turn += ran(same, "not run: looping", status="skipped") * 3
    assert detect_loop(turn, [same]).verdict is LoopVerdict.STOP
    assert detect_loop(turn, [call(text="fresh")]).verdict is LoopVerdict.OK


def test_a_kept_history_reads_each_message_once_and_agrees_with_a_fresh_read() -> None:
    same, poll = call(text="same"), ToolCall(id="p", name="job_status", args={"job": 7})
    history, turn = CallHistory(), list[Message]()
    for i in range(8):
        for batch in ([same], [poll]):
            kept = detect_loop(turn, batch, history=history)
            assert kept == detect_loop(turn, batch)
        turn += ran(same, "always this") + ran(poll, f"progress {i}")
    assert history.runs(turn) is history.runs(turn)  # nothing new: nothing read again
    # A compaction rewrites the turn: its new messages are read from the start.
    compacted = [Message(role="user", text="summary"), *ran(same, "always this")]
    assert detect_loop(compacted, [same], history=history).repeats == 1
    assert detect_loop(compacted, [same], history=history) == detect_loop(compacted, [same])


def test_loop_thresholds_are_per_agent_and_checked() -> None:
    same = call(text="same")
    turn = ran(same, "x") * 3
    patient = LoopThresholds(suspect_repeats=10, stop_repeats=20)
    assert detect_loop(turn, [same], patient).verdict is LoopVerdict.OK
    with pytest.raises(ValueError, match="suspect_repeats"):
        LoopThresholds(suspect_repeats=5, stop_repeats=2)


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


def test_text_from_outside_is_made_storable_and_what_is_not_is_a_typed_error() -> None:
    from bus.errors import UnstorableRecord
    from bus.messages import Message, ToolCall, ToolResult
    from store.msgpack_wire import pack
    from store.records import TurnInput

    lone = "a\udcffb"
    with pytest.raises(UnstorableRecord):  # what msgpack says of a raw one, typed
        pack(lone)
    with pytest.raises(UnstorableRecord):
        pack({"x": object()})
    call = ToolCall(id="c", name="t", args={"path": lone, "nested": [lone]})
    assert call.args == {"path": "a\ufffdb", "nested": ["a\ufffdb"]}
    assert Message(role="assistant", text=lone, tool_calls=(call,)).text == "a\ufffdb"
    assert ToolResult(call_id="c", name="t", status="ok", output=lone).output == "a\ufffdb"
    assert TurnInput(message=lone).message == "a\ufffdb"
    pack(Message(role="user", text=lone).model_dump())  # storable now
