"""Running turns from the command line: ``run`` and ``resume``, with the progress bar,
summaries and Ray options they share with the harness verbs."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import click
import ray
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.cli.app import (
    BadInput,
    ExitStatus,
    F,
    T,
    _common,
    _exit_on_signals,
    _run,
    _run_with_url,
    _settings,
    console,
    count,
    main,
    out,
)
from actors.cluster.local_nodes import LocalNodes
from actors.cluster.runtime import Runtime
from actors.engine.agents import check_agent, refuse_unrunnable
from actors.engine.front_desk import FrontDesk
from actors.engine.models.scenario import load_scenario
from actors.engine.run_stats import RunStats, new_run_id, turn_ids
from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineHooks
from actors.engine.turn_engine import TurnEngine
from actors.harness.links import Links, outside_links
from actors.harness.targets import ChaosTarget
from actors.harness.verdict import VerdictMode
from actors.harness.work import Work
from bus.errors import RecordNotFound
from bus.outcomes import Outcome
from bus.phase import Transition, TurnPhase
from store.domain.ownership import NamespaceOwner, holding
from store.keys import check_turn_id
from store.records import CheckpointRecord
from store.redis.connection import StoreClient


class _Bar:
    """A live progress bar counting finished turns (quiet when not on a terminal)."""

    def __init__(self, total: int, label: str, *, force: bool = False) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not (force or console.is_terminal),
        )
        self.task = self.progress.add_task(label, total=total)

    def advance(self, _turn_id: str = "") -> None:
        self.progress.advance(self.task)

    def on_transition(self, t: Transition) -> None:
        if t.dst is TurnPhase.DONE:
            self.advance()


def _summary(title: str, stats: RunStats, report: str | None, turn_ids: Sequence[str] = ()) -> None:
    """The run's table; ``--report`` gets the same as JSON, with the ids of its turns."""
    data = stats.as_dict()
    table = Table(title=title, show_header=False)
    for k, v in data.items():
        if k == "errors":
            continue  # printed below, one line each
        table.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    out.print(table)
    for line, n in stats.errors.most_common(10):
        console.print(f"[red]{n} aborted with: {escape(line)}")
    if report:
        Path(report).write_text(json.dumps({**data, "turn_ids": list(turn_ids)}, indent=2) + "\n")


def _few(ids: list[str]) -> str:
    return ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")


def _exit_unless_final(stats: RunStats) -> None:
    """Exit :attr:`ExitStatus.UNFINISHED`, with the counts, unless every turn is final; then
    :attr:`ExitStatus.ABORTED` if any ended ``aborted:*``."""
    if stats.all_final:
        if stats.aborted:
            console.print(
                f"[red]{stats.aborted} of {count(stats.turns, 'turn')} aborted "
                "(phaseline inspect TURN says why)"
            )
            sys.exit(ExitStatus.ABORTED)
        return
    if stats.quarantined:
        console.print(
            f"[red]quarantined ({len(stats.quarantined)}): {', '.join(stats.quarantined)}"
        )
    if stats.suspended:
        how = ", ".join(
            f"{n} {o.value}"
            for o, n in stats.outcomes.items()
            if isinstance(o, Outcome) and o.suspended
        )
        console.print(
            f"[red]suspended ({how}): {_few(stats.suspended)} "
            "(phaseline inspect TURN says why; phaseline resume TURN runs it again)"
        )
    if stats.unfinished:
        shown = _few(stats.unfinished)
        console.print(
            f"[red]{len(stats.unfinished)} of {count(stats.turns, 'turn')} not finished "
            f"(still in progress: phaseline resume continues them): {shown}"
        )
    sys.exit(ExitStatus.UNFINISHED)


def _ray_options(fn: F) -> F:
    fn = click.option(
        "--ray-address", default=None, help="Join this Ray cluster ('auto': the running one)."
    )(fn)
    fn = click.option(
        "--hosts",
        type=click.IntRange(1, 1024),
        default=2,
        show_default=True,
        help="Number of TurnActor actors.",
    )(fn)
    fn = click.option(
        "--in-process", is_flag=True, help="Run the turns in this process, without Ray."
    )(fn)
    return fn


def _report_option(fn: F) -> F:
    return click.option(
        "--report",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write the summary as JSON here.",
    )(fn)


_verdict_option = click.option(
    "--verdict",
    "verdict_mode",
    type=click.Choice([m.value for m in VerdictMode]),
    default=None,
    help="exact: every transcript equals a fault-free run's (modulo tool-call ids), for a "
    "deterministic model; promises: what the runtime promises (every turn final, none "
    "lost or aborted, no side effect twice or untold, no meta drift), for any model. "
    "Default: promises for a scenario of random replies, else exact.",
)


def verdict_for(verdict_mode: str | None, work: Work) -> VerdictMode:
    """The ``--verdict`` asked for, else the one the work allows: ``exact`` for a model that
    answers the same way every time, ``promises`` for random replies."""
    if verdict_mode:
        return VerdictMode(verdict_mode)
    return VerdictMode.EXACT if work.deterministic else VerdictMode.PROMISES


