"""MCP tools on the Ray runtime: the sessions live in the ToolWorkers; ToolWorkers and MCP
server processes are SIGKILLed under load; every turn completes and no non-idempotent call
runs twice."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from actors.cluster.runtime import Runtime
from actors.engine.settings.config import Settings
from store.records import TurnInput
from tests.support.agents import MCP_LOG
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")

AGENT = "tests.support.agents:mcp_counter"


def log_lines() -> list[list[str]]:
    path = Path(MCP_LOG)
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


async def test_mcp_turns_survive_killed_tool_workers_and_servers(
    redis_url: str, namespace: str, real_client: aioredis.Redis
) -> None:
    calls = [["tools__bump", {"n": i}] for i in range(3)] + [["tools__slow", {"ms": 200}]]
    work = TurnInput(message="go", context={"calls": calls})
    settings = Settings.model_validate({
        "redis": {"namespace": namespace},
        "checkpoint": {"min_interval_s": 0},
    })  # fmt: skip
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=2)
    servers_before = {int(p[2]) for p in log_lines() if p[0] == "start"}
    try:
        ids = [f"mcp{i:02d}" for i in range(16)]
        assert await rt.submit(AGENT, work, ids) == ids

        async def servers_up() -> set[int] | None:
            started = {int(p[2]) for p in log_lines() if p[0] == "start"} - servers_before
            return started if len(started) >= 2 else None

        first = await eventually(servers_up, timeout=60, what="MCP servers started by workers")
        for pid in first:  # the servers die under their workers' calls
            os.kill(pid, signal.SIGKILL)
        worker = rt.tool_worker("default", 0)
        assert worker is not None
        os.kill((await worker.hello()).pid, signal.SIGKILL)
        finals = await rt.wait(ids, timeout=240)
    finally:
        await rt.shutdown()
    runs: Counter[str] = Counter(p[1] for p in log_lines() if p[0] == "bump")
    unknown = 0
    for tid, final in finals.items():
        assert final.counters.outcome == "answered", tid
        assert final.answer == "read 4 tool results", tid
        got = [m.tool_result for m in final.messages if m.tool_result is not None]
        for res in got:
            if res.status == "outcome_unknown":
                assert res.name == "tools__bump", (tid, res)  # only the non-idempotent tool
                unknown += 1
            else:
                assert res.status == "ok", (tid, res)
        for key in await real_client.hkeys(rt.dep.keys.tools(tid)):
            assert runs[key.decode()] <= 1, (tid, key)  # never twice
    restarted = {int(p[2]) for p in log_lines() if p[0] == "start"} - servers_before - first
    assert restarted  # the dead servers were replaced by new processes
