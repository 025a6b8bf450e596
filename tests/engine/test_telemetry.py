"""OpenTelemetry traces against a local OTLP/HTTP receiver (``tests/support/otlp_receiver.py``):
the official SDK's exporter sends, the receiver decodes with the official protobuf types. A
turn's spans arrive with the GenAI attributes; a turn SIGKILLed and resumed is one trace whose
second incarnation links to the first; no secret is in any attribute."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.settings.config import Settings
from actors.engine.telemetry import incarnation_span_id, turn_trace_id
from actors.engine.turn_engine import TurnEngine
from store.keys import KeyLayout
from store.records import TurnInput
from store.write.checkpoint import RedisCheckpointStore
from tests.support.agents import TEST_KEY_ENV
from tests.support.console_server import serving
from tests.support.otlp_receiver import ReceivedSpan, Receiver, receiving
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-telemetry-secret-0123456789"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


def settings(namespace: str, receiver: Receiver, **telemetry: Any) -> Settings:
    return Settings.model_validate({
        "redis": {"namespace": namespace}, "loop": {"strict": True},
        "checkpoint": {"min_interval_s": 0},
        "telemetry": {"endpoint": receiver.url, "export_delay_ms": 50, **telemetry},
    })  # fmt: skip


def everything(span: ReceivedSpan) -> str:
    """Every attribute and resource value of a span, as one string to search."""
    return json.dumps([span.attributes, span.resource, span.name], default=str)


async def test_a_turns_spans_arrive_with_genai_attributes_and_no_secret(
    real_client: aioredis.Redis, redis_url: str, namespace: str, receiver: Receiver,
    openai_server: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("OPENAI_BASE_URL", openai_server)
    monkeypatch.setenv(TEST_KEY_ENV, SECRET)
    engine = TurnEngine.from_settings(real_client, settings(namespace, receiver), watchdog=None)
    script = {"rounds": 2, "tool": "add", "faults": {}}
    ask = TurnInput(message=f"#script {json.dumps(script)}\nAdd, please.")
    stats = await engine.run_new("tests.support.agents:http_stream", ask, ["otel-1"])
    assert stats.outcomes == {"answered": 1}
    await engine.aclose()

    async def arrived() -> list[ReceivedSpan] | None:
        spans = [s for s in receiver.spans() if s.trace_id == turn_trace_id("otel-1")]
        return spans if any(s.name.startswith("turn ") for s in spans) else None

    spans = await eventually(arrived, timeout=30, what="the turn's spans at the receiver")
    (turn,) = [s for s in spans if s.name == "turn otel-1"]
    assert turn.span_id == incarnation_span_id("otel-1", 1) and turn.parent_id == 0
    assert turn.attributes["phaseline.outcome"] == "answered"
    assert turn.resource["service.name"] == "phaseline"
    assert "checkpoint" in turn.events
    chats = [s for s in spans if s.name == "chat test-model"]
    assert len(chats) == 3 and all(s.parent_id == turn.span_id for s in chats)
    first = chats[0].attributes
    assert first["gen_ai.operation.name"] == "chat" and first["gen_ai.system"] == "openai"
    assert first["gen_ai.request.model"] == "test-model"
    assert first["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert first["gen_ai.usage.input_tokens"] > 0 and first["gen_ai.usage.output_tokens"] > 0
    tools = [s for s in spans if s.name == "execute_tool add"]
    assert len(tools) == 2 and all(s.parent_id == turn.span_id for s in tools)
    assert tools[0].attributes["phaseline.tool.status"] == "ok"
    assert tools[0].attributes["phaseline.tool.idempotent"] is True
    assert tools[0].attributes["phaseline.tool.call_key"]
    assert tools[0].attributes["phaseline.tool.outcome_unknown"] is False
    for span in spans:  # contents off by default; no key, no URL with a password
        text = everything(span)
        assert SECRET not in text and redis_url not in text
        assert "gen_ai.tool.call.arguments" not in span.attributes
        assert "gen_ai.output.messages" not in span.attributes


async def test_contents_go_on_the_spans_only_when_asked(
    real_client: aioredis.Redis, namespace: str, receiver: Receiver
) -> None:
    cfg = settings(namespace, receiver, capture_content=True)
    engine = TurnEngine.from_settings(real_client, cfg, watchdog=None)
    from actors.engine.models.scenario import parse_scenario
    from actors.engine.models.scripted import scripted_turn

    sc = parse_scenario({"name": "otel", "rounds": 1, "tools_per_round": 1})
    await engine.run_new(*scripted_turn(sc), ["otel-c"])
    await engine.aclose()

    async def tool_span() -> ReceivedSpan | None:
        found = [s for s in receiver.spans() if s.name == "execute_tool echo"]
        return found[0] if found else None

    span = await eventually(tool_span, timeout=30, what="the tool span")
    assert "gen_ai.tool.call.arguments" in span.attributes
    assert "gen_ai.tool.call.result" in span.attributes


def _config(tmp: Path, receiver: Receiver) -> Path:
    path = tmp / "otel.toml"
    path.write_text(
        "[checkpoint]\nmin_interval_s = 0.0\n[loop]\nstrict = true\nbackoff_scale = 0.01\n"
        f'[telemetry]\nendpoint = "{receiver.url}"\nexport_delay_ms = 50\n'
    )
    return path


async def test_a_turn_killed_and_resumed_is_one_trace_linked_across_the_kill(
    real_client: aioredis.Redis, redis_url: str, namespace: str, receiver: Receiver,
    tmp_path: Path,
) -> None:  # fmt: skip
    scenario = tmp_path / "slow.toml"
    scenario.write_text(
        'name = "slow"\nrounds = 4\ntools_per_round = 1\ntools = ["echo"]\n'
        "llm_latency_ms = 1500\ntool_latency_ms = 5\npayload_bytes = 100\n"
    )
    config = _config(tmp_path, receiver)
    common = ["--redis-url", redis_url, "--namespace", namespace, "--config", str(config)]
    child = subprocess.Popen(  # noqa: ASYNC220 - started, not waited on
        [sys.executable, "-m", "actors.cli", "run", "--in-process", *common,
         "--scenario", str(scenario), "--turns", "1", "--run-id", "otk"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    turn_id = "otk-t000000"
    first = incarnation_span_id(turn_id, 1)

    async def first_tool_exported() -> bool:
        assert child.poll() is None, child.stderr.read() if child.stderr else "child exited"
        return any(s.parent_id == first and s.name.startswith("execute_tool")
                   for s in receiver.spans())  # fmt: skip

    try:
        await eventually(first_tool_exported, timeout=60, what="the first tool span exported")
        os.kill(child.pid, signal.SIGKILL)  # in the next 1.5 s model call
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    store = RedisCheckpointStore(real_client, KeyLayout(namespace))
    assert (await store.load(turn_id)).in_progress
    resume = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "actors.cli", "resume", "--in-process", *common],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resume.returncode == 0, resume.stderr
    final = await store.load(turn_id)
    assert not final.in_progress and final.epoch == 2

    async def second_arrived() -> list[ReceivedSpan] | None:
        spans = [s for s in receiver.spans() if s.trace_id == turn_trace_id(turn_id)]
        done = any(s.span_id == incarnation_span_id(turn_id, 2) for s in spans)
        return spans if done else None

    spans = await eventually(second_arrived, timeout=30, what="the resumed incarnation's span")
    (second,) = [s for s in spans if s.span_id == incarnation_span_id(turn_id, 2)]
    assert second.links == (first,)  # linked to the killed incarnation
    assert second.attributes["phaseline.epoch"] == 2
    assert second.attributes["phaseline.outcome"] == "answered"
    assert "resumed" in second.events
    before = [s for s in spans if s.parent_id == first]
    after = [s for s in spans if s.parent_id == second.span_id]
    assert before and after  # each incarnation's calls under its own span, in one trace
    assert {s.trace_id for s in spans} == {turn_trace_id(turn_id)}
    password = redis_url.split("@")[0].rsplit(":", 1)[-1]
    assert all(password not in everything(s) for s in spans)
    # and the console tells the same story: epoch 1's rows, the resume, epoch 2's rows
    with serving(redis_url, namespace) as console:
        page = await asyncio.to_thread(_read, f"{console}/turns/{turn_id}")
    assert "resumed at epoch 2 from its tool_batch checkpoint" in page
    assert '<td class="e">e1</td>' in page and '<td class="e">e2</td>' in page
    assert page.index('<td class="e">e1</td>') < page.index("resumed at epoch 2")


def _read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return str(reply.read().decode())