_nodes_option = click.option(
    "--nodes",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Start a local Ray cluster of this many nodes (raylets) and run on it.",
)


@contextmanager
def _ray_nodes(
    nodes: int, ray_address: str | None
) -> Iterator[tuple[str | None, LocalNodes | None]]:
    """The Ray address to run on, and the local multi-node cluster started for ``--nodes``
    (stopped on the way out); with one node, Ray starts as usual (or ``--ray-address``)."""
    if nodes <= 1:
        yield ray_address, None
        return
    if ray_address is not None:
        raise BadInput("--nodes starts a local cluster; it cannot be used with --ray-address")
    console.print(f"[dim]starting a local Ray cluster of {nodes} nodes ...")
    with LocalNodes(nodes) as local:
        try:
            yield local.address, local
        finally:
            ray.shutdown()  # the driver leaves before the raylets stop


def _run_on_ray(
    settings: Settings,
    hosts: int,
    ray_address: str | None,
    work: Callable[[Runtime, Links | None], Awaitable[T]],
    *,
    faults: Sequence[ChaosTarget] = (),
    http: bool = False,
) -> T:
    """Start (or join) the Ray runtime on the configured Redis, run ``work``, shut it down.
    ``faults`` (``provider``, ``partition``): the hosts reach Redis and the model through the
    links those faults cut (``actors.harness.links``; ``http``: the model is an endpoint), and
    ``work`` gets them."""

    async def go(_client: StoreClient, url: str) -> T:
        console.print(f"[dim]starting Ray runtime: {hosts} hosts ...")
        with outside_links(faults, redis_url=url, slots=hosts + 1, http=http, seed=1) as links:
            rt = await Runtime.start(
                settings,
                redis_url=url,
                hosts=hosts,
                ray_address=ray_address,
                host_routes=links.routes(hosts + 1) if links else (),
                model_route=links.model_route() if links else None,
            )
            _exit_on_signals()  # again: Ray's core worker replaced the SIGTERM handler
            try:
                return await work(rt, links)
            finally:
                await rt.shutdown()

    return _run_with_url(go, settings)


def _either(
    in_process: bool,
    in_proc: Callable[[StoreClient], Awaitable[T]],
    on_ray: Callable[[Runtime], Awaitable[T]],
    settings: Settings,
    hosts: int,
    ray_address: str | None,
) -> T:
    if in_process:
        return _run(lambda client: _in_process(client, settings, in_proc), settings)
    return _run_on_ray(settings, hosts, ray_address, lambda rt, _links: on_ray(rt))


async def _in_process(
    client: StoreClient, settings: Settings, work: Callable[[StoreClient], Awaitable[T]]
) -> T:
    """Run ``work`` holding the namespace (``store.domain.ownership``): no deployment may run it
    meanwhile, nor another command running turns in process."""
    keys = settings.redis.key_layout()
    owners = NamespaceOwner(client, keys, ttl_s=settings.supervisor.owner_ttl_s)
    async with holding(owners, " ".join(["phaseline", *sys.argv[1:2]])):
        return await work(client)


def _stats_of(finals: dict[str, CheckpointRecord], wall_s: float) -> RunStats:
    stats = RunStats(wall_s=wall_s)
    for record in finals.values():
        stats.turns += 1
        if record.counters.outcome is not None:  # a final record always has one
            stats.outcomes[record.counters.outcome] += 1
        if record.counters.outcome is not None and record.counters.outcome.suspended:
            stats.suspended.append(record.turn_id)
        stats.resumed += record.counters.resume_attempts > 0
        stats.checkpoints += record.seq
        if record.counters.outcome is not None:
            stats.note_error(record.counters.outcome, record.counters.last_error)
    return stats


def _work(scenario_path: str | None, agent_path: str | None, input_text: str | None) -> Work:
    """What each turn runs: a scripted scenario, or an agent on one message."""
    if (scenario_path is None) == (agent_path is None):
        raise BadInput("give either --scenario (the scripted agent) or --agent")
    if agent_path is None:
        assert scenario_path is not None
        if input_text is not None:
            raise BadInput("--input goes with --agent; a scenario carries its own prompt")
        work = Work.scripted(load_scenario(scenario_path))
        check_agent(work.agent, work.turn_input)
        return work
    if not input_text:
        raise BadInput("--agent needs --input, the user message of each turn")
    return Work.of_agent(agent_path, input_text)


def _work_options(fn: F) -> F:
    """``--scenario`` / ``--agent`` + ``--input``: what :func:`_work` reads."""
    fn = click.option(
        "--input", "input_text", default=None, help="With --agent: the user message of each turn."
    )(fn)
    fn = click.option(
        "--agent",
        "agent_path",
        default=None,
        help="Import path of an agent (pkg.module:name), instead of --scenario.",
    )(fn)
    return click.option(
        "--scenario",
        "scenario_path",
        default=None,
        type=click.Path(dir_okay=False),
        help="Scenario file, or the name of a shipped one (e.g. tool_loop), run by the "
        "scripted agent.",
    )(fn)


