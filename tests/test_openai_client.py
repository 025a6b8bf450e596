"""The OpenAI-compatible model client, through the real ``openai`` SDK, against a local server
that speaks the protocol (JSON and SSE): tool calls, usage, and the error mapping under faults."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.turn_engine import RunStats, TurnEngine
from actors.turn.loop import LoopSettings
from actors.turn.watchdog import WatchdogSettings
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnInput
from tests.agents_for_tests import TEST_KEY_ENV

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)
SECRET = "sk-test-never-stored-0123456789"
STREAM = "tests.agents_for_tests:http_stream"
JSON = "tests.agents_for_tests:http_json"


@pytest.fixture(autouse=True)
def endpoint(openai_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OPENAI_BASE_URL", openai_server)
    monkeypatch.setenv(TEST_KEY_ENV, SECRET)
    return openai_server


def stats_of(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/_stats", timeout=5) as reply:
        return dict(json.loads(reply.read()))


def ask(rounds: int = 2, **faults: dict[str, Any]) -> TurnInput:
    script = {"rounds": rounds, "tool": "add", "faults": faults}
    return TurnInput(message=f"#script {json.dumps(script)}\nAdd, please.")


async def run(
    client: aioredis.Redis, keys: KeyLayout, agent: str, turn_input: TurnInput, turn_id: str,
    **engine_kw: Any,
) -> tuple[RunStats, CheckpointRecord]:  # fmt: skip
    engine_kw.setdefault("watchdog", None)
    engine = TurnEngine(client, keys, loop_settings=FAST, **engine_kw)
    stats = await engine.run_new(agent, turn_input, [turn_id])
    return stats, await engine.store.load(turn_id)


def texts(record: CheckpointRecord) -> list[tuple[str, str, tuple[Any, ...], str]]:
    """The transcript without per-run ids of the messages' meta."""
    return [
        (m.role, m.text, tuple((c.id, c.name, c.args) for c in m.tool_calls),
         m.tool_result.output if m.tool_result else "")
        for m in record.messages
    ]  # fmt: skip


@pytest.mark.parametrize("agent", [STREAM, JSON])
async def test_tool_calls_round_trip_in_the_real_wire_format(
    real_client: aioredis.Redis, keys: KeyLayout, agent: str, endpoint: str
) -> None:
    stats, final = await run(real_client, keys, agent, ask(), f"ok-{agent[-4:]}")
    assert stats.outcomes == {"answered": 1}
    calls = [c for m in final.messages for c in m.tool_calls]
    assert [(c.id, c.name, c.args) for c in calls] == [
        ("call_1", "add", {"a": 1, "b": 1}),
        ("call_2", "add", {"a": 2, "b": 1}),
    ]  # streamed arguments arrive split across deltas, reassembled by index
    assert final.messages[-1].text == "results: 2,3"
    replies = [meta for m, meta in zip(final.messages, final.meta, strict=True)
               if m.role == "assistant"]  # fmt: skip
    assert all(meta.usage is not None and meta.usage.prompt_tokens > 0 for meta in replies)
    sent = stats_of(endpoint)["bodies"][-1]
    assert sent["tools"][0]["function"]["name"] == "add"
    assert sent["tools"][0]["function"]["parameters"]["required"] == ["a"]
    assert [m["role"] for m in sent["messages"]][-2:] == ["assistant", "tool"]
    assert sent["messages"][-1]["tool_call_id"] == "call_2"


async def test_retryable_faults_are_retried_by_the_loop_and_change_nothing(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    _, clean = await run(real_client, keys, STREAM, ask(), "clean")
    before = stats_of(endpoint)["fired"]
    faults = {"1": {"kind": "429"}, "2": {"kind": "500"}, "3": {"kind": "drop"}}
    stats, faulty = await run(real_client, keys, STREAM, ask(**faults), "faulty")
    fired = stats_of(endpoint)["fired"]
    assert {k: fired.get(k, 0) - before.get(k, 0) for k in ("429", "500", "drop")} == {
        "429": 1, "500": 1, "drop": 1,
    }  # fmt: skip
    assert stats.outcomes == {"answered": 1}
    assert texts(faulty)[2:] == texts(clean)[2:]  # the same turn, the prompt aside


async def test_a_context_length_error_compacts_and_goes_on(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, STREAM, ask(3, **{"3": {"kind": "context"}}),
                             "ctx")  # fmt: skip
    assert stats.outcomes == {"answered": 1} and final.counters.reactive_compacted
    assert any(m.text.startswith("[compacted:") for m in final.messages)
    assert final.messages[-1].text.startswith("results:")


async def test_a_reply_cut_at_the_token_limit_is_never_used(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, JSON, ask(3, **{"3": {"kind": "length"}}), "len")
    assert stats.outcomes == {"answered": 1} and final.counters.reactive_compacted
    assert [c.id for m in final.messages for c in m.tool_calls] == ["call_2", "call_3"]
    # with nothing to compact yet, a cut reply ends the turn instead
    stats, _ = await run(real_client, keys, JSON, ask(2, **{"1": {"kind": "length"}}), "len1")
    assert stats.outcomes == {"aborted:context_length": 1}


async def test_a_client_error_is_fatal(real_client: aioredis.Redis, keys: KeyLayout) -> None:
    stats, final = await run(real_client, keys, STREAM, ask(2, **{"1": {"kind": "fatal"}}), "bad")
    assert stats.outcomes == {"aborted:fatal": 1}
    assert final.counters.retry_attempts == 0  # not retried


async def test_the_watchdog_hard_cancel_aborts_the_http_request(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    before = stats_of(endpoint)["disconnects"]
    watchdog = WatchdogSettings(tick_s=0.05, soft_idle_s=0.1, hard_idle_s=0.5)
    stats, _ = await run(real_client, keys, STREAM, ask(2, **{"2": {"kind": "hang"}}), "hung",
                         watchdog=watchdog)  # fmt: skip
    assert stats.outcomes == {"aborted:hard_idle_timeout": 1}

    async def gone() -> int | None:
        n = stats_of(endpoint)["disconnects"] - before
        return n or None

    from tests.polling import eventually

    assert await eventually(gone, what="the server saw the request go away") == 1


async def test_the_api_key_goes_to_the_endpoint_and_nowhere_else(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    await run(real_client, keys, STREAM, ask(1), "key")
    assert stats_of(endpoint)["authorization"] == f"Bearer {SECRET}"
    async for key in real_client.scan_iter(f"{keys.namespace}:*"):
        dumped = await real_client.dump(key)
        assert dumped is not None and SECRET.encode() not in dumped, key


async def test_a_missing_api_key_leaves_the_turn_for_a_host_that_has_it(
    real_client: aioredis.Redis, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TEST_KEY_ENV)
    stats, record = await run(real_client, keys, STREAM, ask(1), "nokey")
    assert stats.unfinished == ["nokey"] and record.in_progress
