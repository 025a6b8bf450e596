"""The OpenAI-compatible model client, through the real ``openai`` SDK, against a local server
that speaks the protocol (JSON and SSE): tool calls, usage, and the error mapping under faults."""

from __future__ import annotations

import dataclasses
import itertools
import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.resume import reopen
from actors.engine.run_stats import RunStats
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.submission import session_tokens
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from actors.turn.watchdog import WatchdogSettings
from bus.errors import BudgetExhausted, ConfigError
from bus.outcomes import Outcome
from store.domain.usage import agent_usage
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnInput
from tests.support.agents import TEST_KEY_ENV, unencodable_input

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)
SECRET = "sk-test-never-stored-0123456789"
STREAM = "tests.support.agents:http_stream"
JSON = "tests.support.agents:http_json"
CAPPED = "tests.support.agents:http_capped"
TIGHT = "tests.support.agents:http_tight"
KEYED = "tests.support.agents:http_keyed"
DEAD = "tests.support.agents:http_dead"
NO_TOOL_STREAMS = "tests.support.agents:http_no_tool_streams"
SMALL_CONTEXT = "tests.support.agents:http_small_context"
POLLER = "tests.support.agents:http_poller"
LIMITED = "tests.support.agents:http_limited"
BUDGET = "tests.support.agents:http_budget"
SESSION_BUDGET = "tests.support.agents:http_session_budget"
FILES = "tests.support.agents:http_files"


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
    watchdog: WatchdogSettings | None = None,
) -> tuple[RunStats, CheckpointRecord]:  # fmt: skip
    engine = TurnEngine(client, keys, EngineSettings(loop=FAST, watchdog=watchdog))
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