@main.command()
@_common
@_work_options
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=1, show_default=True)
@click.option("--run-id", default=None, help="Prefix of the turn ids (default: random).")
@_ray_options
@_report_option
def run(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    scenario_path: str | None,
    agent_path: str | None,
    input_text: str | None,
    turns: int,
    run_id: str | None,
    in_process: bool,
    hosts: int,
    ray_address: str | None,
    report: str | None,
) -> None:
    """Run TURNS turns concurrently (on Ray unless --in-process): of a scenario, or of an
    agent on one input."""
    settings = _settings(config_path, redis_url, namespace)
    work = _work(scenario_path, agent_path, input_text)
    agent, turn_input = work.agent, work.turn_input
    rid = check_turn_id(run_id) if run_id else new_run_id()
    ids = turn_ids(rid, turns)
    bar = _Bar(turns, f"run {rid}")
    named = ids[0] if turns == 1 else f"{ids[0]} … {ids[-1]}"

    def say_ids() -> None:  # once the namespace is this run's: a refused run names no turn
        console.print(f"[dim]turns {named} (phaseline inspect / watch TURN_ID)")

    async def in_proc(client: StoreClient) -> RunStats:
        refuse_unrunnable(agent, turn_input)
        say_ids()
        engine = TurnEngine.from_settings(
            client, settings, EngineHooks(on_transition=bar.on_transition)
        )
        try:
            with bar.progress:
                return await engine.run_new(agent, turn_input, ids)
        finally:
            await engine.aclose()

    async def on_ray(rt: Runtime) -> RunStats:
        say_ids()
        started = time.monotonic()
        unusable: list[str] = []
        with bar.progress:
            await rt.submit(agent, turn_input, ids)
            finals = await rt.wait(
                ids,
                timeout=24 * 3600,
                on_done=bar.advance,
                on_unusable=lambda tid, _exc: unusable.append(tid),
            )
        stats = _stats_of(finals, time.monotonic() - started)
        stats.quarantined.extend(unusable)
        stats.host_rss_mib = [round(h.rss_bytes / 2**20, 1) for h in await rt.host_info()]
        return stats

    stats = _either(in_process, in_proc, on_ray, settings, hosts, ray_address)
    _summary(f"run {rid}: {work.label}", stats, report, ids)
    _exit_unless_final(stats)


async def _reopened(desk: FrontDesk, named: tuple[str, ...]) -> list[str]:
    """The named turns that are (now, a suspended one reopened) in progress; the others are
    reported as they are. A deployment's desk has its hosts adopt them now."""
    ids = []
    for tid in dict.fromkeys(named):
        try:
            (record,) = await desk.reopen([tid])
        except RecordNotFound:
            raise BadInput(f"no turn {tid} in namespace {desk.keys.namespace!r}") from None
        if record.in_progress:
            ids.append(tid)
        else:
            console.print(f"turn {tid} is final already ({record.counters.outcome})")
    return ids


@main.command()
@_common
@click.argument("named", metavar="[TURN_ID]...", nargs=-1)
@_ray_options
@_report_option
def resume(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    named: tuple[str, ...],
    in_process: bool,
    hosts: int,
    ray_address: str | None,
    report: str | None,
) -> None:
    """Resume every in-progress turn in the store, or just the TURN_IDs (a suspended one too:
    after a fix, it runs again), and run them to the end."""
    settings = _settings(config_path, redis_url, namespace)
    for tid in named:
        check_turn_id(tid)

    async def in_proc(client: StoreClient) -> RunStats:
        desk = FrontDesk(client, settings)
        store = desk.store
        ids = await _reopened(desk, named) if named else None
        bar = _Bar(len(ids if ids is not None else await store.list_in_progress()), "resume")
        engine = TurnEngine.from_settings(
            client, settings, EngineHooks(on_transition=bar.on_transition)
        )
        try:
            with bar.progress:
                if ids is None:
                    return await engine.resume_all()
                return await engine.resume_turns(ids, after_death=True)
        finally:
            await engine.aclose()

    async def on_ray(rt: Runtime) -> RunStats:
        # The supervisor has every host adopt its slot's in-progress turns as it starts.
        started = time.monotonic()
        errors: list[str] = []
        if named:
            ids = await _reopened(rt, named)
        else:
            scan = await rt.store.load_in_progress()
            ids = [r.turn_id for r in scan.records]
            errors = [e.key for e in scan.errors]
        bar = _Bar(len(ids), "resume")
        with bar.progress:
            finals = await rt.wait(
                ids,
                timeout=24 * 3600,
                on_done=bar.advance,
                on_unusable=lambda tid, _exc: errors.append(tid),
            )
        stats = _stats_of(finals, time.monotonic() - started)
        stats.quarantined.extend(errors)
        return stats

    stats = _either(in_process, in_proc, on_ray, settings, hosts, ray_address)
    _summary("resume", stats, report)
    _exit_unless_final(stats)
