"""Agents by import path, Python tools from plain functions, per-agent limits."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.agents import check_agent, load_agent
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.errors import ConfigError
from store.keys import KeyLayout
from store.records import SCRIPTED_AGENT, TurnInput, TurnSpec
from tests.support import agents as agents_for_tests
from tests.support.agents import add

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)


def engine(client: aioredis.Redis, keys: KeyLayout) -> TurnEngine:
    return TurnEngine(client, keys, EngineSettings(loop=FAST, watchdog=None))


def test_a_tool_schema_comes_from_type_hints_and_docstring() -> None:
    assert add.name == "add" and add.idempotent and add.description == "Add two integers."
    assert add.parameters == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "title": "A", "description": "The first addend."},
            "b": {"type": "integer", "title": "B", "description": "The second addend.",
                  "default": 0},
        },
        "required": ["a"],
        "additionalProperties": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("no colon", "not an import path"),
        ("tests.no_such_module:x", "cannot import"),
        ("tests.support.agents:missing", "has no 'missing'"),
        ("tests.support.agents:not_an_agent", "is a int, not an Agent"),
    ],
)
def test_an_agent_path_that_does_not_load_is_a_config_error(path: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        load_agent(path)


def test_the_scripted_agent_checks_its_scenario_at_submission() -> None:
    with pytest.raises(ConfigError, match="needs a scenario"):
        check_agent(SCRIPTED_AGENT, TurnInput(message="hi"))
    bad = {"scenario": {"name": "x", "tools": ["nosuch"]}}
    with pytest.raises(ConfigError, match="unknown tools"):
        check_agent(SCRIPTED_AGENT, TurnInput(message="hi", context=bad))


def test_a_spec_written_before_agents_reads_as_a_scripted_turn() -> None:
    old = {"turn_id": "t", "session_id": "s", "created_at": 1,
           "scenario": {"name": "x", "prompt": "do it"}}  # fmt: skip
    spec = TurnSpec.model_validate(old)
    assert spec.agent == SCRIPTED_AGENT and spec.input.message == "do it"
    assert spec.input.context == {"scenario": {"name": "x", "prompt": "do it"}}


async def test_bad_calls_become_error_results_the_model_reads(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    agents_for_tests.ADD_THREADS.clear()
    e = engine(real_client, keys)
    stats = await e.run_new("tests.support.agents:calculator", TurnInput(message="2+3?"), ["c"])
    assert stats.outcomes == {"answered": 1}
    final = await e.store.load("c")
    assert [m.role for m in final.messages[:2]] == ["system", "user"]
    results = {m.tool_result.call_id: m.tool_result for m in final.messages if m.tool_result}
    assert (results["c1"].status, results["c1"].output) == ("ok", "5")
    assert results["c2"].status == "error" and "a: Input should be a valid integer" in (
        results["c2"].output
    )
    assert results["c3"].status == "error" and "c: Extra inputs are not permitted" in (
        results["c3"].output
    )
    assert results["c4"].status == "error" and "nosuch" in results["c4"].output
    assert results["c5"].status == "error" and "RuntimeError: on purpose" in results["c5"].output
    assert final.messages[-1].text.startswith("ok: 5 | error:")  # the model read them all
    assert agents_for_tests.ADD_THREADS and threading.get_ident() not in (
        agents_for_tests.ADD_THREADS
    )  # the sync tool ran off the event loop


def sc(**kw: Any) -> TurnInput:
    scenario = parse_scenario({"name": "a", "rounds": 4, "payload_bytes": 60, **kw})
    return scripted_turn(scenario)[1]


async def test_an_agent_round_limit_wraps_the_turn_up(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    e = engine(real_client, keys)
    stats = await e.run_new("tests.support.agents:limited", sc(), ["l"])
    assert stats.outcomes == {"force_stopped": 1}
    final = await e.store.load("l")
    assert final.counters.tool_batches == 1
    skipped = [m.tool_result for m in final.messages if m.tool_result and m.tool_result.status
               == "skipped"]  # fmt: skip
    assert skipped and "limit of 1 tool rounds" in skipped[0].output


async def test_an_agent_compaction_threshold_compacts_before_the_context_error(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    e = engine(real_client, keys)
    stats = await e.run_new("tests.support.agents:compacting", sc(), ["k"])
    assert stats.outcomes == {"answered": 1}
    final = await e.store.load("k")
    assert any(m.text.startswith("[compacted:") for m in final.messages)
    assert not final.counters.reactive_compacted
    reference = await e.run_new(*scripted_turn(parse_scenario(
        {"name": "a", "rounds": 4, "payload_bytes": 60})), ["ref"])  # fmt: skip
    assert reference.outcomes == {"answered": 2}  # stats accumulate over the engine's runs
    assert final.messages[-1] == (await e.store.load("ref")).messages[-1]  # same answer


async def test_an_agent_tool_timeout_replaces_the_tools_own(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    e = engine(real_client, keys)
    await e.run_new("tests.support.agents:impatient", sc(rounds=1, tool_latency_ms=500), ["i"])
    final = await e.store.load("i")
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.status == "timeout" and "0.05 s" in result.output


def test_the_example_tools_stay_in_their_sandbox(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from actors.examples.assistant import calculate, read_file
    from actors.turn.tools import ToolContext

    (tmp_path / "notes.txt").write_text("forty-two")
    monkeypatch.setenv("PHASELINE_SANDBOX", str(tmp_path))
    ctx = ToolContext("t", "k")
    assert asyncio.run(read_file.fn({"path": "notes.txt"}, ctx)) == "forty-two"
    with pytest.raises(PermissionError, match="outside the sandbox"):
        asyncio.run(read_file.fn({"path": "../../etc/passwd"}, ctx))
    assert asyncio.run(calculate.fn({"expression": "(2 + 3) * 7 - 2 ** 3"}, ctx)) == "27"
    with pytest.raises(ValueError, match="not arithmetic"):
        asyncio.run(calculate.fn({"expression": "__import__('os')"}, ctx))
