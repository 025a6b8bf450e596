"""The harness verbs: ``demo`` (a host killed under concurrent turns, a verdict), ``chaos``
(kill things, judge the turns) and ``bench``."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click
import ray
from rich.table import Table
from rich.text import Text

from actors.cli.app import (
    BadInput,
    ExitStatus,
    _common,
    _redis_cluster_option,
    _scratch_redis,
    _scratch_store,
    _settings,
    console,
    count,
    main,
    out,
)
from actors.cli.runs import (
    _Bar,
    _nodes_option,
    _ray_nodes,
    _report_option,
    _run_on_ray,
    _verdict_option,
    _work,
    _work_options,
    verdict_for,
)
from actors.cluster.joining import ensure_ray
from actors.cluster.local_nodes import LocalNodes
from actors.cluster.runtime import Runtime
from actors.engine.run_stats import new_run_id, turn_ids
from actors.engine.settings.config import Settings
from actors.harness.bench.runner import FIGURES, FULL, QUICK, parse_figures, run_bench
from actors.harness.chaos import run_chaos
from actors.harness.chaos_report import ChaosReport
from actors.harness.chaos_report import plot as plot_chaos
from actors.harness.chaos_runtime import chaos_runtime
from actors.harness.chaos_settings import ChaosSettings
from actors.harness.demo import DemoReport, run_demo
from actors.harness.links import Links, outside_links
from actors.harness.targets import LOCAL_ONLY, TARGETS, ChaosTarget, parse_targets
from store.redis.embedded import EmbeddedRedis
from store.redis.embedded_cluster import EmbeddedCluster

log = logging.getLogger(__name__)


@main.command()
@_common
@_work_options
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=100, show_default=True)
@click.option(
    "--duration",
    type=click.FloatRange(1, 86_400),
    default=30,
    show_default=True,
    help="Seconds of fault injection (turns arrive during the first half).",
)
@click.option(
    "--kill-interval",
    type=click.FloatRange(0.1, 3600),
    default=2,
    show_default=True,
    help="Mean seconds between faults.",
)
@click.option(
    "--targets",
    default="all",
    show_default=True,
    help=f"Comma-separated fault targets: {', '.join(TARGETS)} ('none': only the "
    "poison turns' own faults).",
)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--poison",
    type=click.IntRange(0, 1_000_000),
    default=0,
    show_default=True,
    help="Turns that run a poison variant of the scenario (a model call that "
    "SIGKILLs its process); each must end suspended:poison.",
)
@click.option("--hosts", type=click.IntRange(1, 1024), default=2, show_default=True)
@_nodes_option
@_redis_cluster_option
@click.option("--ray-address", default=None, help="Join this Ray cluster.")
@_verdict_option
@click.option(
    "--report", type=click.Path(dir_okay=False), required=True, help="Write the JSON report here."
)
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="Write the PNG timeline here."
)
def chaos(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    scenario_path: str | None,
    agent_path: str | None,
    input_text: str | None,
    turns: int,
    duration: float,
    kill_interval: float,
    targets: str,
    seed: int,
    poison: int,
    hosts: int,
    nodes: int,
    redis_cluster: bool,
    ray_address: str | None,
    verdict_mode: str | None,
    report: str,
    plot: str | None,
) -> None:
    """Kill runtime processes at random under load, running a scenario or an agent on one
    input; exit 1 unless the evidence is clean."""
    settings = _settings(config_path, redis_url, namespace or f"chaos{seed}x{new_run_id()}")
    work = _work(scenario_path, agent_path, input_text)
    chosen = parse_targets(
        targets,
        embedded=settings.redis.url is None and not redis_cluster,
        nodes=nodes > 1 and ray_address is None,
        cluster=redis_cluster,
        local=ray_address is None,
        http=work.scenario is None,
    )
    if poison > turns:
        raise BadInput(f"--poison {poison} is more than --turns {turns}")
    cfg = ChaosSettings(
        work,
        turns,
        duration,
        kill_interval,
        chosen,
        seed,
        poison,
        verdict_for(verdict_mode, work),
    )
    bar = _Bar(turns, f"chaos seed {seed}", force=True)

    async def go(
        server: EmbeddedRedis | None,
        cluster: EmbeddedCluster | None,
        settings: Settings,
        local: LocalNodes | None,
    ) -> ChaosReport:
        assert settings.redis.url is not None
        with outside_links(
            chosen,
            redis_url=settings.redis.url,
            slots=hosts + 1,
            http=work.scenario is None,
            seed=seed,
        ) as links:
            async with chaos_runtime(
                settings,
                redis_url=settings.redis.url,
                hosts=hosts,
                targets=chosen,
                ray_address=local.address if local else ray_address,
                host_routes=links.routes(hosts + 1) if links else (),
                model_route=links.model_route() if links else None,
            ) as rt:
                with bar.progress:
                    result = await run_chaos(
                        rt,
                        server,
                        cfg,
                        nodes=local,
                        cluster=cluster,
                        links=links,
                        on_submitted=lambda n: None,
                        on_done=bar.advance,
                    )
            if ChaosTarget.BAD_INPUT in chosen:
                result.verdict.bad_input_accepted += await asyncio.to_thread(
                    console_probes, settings, settings.redis.url, result.turn_ids[0]
                )
            return result

    with (
        _scratch_store(settings, "chaos", redis_cluster=redis_cluster) as (server, rc, store),
        _ray_nodes(nodes, ray_address) as (_address, local),
    ):
        result = asyncio.run(go(server, rc, store, local))
    data = result.as_dict()
    Path(report).write_text(json.dumps(data, indent=2) + "\n")
    if plot:
        plot_chaos(result, plot)
    out.print(_chaos_table(result, cfg))
    if not data["ok"]:
        # The report holds the evidence; print it too, so a failed CI log says which turn.
        for kind, examples in data["verdict"]["examples"].items():
            for example in examples:
                out.print(Text.assemble((kind, "red"), " ", example), highlight=False)
        sys.exit(ExitStatus.ERROR)


def console_probes(settings: Settings, url: str, turn_id: str) -> list[str]:
    """What consoles on the run's Redis let through of an attacker's requests (none is
    right): one on loopback without a token, one with a token (``actors.console.probes``).
    Without the console extra there is no console to attack: nothing is let through."""
    try:
        from actors.console import ConsoleSettings, console_app
        from actors.console.access import new_token
        from actors.console.probes import probe_loopback, probe_token, served
    except ImportError as exc:
        log.info("console not probed: %s is not installed (the console extra)", exc.name)
        return []
    found = []
    with served(console_app(settings, ConsoleSettings(redis_url=url))) as base:
        found += probe_loopback(base, turn_id)
    with served(console_app(settings, ConsoleSettings(redis_url=url, token=new_token()))) as base:
        found += probe_token(base)
    return [f"console: {f}" for f in found]


@main.command()
@_common
@click.option("--quick", is_flag=True, help="The small sizes (a few minutes; what CI runs).")
@click.option(
    "--figures",
    default="all",
    show_default=True,
    help=f"Comma-separated subset of: {', '.join(FIGURES)}.",
)
@click.option("--ray-address", default=None, help="Join this Ray cluster.")
@click.option(
    "--report", type=click.Path(dir_okay=False), required=True, help="Write the JSON report here."
)
def bench(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    quick: bool,
    figures: str,
    ray_address: str | None,
    report: str,
) -> None:
    """Measure what durability costs, each figure beside a baseline from the same run."""
    settings = _settings(config_path, redis_url, namespace)
    chosen = parse_figures(figures)
    cfg = QUICK if quick else FULL

    def show(name: str, data: Any) -> None:
        console.print(f"[bold]{name}[/]: {json.dumps(data)[:400]}")

    with _scratch_redis(settings, "bench") as (_server, url):
        owns_ray = ensure_ray(ray_address)
        try:
            console.print(f"[dim]bench ({'quick' if quick else 'full'}): {', '.join(chosen)}")
            data = asyncio.run(run_bench(settings, url, cfg, figures=chosen, on_figure=show))
        finally:
            if owns_ray:
                ray.shutdown()
    data["command"] = "phaseline " + " ".join(sys.argv[1:])
    data["quick"] = quick
    Path(report).write_text(json.dumps(data, indent=2) + "\n")
    table = Table(title=f"phaseline bench ({'quick' if quick else 'full'})")
    for col in ("target", "value", "wanted", "met"):
        table.add_column(col)
    for t in data["targets"]:
        met = "[green]yes" if t["met"] else "[red]no"
        table.add_row(t["name"], str(t["value"]), t["target"], met)
    out.print(table)


def _chaos_table(result: ChaosReport, cfg: ChaosSettings) -> Table:
    """The summary of a chaos run, a row per figure of its report."""
    data = result.as_dict()
    v = data["verdict"]
    table = Table(
        title=f"chaos seed {cfg.seed}: {count(cfg.turns, 'turn')}, "
        f"{count(len(result.faults), 'fault')}",
        show_header=False,
    )
    for k in (
        "lost",
        "transcripts_differ",
        "meta_drift",
        "in_progress_left",
        "duplicate_side_effects",
        "orphaned_side_effects",
        "stale_writes_accepted",
        "bad_input_accepted",
        "suspended_unexpectedly",
        "aborted",
        "outcome_unknown_results",
        "resumed_turns",
        "most_resumes_of_one_turn",
        "model_calls",
        "replies_adopted",
        "generations_adopted",
        "generations_repaid",
        "calls_repaid",
    ):
        table.add_row(k, str(v[k]))
    if cfg.poison:
        table.add_row(
            "poison turns suspended",
            f"{v['poison_suspended']} of {v['poison_turns']}, "
            f"{v['poison_host_deaths']} host deaths under them",
        )
    table.add_row("kills", json.dumps(data["kills_per_target"]))
    table.add_row("replacements per host", json.dumps(data["replacements_per_host"]))
    table.add_row("fenced writes refused", json.dumps(data["fenced_writes"]))
    table.add_row(
        "recovery ms p50/p99/max", "{p50}/{p99}/{max}".format(**data["recovery_latency_ms"])
    )
    for kind, lat in data["recovery_latency_ms_by_kind"].items():
        table.add_row(f"  after {kind} (n={lat['n']})", "{p50}/{p99}/{max}".format(**lat))
    for kind, lat in data["recovery_last_turn_ms_by_kind"].items():
        table.add_row(
            f"  {kind} → its last turn moving, ms (n={lat['n']})",
            "{p50}/{p99}/{max}".format(**lat),
        )
    table.add_row("turns/s", str(data["turns_per_s"]))
    table.add_row(f"verdict ({cfg.verdict.value})", "[green]ok" if data["ok"] else "[red]NOT OK")
    return table


@main.command()
@_common
@_work_options
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=200, show_default=True)
@click.option("--hosts", type=click.IntRange(2, 1024), default=2, show_default=True)
@_nodes_option
@click.option(
    "--kill-at",
    type=click.FloatRange(0.0, 0.95),
    default=0.3,
    show_default=True,
    help="SIGKILL host 0 once this fraction of the turns has durable progress (a "
    "checkpoint past submission), while they run (0: as soon as they are "
    "submitted).",
)
@click.option("--ray-address", default=None, help="Join this Ray cluster.")
@click.option(
    "--faults",
    default=None,
    metavar="provider,partition",
    help="Bring the world outside too while the turns run, a fault every "
    "~3 s: provider (storms at the model endpoint; an --agent whose model reads "
    "OPENAI_BASE_URL), partition (one host cut from Redis or the model for a few "
    "seconds).",
)
@_verdict_option
@_report_option
def demo(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    scenario_path: str | None,
    agent_path: str | None,
    input_text: str | None,
    turns: int,
    hosts: int,
    nodes: int,
    kill_at: float,
    ray_address: str | None,
    faults: str | None,
    verdict_mode: str | None,
    report: str | None,
) -> None:
    """Concurrent turns on Ray, one host SIGKILLed mid-run, then a verdict read from Redis:
    of a scenario (default demo: random replies, a non-idempotent tool), or of an agent on one
    input. The exact verdict compares
    each transcript with a fault-free run in this process (the endpoint must answer each
    conversation deterministically: a local model at temperature 0 does); --verdict promises
    checks the runtime's promises for any model."""
    rid = f"demo{new_run_id()}"
    settings = _settings(config_path, redis_url, namespace or rid)
    if scenario_path is None and agent_path is None:
        scenario_path = "demo"
    work = _work(scenario_path, agent_path, input_text)
    ids = turn_ids(rid, turns)
    bar = _Bar(turns, f"demo {rid}", force=True)
    outside: tuple[ChaosTarget, ...] = ()
    if faults is not None:
        outside = parse_targets(
            faults, embedded=False, local=ray_address is None, http=work.scenario is None
        )
        if not outside or any(t not in LOCAL_ONLY for t in outside):
            raise BadInput(f"--faults takes {', '.join(LOCAL_ONLY)}; got {faults!r}")

    mode = verdict_for(verdict_mode, work)

    def killed(pid: int) -> None:
        console.print(
            f"[yellow]SIGKILLed host 0 (pid {pid}) on purpose: the demo's kill. Ray reports "
            "the worker's death next (it may guess the OOM killer); its turns resume elsewhere."
        )

    async def go(rt: Runtime, links: Links | None) -> DemoReport:
        with bar.progress:
            return await run_demo(
                rt,
                work,
                ids,
                kill_at=kill_at,
                on_done=bar.advance,
                mode=mode,
                on_kill=killed,
                faults=outside,
                links=links,
            )

    with _ray_nodes(nodes, ray_address) as (address, _local):
        result = _run_on_ray(
            settings, hosts, address, go, faults=outside, http=work.scenario is None
        )
    data = result.as_dict()
    title = f"demo {rid}: {count(turns, 'turn')} of {work.label} on {count(hosts, 'host')}"
    table = Table(title=title, show_header=False)
    for k in (
        "completed",
        "correct",
        "resumed",
        "checkpoints",
        "model_calls",
        "generations_adopted",
        "generations_repaid",
        "calls_repaid",
        "duplicate_side_effects",
        "orphaned_side_effects",
        "kills",
        "faults",
        "respawns",
        "wall_s",
        "turns_per_s",
    ):
        value = data[k]
        table.add_row(k, json.dumps(value) if isinstance(value, list) else str(value))
    table.add_row(f"verdict ({mode.value})", "[green]ok" if result.ok else "[red]NOT OK")
    out.print(table)
    for kind, examples in result.verdict.as_dict()["examples"].items():  # type: ignore[attr-defined]
        for line in examples:
            console.print(f"[red]{kind}: {line}")
    if report:
        Path(report).write_text(json.dumps(data, indent=2) + "\n")
    if not result.ok:
        sys.exit(ExitStatus.ERROR)
