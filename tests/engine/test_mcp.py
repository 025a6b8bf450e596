"""MCP tools: real MCP server processes (``mcp-server-time`` from the package registry, and
``tests/support/mcp_counter_server.py`` written with the SDK's server API), through the
official SDK's client, in the in-process engine: listing, the ledger rule from annotations, the
call key in ``_meta``, error results, a server that does not start, and servers SIGKILLed
mid-call."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.agents import load_agent
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.tools.mcp import hub, mcp_registry
from actors.engine.tools.mcp_sessions import MCPHub
from actors.engine.turn_engine import TurnEngine
from actors.turn.mcp import MCPServer, MCPToolInfo, mcp_idempotent
from actors.turn.settings import LoopSettings
from bus.errors import ConfigError
from store.keys import KeyLayout
from store.records import CheckpointRecord, TurnInput
from tests.support.agents import MCP_HTTP_SECRET, MCP_LOG
from tests.support.polling import eventually

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)
ROOT = Path(__file__).resolve().parents[2]


def engine(client: aioredis.Redis, keys: KeyLayout) -> TurnEngine:
    return TurnEngine(client, keys, EngineSettings(loop=FAST, watchdog=None))


def plan(*calls: tuple[str, dict[str, Any]], quote: bool = True) -> TurnInput:
    return TurnInput(message="go", context={"calls": [list(c) for c in calls], "quote": quote})


def log_text() -> str:
    return Path(MCP_LOG).read_text() if Path(MCP_LOG).exists() else ""


def runs() -> Counter[str]:
    """Call key -> how many times the counter server ran ``bump`` for it."""
    lines = log_text().splitlines()
    return Counter(line.split()[1] for line in lines if line.startswith("bump "))


def results(record: CheckpointRecord) -> list[tuple[str, str]]:
    return [
        (m.tool_result.status, m.tool_result.output)
        for m in record.messages
        if m.tool_result is not None
    ]


def info(**notes: bool | None) -> MCPToolInfo:
    base: dict[str, Any] = {"read_only": None, "idempotent_hint": None, "destructive": None}
    return MCPToolInfo(server="s", name="t", description="", parameters={}, **{**base, **notes})


def test_the_ledger_rule_comes_from_the_annotations() -> None:
    assert mcp_idempotent(info(idempotent_hint=True), {})
    assert mcp_idempotent(info(read_only=True), {})
    assert not mcp_idempotent(info(), {})  # no annotations: not idempotent
    assert not mcp_idempotent(info(destructive=True), {})
    assert not mcp_idempotent(info(idempotent_hint=False, read_only=False), {})
    assert mcp_idempotent(info(destructive=True), {"t": True})  # the agent's word wins
    assert not mcp_idempotent(info(read_only=True), {"t": False})


def test_server_declarations_are_checked_and_keep_secrets_out_of_repr() -> None:
    bad_ones: list[dict[str, Any]] = [
        {"name": "a__b", "command": "x"},
        {"name": "ok"},
        {"name": "ok", "command": "x", "url": "http://h"},
        {"name": "ok", "url": "file:///x"},
        {"name": "", "command": "x"},
    ]
    for bad in bad_ones:
        with pytest.raises(ValueError):
            MCPServer(**bad)
    s = MCPServer(name="api", url="https://h/mcp", headers={"Authorization": "Bearer sk-SECRET"})
    assert "sk-SECRET" not in repr(s) and "Authorization" in repr(s)


async def test_tools_are_listed_with_a_prefix_schemas_and_the_ledger_rule() -> None:
    agent = load_agent("tests.support.agents:mcp_counter")
    registry = await mcp_registry("tests.support.agents:mcp_counter", agent.tools, agent.mcp)
    assert set(registry.names()) == {"add", "tools__bump", "tools__slow", "tools__echo",
                                     "tools__plain", "tools__fail"}  # fmt: skip
    flags = {s.name: s.idempotent for s in registry}
    assert flags == {"add": True, "tools__bump": False, "tools__slow": True, "tools__echo": True,
                     "tools__plain": False, "tools__fail": False}  # fmt: skip
    bump = registry.get("tools__bump")
    assert bump.parameters["properties"]["n"]["type"] == "integer"
    assert bump.description.startswith("Count one side effect")
    over = load_agent("tests.support.agents:mcp_overridden")
    flags = {s.name: s.idempotent for s in await mcp_registry("o", over.tools, over.mcp)}
    assert flags["tools__plain"] and not flags["tools__slow"]


async def test_a_name_clash_is_a_clear_error() -> None:
    agent = load_agent("tests.support.agents:mcp_clash")
    with pytest.raises(ConfigError, match=r"tools__echo.*given twice"):
        await mcp_registry("tests.support.agents:mcp_clash", agent.tools, agent.mcp)


async def test_a_turn_calls_mcp_tools_with_its_call_key_in_meta(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(real_client, keys)
    work = plan(("tools__bump", {"n": 7}), ("tools__echo", {"text": "hi"}),
                ("tools__fail", {"why": "on purpose"}), ("tools__nosuch", {}),
                ("tools__bump", {"n": "seven"}))  # fmt: skip
    await eng.run_new("tests.support.agents:mcp_counter", work, ["m1"])
    record = await eng.store.load("m1")
    got = results(record)
    assert got[0] == ("ok", "bumped 7") and got[1] == ("ok", "hi")
    assert got[2][0] == "error" and "failed: on purpose" in got[2][1]
    assert got[3][0] == "error" and "unknown tool" in got[3][1]
    assert got[4][0] == "error" and "n" in got[4][1]  # the server refused the arguments
    assert record.counters.outcome == "answered"
    ledger = await real_client.hkeys(keys.tools("m1"))
    (first,) = [k.decode() for k in ledger if k.decode().startswith("0.")]
    assert runs()[first] == 1  # the server ran it once, under the ledger's call key


async def test_mcp_server_time_from_the_registry(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(real_client, keys)
    work = plan(("time__get_current_time", {"timezone": "UTC"}),
                ("time__convert_time", {"source_timezone": "UTC", "time": "12:00",
                                        "target_timezone": "Asia/Tokyo"}))  # fmt: skip
    await eng.run_new("tests.support.agents:mcp_time", work, ["time1"])
    got = results(await eng.store.load("time1"))
    assert got[0][0] == "ok" and '"timezone": "UTC"' in got[0][1]
    assert got[1][0] == "ok" and "Asia/Tokyo" in got[1][1] and "21:00" in got[1][1]


async def test_a_server_that_does_not_start_fails_its_calls_not_the_process(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(real_client, keys)
    await eng.run_new("tests.support.agents:mcp_broken", plan(("gone__x", {})), ["b1"])
    record = await eng.store.load("b1")
    assert results(record) == [("error", "unknown tool 'gone__x'")]  # its tools are left out
    assert record.counters.outcome == "answered"
    # Listed directly, the failure is a clear error that names the server.
    fresh = MCPHub()
    server = load_agent("tests.support.agents:mcp_broken").mcp[0]
    with pytest.raises(Exception, match="MCP server gone did not start"):
        await fresh.list_tools("x", server)


def _pids() -> list[int]:
    return [int(line.split()[2]) for line in log_text().splitlines() if line.startswith("start ")]


async def test_a_killed_server_is_restarted_and_a_call_in_flight_follows_the_ledger_rule(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    agent = "tests.support.agents:mcp_counter"
    eng = engine(real_client, keys)
    await eng.run_new(agent, plan(("tools__echo", {"text": "warm"})), ["k0"])  # session up
    before = next(s.starts for s in hub().states() if s.agent == agent)

    async def kill_when_bumping() -> None:
        started = len(_pids())

        async def in_flight() -> bool:
            return await real_client.exists(keys.tools("k1")) == 1

        await eventually(in_flight, timeout=20, what="the bump call dispatched")
        os.kill(_pids()[started - 1], signal.SIGKILL)

    killer = asyncio.ensure_future(kill_when_bumping())
    await eng.run_new(agent, plan(("tools__bump", {"n": 1}), ("tools__slow", {"ms": 1})), ["k1"])
    await killer
    got = results(await eng.store.load("k1"))
    assert got[0][0] == "outcome_unknown" and "will not be re-run" in got[0][1]
    assert got[1] == ("ok", "slept 1")  # the next call started a new server process
    bump_key = sorted(k.decode() for k in await real_client.hkeys(keys.tools("k1")))[0]
    assert runs()[bump_key] <= 1  # never run twice
    after = next(s.starts for s in hub().states() if s.agent == agent)
    assert after == before + 1


@pytest.mark.usefixtures("mcp_http_server")
async def test_a_streamable_http_server_with_a_secret_header(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(real_client, keys)
    work = plan(("remote__bump", {"n": 2}), ("remote__echo", {"text": "over http"}))
    await eng.run_new("tests.support.agents:mcp_http", work, ["h1"])
    record = await eng.store.load("h1")
    assert results(record) == [("ok", "bumped 2"), ("ok", "over http")]
    assert f"auth Bearer_{MCP_HTTP_SECRET}" in log_text()
    async for key in real_client.scan_iter(f"{keys.namespace}:*"):  # the key is never stored
        dump = await real_client.dump(key)
        assert dump is not None and MCP_HTTP_SECRET.encode() not in dump, key
