"""phaseline's metrics reach Prometheus through Ray's metrics export: a scrape of the node's
endpoint finds them after a few turns ran (saves, batches, tool calls, phase entries, turns by
phase)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
import ray

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from tests.support.polling import eventually

pytestmark = pytest.mark.usefixtures("ray_cluster")

#: Names as Prometheus sees them (Ray prefixes ``ray_``), each with the sample that must show.
EXPECTED = {
    "ray_phaseline_saves_total": r'outcome="ok"',
    "ray_phaseline_save_batch_size_count": "",
    "ray_phaseline_save_batch_ms_bucket": "",
    "ray_phaseline_tool_calls_total": r'status="ok"',
    "ray_phaseline_phase_entries_total": r'phase="executing_tools"',
    "ray_phaseline_turns": r'host="host0"',
    "ray_phaseline_agent_turns": r'agent="actors.engine.models.scripted:agent"',
    "ray_phaseline_agent_tokens": r'kind="prompt"',
}


def _scrape_every_node() -> str:
    """Every live node's Prometheus endpoint, concatenated: each raylet's agent serves the
    metrics of the workers on its node, and the actors may be on any node."""
    bodies = []
    for node in ray.nodes():
        if node["Alive"] and node.get("MetricsExportPort"):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as reply:
                bodies.append(reply.read().decode())
    return "\n".join(bodies)


async def test_a_scrape_of_the_nodes_finds_phaselines_metrics(
    redis_url: str, namespace: str
) -> None:
    settings = Settings.model_validate(
        {"redis": {"namespace": namespace}, "checkpoint": {"min_interval_s": 0}}
    )
    sc = parse_scenario({"name": "metrics", "rounds": 2, "tools_per_round": 1, "tools": ["echo"],
                         "llm_latency_ms": 10, "tool_latency_ms": 5})  # fmt: skip
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=1)
    missing: list[str] = list(EXPECTED)

    async def all_there() -> bool:
        body = await asyncio.to_thread(_scrape_every_node)
        missing[:] = [
            name for name, sample in EXPECTED.items()
            if not re.search(rf"^{name}\{{[^\n]*{sample}[^\n]*\}} [0-9.e+]+$", body, re.M)
        ]  # fmt: skip
        return not missing

    try:
        ids = [f"m{i}" for i in range(4)]
        await rt.submit(*scripted_turn(sc), ids)
        await rt.wait(ids, timeout=120)
        # Ray's workers report every 10 s by default: poll the endpoint (while the actors that
        # recorded the metrics live) until they have.
        await eventually(all_there, timeout=90, what=f"every one of {list(EXPECTED)} scraped")
    finally:
        await rt.shutdown()
    assert not missing