async def test_a_cut_tool_call_is_asked_again_once_with_twice_the_room(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    # 4 tokens are 16 characters; "step 1" + its arguments are 22: cut, then asked with 8
    stats, final = await run(real_client, keys, CAPPED, ask(1), "cut-call")
    assert stats.outcomes == {"answered": 1}
    assert not final.counters.reactive_compacted  # the cap is not the context
    assert [c.args for m in final.messages for c in m.tool_calls] == [{"a": 1, "b": 1}]
    caps = [b.get("max_tokens") for b in stats_of(endpoint)["bodies"][-3:]]
    assert caps == [4, 8, 4]  # cut, asked again with room, then the next call as usual
    # the cut reply was thrown away but paid for: its tokens are counted with the others
    kept = sum(m.usage.total for m in final.meta if m.usage is not None)
    assert final.counters.tokens.total > kept and final.counters.unmetered_calls == 0
    # cut again with twice the room: none of its calls is run, the turn says why
    stats, final = await run(real_client, keys, TIGHT, ask(1), "cut-twice")
    assert stats.outcomes == {"aborted:truncated": 1}
    assert not [m for m in final.messages if m.tool_calls]
    error = final.counters.last_error
    assert error is not None and error.kind == "truncated" and "max_tokens" in error.message


async def test_a_cut_text_answer_is_kept_and_named_truncated(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, TIGHT, ask(0), "cut-text")
    assert stats.outcomes == {"truncated": 1}
    assert final.messages[-1].text == "results:"  # "results: " cut at 8 characters, kept


async def test_a_client_error_is_fatal_and_keeps_status_code_and_request_id(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, STREAM, ask(2, **{"1": {"kind": "fatal"}}), "why")
    assert stats.outcomes == {"aborted:fatal": 1}
    assert final.counters.retry_attempts == 0  # not retried
    error = final.counters.last_error
    assert error is not None
    assert (error.source, error.kind, error.status, error.code) == (
        "model", "fatal", 400, "invalid_value",
    )  # fmt: skip
    assert error.request_id and error.request_id.startswith("req_")
    assert "bad request" in error.message
    assert final.finished_event().error == error.line()


async def test_a_dead_endpoint_aborts_with_the_reason_kept(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, DEAD, ask(1), "dead")
    assert stats.outcomes == {"aborted:retryable": 1}
    error = final.counters.last_error
    assert error is not None and error.kind == "retryable" and error.status is None
    assert "APIConnectionError" in error.message and error.attempt == 3


async def test_tool_calls_without_text_are_sent_with_empty_content(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    """llama.cpp's server answers 500 to ``"content": null`` beside ``tool_calls``."""
    turn_input = TurnInput(message=f"#script {json.dumps({'rounds': 2, 'call_text': False})}\nAdd.")
    stats, final = await run(real_client, keys, JSON, turn_input, "no-text")
    assert stats.outcomes == {"answered": 1} and final.counters.retry_attempts == 0
    sent = stats_of(endpoint)["bodies"][-1]["messages"]
    assert [m["content"] for m in sent if m["role"] == "assistant"] == ["", ""]


async def test_an_empty_stream_with_tools_falls_back_to_json_and_is_remembered(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    script = {"rounds": 2, "stream_tools": False, "drop_after_empty": True}
    turn_input = TurnInput(message=f"#script {json.dumps(script)}\nAdd.")
    before = stats_of(endpoint)["fired"].get("empty_stream", 0)
    with caplog.at_level("WARNING", logger="actors.engine.models.openai_chat"):
        stats, final = await run(real_client, keys, NO_TOOL_STREAMS, turn_input, "nostream1")
        stats2, _ = await run(real_client, keys, NO_TOOL_STREAMS, turn_input, "nostream2")
    assert stats.outcomes == stats2.outcomes == {"answered": 1}
    assert final.counters.last_error is None and final.messages[-1].text == "results: 2,3"
    fired = stats_of(endpoint)["fired"]
    assert fired["empty_stream"] - before == 1  # remembered after one
    assert fired["dropped_after_empty"] >= 1  # the resend after a dropped request spent no retry
    said = [r for r in caplog.records if "cannot stream tool calls" in r.getMessage()]
    assert len(said) == 1


async def test_a_tool_name_repeated_in_every_delta_is_set_once(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    turn_input = TurnInput(message=f"#script {json.dumps({'rounds': 2, 'repeat_names': True})}\nA")
    stats, final = await run(real_client, keys, STREAM, turn_input, "names")
    assert stats.outcomes == {"answered": 1}
    assert [c.name for m in final.messages for c in m.tool_calls] == ["add", "add"]


async def test_a_prompt_too_long_for_a_stream_is_compacted(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    """Streamed, the too-long prompt gets an empty stream; asked again without streaming, the
    endpoint's own 400 ``context_length_exceeded``: compaction, not a transient retry."""
    script = {"rounds": 4, "n_ctx": 260}
    turn_input = TurnInput(message=f"#script {json.dumps(script)}\nAdd, please.")
    stats, final = await run(real_client, keys, SMALL_CONTEXT, turn_input, "too-long")
    assert stats.outcomes == {"answered": 1}
    assert final.counters.reactive_compacted and final.counters.retry_attempts == 0
    assert final.counters.last_error is not None
    assert final.counters.last_error.code == "context_length_exceeded"


async def test_an_agent_that_polls_a_tool_runs_to_its_answer(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """The same call with the same arguments, a different result each time: polling."""
    script = {"rounds": 4, "tool": "job_status", "args": {"job": 7}}
    turn_input = TurnInput(message=f"#script {json.dumps(script)}\nPoll it.")
    stats, final = await run(real_client, keys, POLLER, turn_input, "poll")
    assert stats.outcomes == {"answered": 1} and final.counters.nudges == 0
    steps = ",".join(f"job 7: step {n} of 4" for n in (1, 2, 3))
    assert final.messages[-1].text == f"results: {steps},job 7: done"


async def test_the_force_stops_wrap_up_call_is_retried(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    """A call that keeps returning the same result is skipped and nudged, then the turn is
    stopped; a 429 on the wrap-up call is retried like any other model call."""
    script = {"rounds": 20, "args": {"a": 1, "b": 1}, "faults": {"8": {"kind": "429"}}}
    turn_input = TurnInput(message=f"#script {json.dumps(script)}\nLoop.")
    stats, final = await run(real_client, keys, JSON, turn_input, "stop-429")
    assert stats.outcomes == {"force_stopped": 1}
    assert final.counters.nudges == 3
    results = [m.tool_result for m in final.messages if m.tool_result is not None]
    assert [r.status for r in results] == ["ok"] * 3 + ["skipped"] * 4
    assert final.messages[-1].role == "assistant" and final.messages[-1].text.startswith("results")
    assert final.counters.last_error is not None and final.counters.last_error.status == 429


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

    from tests.support.polling import eventually

    assert await eventually(gone, what="the server saw the request go away") == 1


async def test_the_api_key_goes_to_the_endpoint_and_nowhere_else(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str
) -> None:
    await run(real_client, keys, STREAM, ask(1), "key")
    assert stats_of(endpoint)["authorization"] == f"Bearer {SECRET}"
    async for key in real_client.scan_iter(f"{keys.namespace}:*"):
        dumped = await real_client.dump(key)
        assert dumped is not None and SECRET.encode() not in dumped, key


async def test_a_missing_api_key_leaves_the_turn_for_a_host_that_has_it_then_suspends_it(
    real_client: aioredis.Redis, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TEST_KEY_ENV)
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    # This process runs what it submits: refused before anything is written.
    with pytest.raises(ConfigError, match=f"\\${TEST_KEY_ENV} is not set here.*none was written"):
        await engine.run_new(KEYED, ask(1), ["nokey"])
    assert await real_client.exists(keys.turn("nokey"), keys.spec("nokey")) == 0
    # Submitted by a client for hosts elsewhere, then started on one without the key: the
    # host leaves it for another, with the reason.
    spec, record = (await engine.submit_many(KEYED, ask(1), ["nokey"]))[0]
    await engine.start(record, spec)
    record = await engine.store.load("nokey")
    assert record.in_progress
    error = record.counters.last_error
    assert error is not None and error.source == "agent" and record.counters.agent_failures == 1
    assert f"${TEST_KEY_ENV} is not set here" in error.message and "cannot run on" in error.message
    for _ in range(2):  # two more hosts without the key: the turn is parked, with its reason
        done = await engine.start(await engine.store.load("nokey"), spec)
    parked = await engine.store.load("nokey")
    assert done.outcome == Outcome.SUSPENDED_AGENT_UNAVAILABLE and not parked.in_progress
    assert parked.counters.outcome == Outcome.SUSPENDED_AGENT_UNAVAILABLE
    assert parked.counters.agent_failures == 3 and parked.counters.resume_attempts == 0
    # after a fix, an operator's resume runs it to its end
    monkeypatch.setenv(TEST_KEY_ENV, SECRET)
    reopened = await reopen(engine.store, "nokey")
    assert reopened.in_progress and reopened.counters.agent_failures == 0
    assert (await engine.start(reopened, spec)).outcome == Outcome.ANSWERED


async def test_a_local_endpoint_is_called_without_a_key_when_none_is_set(
    real_client: aioredis.Redis, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    """llama.cpp, Ollama and vLLM check no key: none set is no reason to refuse the turn."""
    monkeypatch.delenv(TEST_KEY_ENV)
    stats, _ = await run(real_client, keys, STREAM, ask(1), "keyless")
    assert stats.outcomes == {"answered": 1}
    assert stats_of(endpoint)["authorization"] == "Bearer unused"


@pytest.fixture
def rate_limit(endpoint: str) -> Iterator[Callable[..., None]]:
    """Sets the test endpoint's provider-like limit; lifted after the test."""

    def limit(**spec: Any) -> None:
        url = endpoint.removesuffix("/v1") + "/_limit"
        req = urllib.request.Request(url, json.dumps(spec).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5):
            pass

    yield limit
    limit()


@pytest.mark.parametrize("headers", [True, False])
async def test_a_burst_over_the_rate_limit_waits_and_every_turn_answers(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str,
    rate_limit: Callable[..., None], headers: bool,
) -> None:  # fmt: skip
    """20 turns of 3 calls at once against 600 requests a minute with a burst of 5: most calls
    are refused at first; each waits as long as the endpoint asks (or backs off when it says
    nothing) without spending a transient-error attempt, and every turn answers."""
    rate_limit(rpm=600, burst=5, headers=headers)
    ids = [f"rl{headers:d}-{i}" for i in range(20)]
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    stats = await engine.run_new(JSON, ask(2), ids)
    seen = stats_of(endpoint)
    assert stats.outcomes == {"answered": 20}
    assert seen["refused"] > 0 and seen["accepted"] >= 60
    waited = [r for r in [await engine.store.load(t) for t in ids] if r.counters.last_error]
    assert waited, "no turn was refused"
    for record in waited:
        error = record.counters.last_error
        assert error is not None and (error.kind, error.status) == ("rate_limited", 429)
        assert error.code == "rate_limit_exceeded"


async def test_a_rate_limit_past_the_cap_aborts_the_turn_rate_limited(
    real_client: aioredis.Redis, keys: KeyLayout, rate_limit: Callable[..., None]
) -> None:
    rate_limit(rpm=1, burst=1, headers=True)  # the next request in a minute
    settings = dataclasses.replace(FAST, rate_limit_max_wait_s=0.2)
    engine = TurnEngine(real_client, keys, EngineSettings(loop=settings, watchdog=None))
    stats = await engine.run_new(JSON, ask(0), ["capped1", "capped2"])  # one call each
    assert stats.outcomes == {"aborted:rate_limited": 1, "answered": 1}


async def test_with_the_limit_declared_the_cluster_keeps_to_it(
    real_client: aioredis.Redis, keys: KeyLayout, endpoint: str, rate_limit: Callable[..., None]
) -> None:
    """The same burst, the agent declaring the endpoint's limit: calls wait in the cluster's
    limiter instead of being refused (at most 10 % refused), and every turn answers. A call
    the limiter held back was never sent: the turns' model calls are the endpoint's requests."""
    rate_limit(rpm=600, burst=5, headers=True)
    ids = [f"decl-{i}" for i in range(20)]
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    before = stats_of(endpoint)["requests"]
    stats = await engine.run_new(LIMITED, ask(2), ids)
    seen = stats_of(endpoint)
    assert stats.outcomes == {"answered": 20}
    assert seen["accepted"] >= 60 and seen["refused"] <= 0.1 * seen["accepted"], seen
    records = [await engine.store.load(tid) for tid in ids]
    for record in records:  # held back by the limiter is no error of the turn
        error = record.counters.last_error
        assert error is None or error.status == 429, error
    assert sum(r.counters.model_calls for r in records) == seen["requests"] - before


async def test_tokens_are_summed_per_turn_and_a_budget_wraps_the_turn_up(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, JSON, ask(2), "metered")
    used = [m.usage for m in final.meta if m.usage is not None]
    assert len(used) == 3 and final.counters.unmetered_calls == 0
    assert final.counters.tokens.total == sum(u.total for u in used) > 0
    # a budget of 100 tokens: the batch asked for once it is spent is not run
    stats, final = await run(real_client, keys, BUDGET, ask(4), "budget")
    assert stats.outcomes == {"budget_exhausted": 1}
    results = [m.tool_result for m in final.messages if m.tool_result is not None]
    assert [r.status for r in results] == ["ok"] * (len(results) - 1) + ["skipped"]
    assert len(results) < 4 and "budget of 100 tokens" in results[-1].output
    assert final.messages[-1].role == "assistant" and final.counters.tokens.total >= 100


async def test_a_sessions_tokens_add_up_across_turns_and_its_budget_ends_it(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    finals: list[CheckpointRecord] = []
    with pytest.raises(BudgetExhausted) as refused:
        for _ in range(10):  # 150 tokens a session: a few turns of one round each
            done = await engine.run_in_session(SESSION_BUDGET, ask(1), "metered-session")
            finals.append(await engine.store.load(done.turn_id))
    assert 2 <= len(finals) < 10
    # each turn starts from its predecessors' tokens; the session's total is counted once
    for before, after in itertools.pairwise(finals):
        assert after.counters.session_prior == session_tokens(before)
    total = session_tokens(finals[-1])
    assert refused.value.spent == total.total >= 150 and refused.value.budget == 150
    assert total.total == sum(f.counters.tokens.total for f in finals)
    # the session opened turns while it was under its budget, and no more
    assert session_tokens(finals[-2]).total < 150 <= total.total
    assert {f.counters.outcome for f in finals} <= {"answered", "budget_exhausted"}
    # the agent's totals are the finished turns', added once each
    (usage,) = [u for u in await agent_usage(real_client, keys) if u.agent == SESSION_BUDGET]
    assert (usage.turns, usage.tokens) == (len(finals), total)


async def test_text_utf8_cannot_hold_is_made_storable_where_it_enters(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    stats, final = await run(real_client, keys, FILES, unencodable_input(), "surrogates")
    assert stats.outcomes == {"answered": 1}
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.output == "report-\ufffd.txt"
    assert final.answer == "done \ufffd"
    assert final.messages[1].text.endswith("list \ufffd")
    # and a later resume of the namespace reads it back like any other
    assert (await TurnEngine(real_client, keys).resume_all()).turns == 0


async def test_a_tool_result_over_the_cap_fails_its_call_not_the_turn(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    script = {"rounds": 1, "tool": "dump", "args": {}}
    turn_input = TurnInput(message=f"#script {json.dumps(script)}\nDump it.")
    stats, final = await run(real_client, keys, "tests.support.agents:http_dump", turn_input, "big")
    assert stats.outcomes == {"answered": 1}
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.status == "error"
    assert "returned 2,097,152 bytes, over the limit of 1,048,576 bytes" in result.output
    engine = TurnEngine(real_client, keys)
    (entry,) = (await engine.ledger.entries("big")).values()
    assert entry.result is not None and len(entry.result.output) < 1000  # never the 2 MiB
