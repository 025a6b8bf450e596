"""``phaseline status`` on one screen: a deployment's hosts, turns per phase, tool worker pools,
MCP servers and checkpoint rate, drawn with rich."""

from __future__ import annotations

import json

from rich.console import Group
from rich.table import Table

from actors.cluster.status import DeploymentStatus


def render(status: DeploymentStatus) -> Group:
    """The tables of one status sample."""
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]namespace[/] {status.namespace}",
        f"[bold]in progress[/] {status.in_progress}",
        f"[bold]checkpoints/s[/] {status.checkpoints_per_s:g}",
        f"[bold]hosts replaced[/] {status.respawns}",
    )
    hosts = Table(title="hosts", title_justify="left")
    for col in ("host", "generation", "turns held", "finished", "RSS MiB"):
        hosts.add_column(col, justify="left" if col == "host" else "right")
    for h in status.hosts:
        hosts.add_row(h.label, str(h.generation), str(h.running), str(h.finished), f"{h.rss_mib:g}")
    phases = Table(title="running turns by phase", title_justify="left")
    phases.add_column("phase")
    phases.add_column("turns", justify="right")
    for phase, n in status.phases.items():
        phases.add_row(phase, str(n))
    if not status.phases:
        phases.add_row("[dim](none running)", "0")
    pools = Table(title="tool worker pools", title_justify="left")
    for col in ("pool", "resources", "workers", "queued", "running", "calls/s"):
        pools.add_column(col, justify="left" if col in ("pool", "resources") else "right")
    for p in status.pools:
        pools.add_row(
            p.pool,
            json.dumps(p.resources) if p.resources else "-",
            str(p.size),
            str(p.queued),
            str(p.running),
            f"{p.calls_per_s:g}",
        )
    parts: list[Table] = [head, hosts, phases, pools]
    if status.mcp:
        mcp = Table(title="MCP servers", title_justify="left")
        for col in ("pool", "server", "workers connected", "sessions started"):
            mcp.add_column(col)
        for m in status.mcp:
            mcp.add_row(m.pool, m.server, str(m.connected), str(m.starts))
        parts.append(mcp)
    if status.models:
        models = Table(title="model endpoints", title_justify="left")
        for col in ("model", "waiting on its rate limit", "in flight", "paused s"):
            models.add_column(col, justify="left" if col == "model" else "right")
        for e in status.models:
            models.add_row(e.label, str(e.waiting), str(e.in_flight), f"{e.paused_s:g}")
        parts.append(models)
    if status.agents:
        agents = Table(title="agents (finished turns)", title_justify="left")
        for col in (
            "agent",
            "turns",
            "prompt tokens",
            "completion tokens",
            "cached",
            "calls not metered",
        ):
            agents.add_column(col, justify="left" if col == "agent" else "right")
        for a in status.agents:
            agents.add_row(
                a.agent,
                f"{a.turns:,}",
                f"{a.prompt_tokens:,}",
                f"{a.completion_tokens:,}",
                f"{a.cached_tokens:,}",
                f"{a.unknown:,}",
            )
        parts.append(agents)
    return Group(*parts)
