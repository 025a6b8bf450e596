"""``phaseline status`` on a live deployment: hosts, phases, pools with their queue and calls/s,
MCP servers, checkpoints/s; ``--json`` for scripts; no deployment is exit 2."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from click.testing import CliRunner

from actors.cli import main
from actors.cluster.runtime import Runtime
from actors.cluster.status import deployment_status
from actors.engine.settings.config import Settings
from store.records import TurnInput
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")

AGENT = "tests.support.agents:mcp_counter"


def test_status_of_a_running_deployment(redis_url: str, namespace: str) -> None:
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    calls = [["tools__slow", {"ms": 1500}]] * 2
    work = TurnInput(message="go", context={"calls": calls})

    async def start_and_look() -> dict[str, Any]:
        rt = await Runtime.start(settings, redis_url=redis_url, hosts=1, agents=[AGENT])
        ids = [f"st{i}" for i in range(6)]
        await rt.submit(AGENT, work, ids)

        async def under_way() -> dict[str, Any] | None:
            now = (await deployment_status(rt, sample_s=0.5)).as_dict()
            # Each turn makes two 1.5 s calls in a row: a sample in either window sees all six
            # turns' calls on the pool (one taken while the calls were still being sent sees
            # fewer, so poll).
            return now if now["pools"][0]["running"] == 6 else None

        looked = await eventually(under_way, timeout=60, what="all six turns' calls on the pool")
        await rt.wait(ids, timeout=120)
        await rt.detach()
        return looked

    async def stop() -> None:
        await (await Runtime.attach(settings, ray_address=None)).shutdown()

    try:
        seen = asyncio.run(start_and_look())
        result = CliRunner().invoke(
            main, ["status", "--json", "--namespace", namespace, "--redis-url", redis_url]
        )
    finally:
        asyncio.run(stop())
    assert result.exit_code == 0, result.output
    after = json.loads(result.stdout)
    assert [h["label"] for h in after["hosts"]] == ["host0", "isolation"]
    assert after["hosts"][0]["finished"] == 6 and after["in_progress"] == 0
    (pool,) = after["pools"]
    assert pool["pool"] == "default" and pool["size"] == 2 and pool["queued"] == 0
    assert {m["server"] for m in after["mcp"]} == {"tools"}
    assert sum(m["starts"] for m in after["mcp"]) >= 1
    (agent,) = after["agents"]  # the finished turns, counted once by their final saves
    assert agent["agent"] == AGENT and agent["turns"] == 6
    # While the turns ran: they were held, in a phase, and their calls on the pool.
    assert seen["hosts"][0]["running"] == 6
    assert seen["phases"] == {"executing_tools": 6}  # each waits on its 1.5 s call
    assert seen["pools"][0]["running"] == 6 and seen["pools"][0]["queued"] == 0


def test_status_without_a_deployment_exits_2(namespace: str) -> None:
    result = CliRunner().invoke(main, ["status", "--namespace", namespace])
    assert result.exit_code == 2
    assert "no deployment serves namespace" in result.stderr
