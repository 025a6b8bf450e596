"""The ``phaseline`` command line.

Every verb takes ``--redis-url``, ``--namespace`` and ``--config``. Without a Redis URL (flag,
``PHASELINE_REDIS_URL`` or config) an embedded ``redis-server`` is used on the configured data
directory, so ``phaseline inspect`` after ``phaseline run`` sees the same records.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import getpass
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
import ray
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from actors.cluster.local_nodes import LocalNodes
from actors.cluster.runtime import Runtime, ensure_ray
from actors.cluster.status import deployment_status
from actors.engine.agents import check_agent, load_agent
from actors.engine.cancel import queue_behind
from actors.engine.config import Settings, load_settings
from actors.engine.resume import reopen
from actors.engine.scenario import load_scenario
from actors.engine.shipped import scenario_path as shipped_scenario
from actors.engine.submission import new_turns, session_turn
from actors.engine.turn_engine import RunStats, TurnEngine, new_run_id, turn_ids
from actors.harness.bench.runner import FIGURES, FULL, QUICK, parse_figures, run_bench
from actors.harness.chaos import (
    TARGETS,
    WITNESSED,
    ChaosReport,
    ChaosSettings,
    parse_targets,
    run_chaos,
)
from actors.harness.chaos import plot as plot_chaos
from actors.harness.demo import DemoReport, run_demo
from actors.harness.live import LiveView
from actors.harness.status_view import render
from actors.harness.verdict import VerdictMode
from actors.harness.work import Work
from actors.turn.poison import evidence
from bus.errors import (
    ConfigError,
    PhaselineError,
    RecordNotFound,
    SessionBusy,
    TurnExists,
)
from bus.events import WatchEvent
from bus.outcomes import ANSWER_OUTCOMES, Outcome
from bus.phase import Transition, TurnPhase
from store.checkpoint import RedisCheckpointStore
from store.codec import dump_model
from store.connection import StoreClient, redact_url, translated
from store.embedded import EmbeddedRedis, appendfsync_for, attach_or_start
from store.embedded_cluster import EmbeddedCluster
from store.inbox import Inbox
from store.keys import KeyLayout, check_session_id, check_turn_id
from store.ownership import NamespaceOwner, holding
from store.records import CheckpointRecord, QueuedTurn, TurnInput
from store.sessions import IfBusy, Sessions
from store.watch import watch_turn

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
console = Console(stderr=True)
out = Console()


class ExitStatus(enum.IntEnum):
    """What ``phaseline`` exits with; scripts and CI branch on these."""

    OK = 0
    """Done: for ``run`` and ``resume``, every turn reached a final record."""
    ERROR = 1
    """A typed phaseline error (Redis unreachable, a failed verdict)."""
    BAD_INPUT = 2
    """Bad flags, files, configs or scenarios."""
    UNFINISHED = 3
    """``run``/``resume`` ended with turns left in progress, quarantined or suspended (counts
    printed); ``phaseline resume`` continues the in-progress ones, ``phaseline resume TURN``
    a suspended one."""
    ABORTED = 4
    """``run``/``resume``: every turn is final, but some ended ``aborted:*`` (the counts and
    their errors printed; ``phaseline inspect TURN`` shows one)."""


class BadInput(click.ClickException):
    """Bad flags, files or scenarios: exit status 2, like click's own usage errors."""

    exit_code = ExitStatus.BAD_INPUT


def _guard(fn: F) -> F:
    """Turn phaseline's typed errors into one clear line and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            raise BadInput(str(exc)) from exc
        except PhaselineError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc

    return wrapper  # type: ignore[return-value]


def _common(fn: F) -> F:
    fn = click.option(
        "--config", "config_path", type=click.Path(dir_okay=False), default=None,
        help="Settings file (configs/*.toml).",
    )(fn)  # fmt: skip
    fn = click.option("--namespace", default=None, help="Key namespace (default: pl).")(fn)
    fn = click.option(
        "--redis-url-file", type=click.Path(dir_okay=False, exists=True), default=None,
        help="Read the Redis URL from this file (keeps a password out of argv and ps).",
    )(_url_from_file(fn))  # fmt: skip
    fn = click.option(
        "--redis-url", default=None,
        help="Redis to use (else --redis-url-file, else $PHASELINE_REDIS_URL, else the "
             "embedded server). A URL with a password is visible in ps: prefer the file or "
             "the variable.",
    )(fn)  # fmt: skip
    return _guard(fn)


def _url_from_file(fn: F) -> F:
    """Fold ``--redis-url-file`` into ``redis_url``: the command sees one URL."""

    @functools.wraps(fn)
    def wrapper(*args: Any, redis_url_file: str | None = None, **kwargs: Any) -> Any:
        if redis_url_file is not None:
            if kwargs.get("redis_url"):
                raise BadInput("give --redis-url or --redis-url-file, not both")
            url = Path(redis_url_file).read_text(encoding="utf-8").strip()
            if not url:
                raise BadInput(f"{redis_url_file} is empty: it must hold a redis:// URL")
            kwargs["redis_url"] = url
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _settings(config_path: str | None, redis_url: str | None, namespace: str | None) -> Settings:
    return load_settings(config_path).with_overrides(url=redis_url, namespace=namespace)


@contextmanager
def _redis(settings: Settings) -> Iterator[str]:
    """The Redis URL to use; starts (and later stops) the embedded server when needed."""
    if settings.redis.url:
        yield settings.redis.url
        return
    server: EmbeddedRedis | None = None
    where = settings.redis.data_path()
    try:  # a SIGTERM from here on unwinds through the finally (_exit_on_signals)
        url, server = attach_or_start(where, appendfsync=_appendfsync(settings))
        how = "started the embedded server" if server is not None else "using the embedded server"
        console.print(f"[dim]{how} at {redact_url(url)} (data in {where})")
        yield url
    finally:
        if server is not None:
            server.stop()


@contextmanager
def _scratch_store(
    settings: Settings, label: str, *, redis_cluster: bool
) -> Iterator[tuple[EmbeddedRedis | None, EmbeddedCluster | None, Settings]]:
    """What a run stores into: :func:`_scratch_redis`, or with ``redis_cluster`` a throw-away
    local Redis Cluster (3 primaries with a replica each); the settings point at it."""
    if not redis_cluster:
        with _scratch_redis(settings, label) as (server, url):
            yield server, None, settings.with_overrides(url=url)
        return
    if settings.redis.url:
        raise BadInput("--redis-cluster starts a local cluster; drop --redis-url (and [redis] url)")
    console.print("[dim]starting a local Redis Cluster (3 primaries, 1 replica each) ...")
    with (
        tempfile.TemporaryDirectory(prefix=f"phaseline-{label}-cluster-") as tmp,
        EmbeddedCluster(data_dir=tmp, appendfsync=_appendfsync(settings)) as cluster,
    ):
        yield None, cluster, settings.with_overrides(url=cluster.seeds_url, cluster=True)


_redis_cluster_option = click.option(
    "--redis-cluster", is_flag=True, default=False,
    help="Run on a local Redis Cluster of 3 primaries with a replica each, started for the run.",
)  # fmt: skip


def _appendfsync(settings: Settings) -> str:
    """How an embedded server this command starts fsyncs, for the configured durability."""
    return appendfsync_for(settings.redis.durability_policy())


@contextmanager
def _scratch_redis(settings: Settings, label: str) -> Iterator[tuple[EmbeddedRedis | None, str]]:
    """The configured Redis, else a throw-away embedded server (so runs never mix data)."""
    if settings.redis.url:
        yield None, settings.redis.url
        return
    with (
        tempfile.TemporaryDirectory(prefix=f"phaseline-{label}-") as tmp,
        EmbeddedRedis(data_dir=tmp, appendfsync=_appendfsync(settings)) as server,
    ):
        yield server, server.url


def _run(coro_fn: Callable[[StoreClient], Awaitable[T]], settings: Settings) -> T:
    """Run ``coro_fn(client)`` on a fresh event loop against the configured Redis."""
    return _run_with_url(lambda client, _url: coro_fn(client), settings)


def _run_with_url(coro_fn: Callable[[StoreClient, str], Awaitable[T]], settings: Settings) -> T:
    """Run ``coro_fn(client, url)`` on a fresh event loop against the configured Redis."""
    with _redis(settings) as url:
        return asyncio.run(_with_client(coro_fn, url, settings))


async def _with_client(
    coro_fn: Callable[[StoreClient, str], Awaitable[T]], url: str, settings: Settings
) -> T:
    client = settings.redis.connect(url)
    try:
        with translated(f"cannot reach Redis at {redact_url(url)}"):
            await client.ping()
        return await coro_fn(client, url)
    finally:
        await client.aclose()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def main(log_level: str) -> None:
    """phaseline: crash-surviving agent turns with fenced Redis checkpoints."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Agents are named by import path: modules of the directory the command runs in import,
    # as with ``python -m`` (Ray workers get this path from the driver).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _exit_on_signals()


def _exit_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C (SIGINT), so every ``finally`` runs: above all,
    an embedded server this command started is stopped with it instead of orphaned."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return  # called from a thread (a program embedding the CLI): signals are not ours

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


class _Bar:
    """A live progress bar counting finished turns (quiet when not on a terminal)."""

    def __init__(self, total: int, label: str, *, force: bool = False) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=False,
            disable=not (force or console.is_terminal),
        )  # fmt: skip
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
                f"[red]{stats.aborted} of {stats.turns} turns aborted "
                "(phaseline inspect TURN says why)"
            )
            sys.exit(ExitStatus.ABORTED)
        return
    if stats.quarantined:
        console.print(
            f"[red]quarantined ({len(stats.quarantined)}): {', '.join(stats.quarantined)}"
        )
    if stats.suspended:
        console.print(
            f"[red]suspended as poison ({len(stats.suspended)}): {_few(stats.suspended)} "
            "(phaseline inspect TURN says why; phaseline resume TURN runs it again)"
        )
    if stats.unfinished:
        shown = _few(stats.unfinished)
        console.print(
            f"[red]{len(stats.unfinished)} of {stats.turns} turns not finished "
            f"(still in progress: phaseline resume continues them): {shown}"
        )
    sys.exit(ExitStatus.UNFINISHED)


def _ray_options(fn: F) -> F:
    fn = click.option(
        "--ray-address", default=None, help="Join this Ray cluster ('auto': the running one)."
    )(fn)
    fn = click.option(
        "--hosts", type=click.IntRange(1, 1024), default=2, show_default=True,
        help="Number of TurnActor actors.",
    )(fn)  # fmt: skip
    fn = click.option(
        "--in-process", is_flag=True, help="Run the turns in this process, without Ray."
    )(fn)
    return fn


def _report_option(fn: F) -> F:
    return click.option(
        "--report", type=click.Path(dir_okay=False), default=None,
        help="Write the summary as JSON here.",
    )(fn)  # fmt: skip


_verdict_option = click.option(
    "--verdict", "verdict_mode", type=click.Choice([m.value for m in VerdictMode]),
    default=VerdictMode.EXACT.value, show_default=True,
    help="exact: every transcript equals a fault-free run's (modulo tool-call ids), for a "
         "deterministic model; promises: what the runtime promises (every turn final, none "
         "lost or aborted, no side effect twice, no meta drift), for any model.",
)  # fmt: skip

_nodes_option = click.option(
    "--nodes", type=click.IntRange(1, 64), default=1, show_default=True,
    help="Start a local Ray cluster of this many nodes (raylets) and run on it.",
)  # fmt: skip


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
    settings: Settings, hosts: int, ray_address: str | None, work: Callable[[Runtime], Awaitable[T]]
) -> T:
    """Start (or join) the Ray runtime on the configured Redis, run ``work``, shut it down."""

    async def go(_client: StoreClient, url: str) -> T:
        console.print(f"[dim]starting Ray runtime: {hosts} hosts ...")
        rt = await Runtime.start(settings, redis_url=url, hosts=hosts, ray_address=ray_address)
        _exit_on_signals()  # again: Ray's core worker replaced the SIGTERM handler
        try:
            return await work(rt)
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
    return _run_on_ray(settings, hosts, ray_address, on_ray)


async def _in_process(
    client: StoreClient, settings: Settings, work: Callable[[StoreClient], Awaitable[T]]
) -> T:
    """Run ``work`` holding the namespace (``store.ownership``): no deployment may run it
    meanwhile, nor another command running turns in process."""
    keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
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
        work = Work.scripted(load_scenario(shipped_scenario(scenario_path)))
        check_agent(work.agent, work.turn_input)
        return work
    if not input_text:
        raise BadInput("--agent needs --input, the user message of each turn")
    return Work.of_agent(agent_path, input_text)


def _work_options(fn: F) -> F:
    """``--scenario`` / ``--agent`` + ``--input``: what :func:`_work` reads."""
    fn = click.option("--input", "input_text", default=None,
                      help="With --agent: the user message of each turn.")(fn)  # fmt: skip
    fn = click.option(
        "--agent", "agent_path", default=None,
        help="Import path of an agent (pkg.module:name), instead of --scenario.",
    )(fn)  # fmt: skip
    return click.option(
        "--scenario", "scenario_path", default=None, type=click.Path(dir_okay=False),
        help="Scenario file, or the name of a shipped one (e.g. tool_loop), run by the "
             "scripted agent.",
    )(fn)  # fmt: skip


@main.command()
@_common
@_work_options
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=1, show_default=True)
@click.option("--run-id", default=None, help="Prefix of the turn ids (default: random).")
@_ray_options
@_report_option
def run(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    scenario_path: str | None, agent_path: str | None, input_text: str | None, turns: int,
    run_id: str | None, in_process: bool, hosts: int, ray_address: str | None,
    report: str | None,
) -> None:  # fmt: skip
    """Run TURNS turns concurrently (on Ray unless --in-process): of a scenario, or of an
    agent on one input."""
    settings = _settings(config_path, redis_url, namespace)
    work = _work(scenario_path, agent_path, input_text)
    agent, turn_input = work.agent, work.turn_input
    rid = check_turn_id(run_id) if run_id else new_run_id()
    ids = turn_ids(rid, turns)
    bar = _Bar(turns, f"run {rid}")
    named = ids[0] if turns == 1 else f"{ids[0]} … {ids[-1]}"
    console.print(f"[dim]turns {named} (phaseline inspect / watch TURN_ID)")

    async def in_proc(client: StoreClient) -> RunStats:
        engine = TurnEngine.from_settings(client, settings, on_transition=bar.on_transition)
        with bar.progress:
            return await engine.run_new(agent, turn_input, ids)

    async def on_ray(rt: Runtime) -> RunStats:
        started = time.monotonic()
        unusable: list[str] = []
        with bar.progress:
            await rt.submit(agent, turn_input, ids)
            finals = await rt.wait(
                ids, timeout=24 * 3600, on_done=bar.advance,
                on_unusable=lambda tid, _exc: unusable.append(tid),
            )  # fmt: skip
        stats = _stats_of(finals, time.monotonic() - started)
        stats.quarantined.extend(unusable)
        stats.host_rss_mib = [round(h.rss_bytes / 2**20, 1) for h in await rt.host_info()]
        return stats

    stats = _either(in_process, in_proc, on_ray, settings, hosts, ray_address)
    _summary(f"run {rid}: {work.label}", stats, report, ids)
    _exit_unless_final(stats)


@main.command()
@_common
@click.argument("named", metavar="[TURN_ID]...", nargs=-1)
@_ray_options
@_report_option
def resume(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    named: tuple[str, ...], in_process: bool, hosts: int, ray_address: str | None,
    report: str | None,
) -> None:  # fmt: skip
    """Resume every in-progress turn in the store, or just the TURN_IDs (a suspended one too:
    after a fix, it runs again), and run them to the end."""
    settings = _settings(config_path, redis_url, namespace)
    keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
    for tid in named:
        check_turn_id(tid)

    async def chosen(store: RedisCheckpointStore) -> list[str]:
        """The named turns that are (now) in progress; the others are reported as they are."""
        ids = []
        for tid in dict.fromkeys(named):
            try:
                record = await reopen(store, tid)
            except RecordNotFound:
                raise BadInput(f"no turn {tid} in namespace {keys.namespace!r}") from None
            if record.in_progress:
                ids.append(tid)
            else:
                console.print(f"turn {tid} is final already ({record.counters.outcome})")
        return ids

    async def in_proc(client: StoreClient) -> RunStats:
        store = RedisCheckpointStore(client, keys)
        ids = await chosen(store) if named else None
        bar = _Bar(len(ids if ids is not None else await store.list_in_progress()), "resume")
        engine = TurnEngine.from_settings(client, settings, on_transition=bar.on_transition)
        with bar.progress:
            if ids is None:
                return await engine.resume_all()
            await engine.probations.note_predecessor(died=True)
            return await engine.resume_turns(ids)

    async def on_ray(rt: Runtime) -> RunStats:
        # The supervisor has every host adopt its slot's in-progress turns as it starts.
        started = time.monotonic()
        errors: list[str] = []
        if named:
            ids = await chosen(rt.store)
            await rt.adopt(ids)
        else:
            scan = await rt.store.load_in_progress()
            ids = [r.turn_id for r in scan.records]
            errors = [e.key for e in scan.errors]
        bar = _Bar(len(ids), "resume")
        with bar.progress:
            finals = await rt.wait(
                ids, timeout=24 * 3600, on_done=bar.advance,
                on_unusable=lambda tid, _exc: errors.append(tid),
            )  # fmt: skip
        stats = _stats_of(finals, time.monotonic() - started)
        stats.quarantined.extend(errors)
        return stats

    stats = _either(in_process, in_proc, on_ray, settings, hosts, ray_address)
    _summary("resume", stats, report)
    _exit_unless_final(stats)


@main.command()
@_common
@_work_options
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=200, show_default=True)
@click.option("--hosts", type=click.IntRange(2, 1024), default=2, show_default=True)
@_nodes_option
@click.option("--kill-at", type=click.FloatRange(0.0, 0.95), default=0.3, show_default=True,
              help="SIGKILL host 0 once this fraction of the turns has finished "
                   "(0: as soon as they are submitted).")  # fmt: skip
@click.option("--ray-address", default=None, help="Join this Ray cluster.")
@_verdict_option
@_report_option
def demo(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    scenario_path: str | None, agent_path: str | None, input_text: str | None, turns: int,
    hosts: int, nodes: int, kill_at: float, ray_address: str | None, verdict_mode: str,
    report: str | None,
) -> None:  # fmt: skip
    """Concurrent turns on Ray, one host SIGKILLed mid-run, then a verdict read from Redis:
    of a scenario (default tool_loop), or of an agent on one input. The exact verdict compares
    each transcript with a fault-free run in this process (the endpoint must answer each
    conversation deterministically: a local model at temperature 0 does); --verdict promises
    checks the runtime's promises for any model."""
    rid = f"demo{new_run_id()}"
    settings = _settings(config_path, redis_url, namespace or rid)
    if scenario_path is None and agent_path is None:
        scenario_path = "tool_loop"
    work = _work(scenario_path, agent_path, input_text)
    ids = turn_ids(rid, turns)
    bar = _Bar(turns, f"demo {rid}", force=True)

    mode = VerdictMode(verdict_mode)

    def killed(pid: int) -> None:
        console.print(
            f"[yellow]SIGKILLed host 0 (pid {pid}) on purpose: the demo's kill. Ray reports "
            "the worker's death next (it may guess the OOM killer); its turns resume elsewhere."
        )

    async def go(rt: Runtime) -> DemoReport:
        with bar.progress:
            return await run_demo(
                rt, work, ids, kill_at=kill_at, on_done=bar.advance, mode=mode, on_kill=killed
            )

    with _ray_nodes(nodes, ray_address) as (address, _local):
        result = _run_on_ray(settings, hosts, address, go)
    data = result.as_dict()
    title = f"demo {rid}: {turns} turns of {work.label} on {hosts} hosts"
    table = Table(title=title, show_header=False)
    for k in ("completed", "correct", "resumed", "checkpoints", "kills", "respawns", "wall_s",
              "turns_per_s"):  # fmt: skip
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


@main.command()
@_common
@_work_options
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=100, show_default=True)
@click.option("--duration", type=click.FloatRange(1, 86_400), default=30, show_default=True,
              help="Seconds of fault injection (turns arrive during the first half).")  # fmt: skip
@click.option("--kill-interval", type=click.FloatRange(0.1, 3600), default=2, show_default=True,
              help="Mean seconds between faults.")  # fmt: skip
@click.option("--targets", default="all", show_default=True,
              help=f"Comma-separated fault targets: {', '.join(TARGETS)} ('none': only the "
              "poison turns' own faults).")  # fmt: skip
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--poison", type=click.IntRange(0, 1_000_000), default=0, show_default=True,
              help="Turns that run a poison variant of the scenario (a model call that "
              "SIGKILLs its process); each must end suspended:poison.")  # fmt: skip
@click.option("--hosts", type=click.IntRange(1, 1024), default=2, show_default=True)
@_nodes_option
@_redis_cluster_option
@click.option("--ray-address", default=None, help="Join this Ray cluster.")
@_verdict_option
@click.option("--report", type=click.Path(dir_okay=False), required=True,
              help="Write the JSON report here.")  # fmt: skip
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write the PNG timeline here.")  # fmt: skip
def chaos(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    scenario_path: str | None, agent_path: str | None, input_text: str | None, turns: int,
    duration: float, kill_interval: float, targets: str, seed: int, poison: int, hosts: int,
    nodes: int, redis_cluster: bool, ray_address: str | None, verdict_mode: str, report: str,
    plot: str | None,
) -> None:  # fmt: skip
    """Kill runtime processes at random under load, running a scenario or an agent on one
    input; exit 1 unless the evidence is clean."""
    settings = _settings(config_path, redis_url, namespace or f"chaos{seed}x{new_run_id()}")
    work = _work(scenario_path, agent_path, input_text)
    chosen = parse_targets(
        targets,
        embedded=settings.redis.url is None and not redis_cluster,
        nodes=nodes > 1 and ray_address is None,
        cluster=redis_cluster,
    )
    if poison > turns:
        raise BadInput(f"--poison {poison} is more than --turns {turns}")
    cfg = ChaosSettings(
        work, turns, duration, kill_interval, chosen, seed, poison, VerdictMode(verdict_mode)
    )
    bar = _Bar(turns, f"chaos seed {seed}", force=True)

    async def go(
        server: EmbeddedRedis | None,
        cluster: EmbeddedCluster | None,
        settings: Settings,
        local: LocalNodes | None,
    ) -> ChaosReport:
        # Orphaned turns (cut off by a Redis restart) are re-adopted every 2 s, not 10.
        sup = settings.supervisor.model_copy(update={"adopt_interval_s": 2.0})
        tuned = settings.model_copy(update={"supervisor": sup})
        # Faults that can lose Redis writes: side effects are counted on a witness outside
        # the Redis under test, so a lost counter cannot hide a duplicate.
        witness_cm = (
            EmbeddedRedis(appendfsync="always")
            if any(t in WITNESSED for t in chosen)
            else contextlib.nullcontext()
        )
        assert settings.redis.url is not None
        with witness_cm as witness:
            rt = await Runtime.start(
                tuned, redis_url=settings.redis.url, hosts=hosts,
                ray_address=local.address if local else ray_address,
                effects_url=None if witness is None else witness.url,
            )  # fmt: skip
            try:
                with bar.progress:
                    return await run_chaos(
                        rt, server, cfg, nodes=local, cluster=cluster,
                        on_submitted=lambda n: None, on_done=bar.advance,
                    )  # fmt: skip
            finally:
                await rt.shutdown()

    with (
        _scratch_store(settings, "chaos", redis_cluster=redis_cluster) as (server, rc, store),
        _ray_nodes(nodes, ray_address) as (_address, local),
    ):
        result = asyncio.run(go(server, rc, store, local))
    data = result.as_dict()
    Path(report).write_text(json.dumps(data, indent=2) + "\n")
    if plot:
        plot_chaos(result, plot)
    v = data["verdict"]
    table = Table(
        title=f"chaos seed {seed}: {turns} turns, {len(result.faults)} faults", show_header=False
    )
    for k in ("lost", "transcripts_differ", "meta_drift", "in_progress_left",
              "duplicate_side_effects", "stale_writes_accepted", "suspended_unexpectedly",
              "aborted", "outcome_unknown_results", "resumed_turns",
              "most_resumes_of_one_turn"):  # fmt: skip
        table.add_row(k, str(v[k]))
    if poison:
        table.add_row(
            "poison turns suspended", f"{v['poison_suspended']} of {v['poison_turns']}, "
            f"{v['poison_host_deaths']} host deaths under them",
        )  # fmt: skip
    table.add_row("kills", json.dumps(data["kills_per_target"]))
    table.add_row("replacements per host", json.dumps(data["replacements_per_host"]))
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
    out.print(table)
    if not data["ok"]:
        # The report holds the evidence; print it too, so a failed CI log says which turn.
        for kind, examples in v["examples"].items():
            for example in examples:
                out.print(Text.assemble((kind, "red"), " ", example), highlight=False)
        sys.exit(ExitStatus.ERROR)


@main.command()
@_common
@click.option("--quick", is_flag=True, help="The small sizes (a few minutes; what CI runs).")
@click.option("--figures", default="all", show_default=True,
              help=f"Comma-separated subset of: {', '.join(FIGURES)}.")  # fmt: skip
@click.option("--ray-address", default=None, help="Join this Ray cluster.")
@click.option("--report", type=click.Path(dir_okay=False), required=True,
              help="Write the JSON report here.")  # fmt: skip
def bench(
    redis_url: str | None, namespace: str | None, config_path: str | None, quick: bool,
    figures: str, ray_address: str | None, report: str,
) -> None:  # fmt: skip
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


@main.command()
@_common
@click.argument("turn_id")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
def inspect(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    turn_id: str, as_json: bool,
) -> None:  # fmt: skip
    """Print a turn's stored transcript, meta and checkpoint fields."""
    settings = _settings(config_path, redis_url, namespace)
    check_turn_id(turn_id)

    async def go(client: StoreClient) -> Any:
        keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
        return await RedisCheckpointStore(client, keys).load(turn_id)

    record = _run(go, settings)
    if as_json:
        out.print_json(json.dumps(dump_model(record)))
        return
    fields = Table(title=f"turn {turn_id}", show_header=False)
    for name in ("session_id", "epoch", "seq", "phase", "in_progress", "reason", "baseline",
                 "updated_at"):  # fmt: skip
        value = getattr(record, name)
        fields.add_row(name, value.value if isinstance(value, TurnPhase) else str(value))
    c = record.counters
    fields.add_row("counters", json.dumps(dump_model(c.model_copy(update={"last_error": None}))))
    if c.outcome is not None:
        fields.add_row("outcome", c.outcome.value)
    fields.add_row("tokens", c.tokens_line())
    if c.last_error is not None:
        fields.add_row("last error", escape(c.last_error.line()))
    if c.outcome is Outcome.SUSPENDED_POISON:
        fields.add_row(
            "suspended because",
            f"{evidence(c.stalled_resumes, c.isolated_deaths)}; after a fix, "
            f"phaseline resume {turn_id} runs it again",
        )
    elif c.outcome is Outcome.SUSPENDED_FAILING:
        fields.add_row(
            "suspended because",
            f"its runs kept failing with an unexpected error (the last error says which); after "
            f"a fix, phaseline resume {turn_id} runs it again",
        )
    elif c.outcome is Outcome.SUSPENDED_AGENT_UNAVAILABLE:
        fields.add_row(
            "suspended because",
            f"its agent could not be loaded ({c.agent_failures} tries; the last error says "
            f"where); after a fix, phaseline resume {turn_id} runs it again",
        )
    out.print(fields)
    transcript = Table(title="transcript")
    for col in ("#", "role", "source", "id", "content"):
        transcript.add_column(col)
    for i, (m, meta) in enumerate(zip(record.messages, record.meta, strict=True)):
        content = _shown(m.text, INSPECT_TEXT)
        if m.tool_calls:
            calls = ", ".join(
                f"{c.name}({_shown(c.arguments_json(), INSPECT_ARGS)})" for c in m.tool_calls
            )
            content = f"{content} {calls}".strip()
        if m.tool_result is not None:
            r = m.tool_result
            content = f"[{r.status}] {_shown(r.output, INSPECT_TEXT)}"
        src = meta.source + (" (injected)" if meta.system_injected else "")
        transcript.add_row(str(i), m.role, src, meta.message_id[:12], escape(content))
    out.print(transcript)


#: Characters of a message's text and of a call's arguments ``inspect`` shows (``--json`` has all).
INSPECT_TEXT = 300
INSPECT_ARGS = 120


def _shown(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [+{len(text) - limit:,} characters; --json has all]"


async def _render(events: AsyncIterator[WatchEvent], view: LiveView) -> None:
    async for event in events:
        view.show(event)


def _exit_for(view: LiveView) -> None:
    """0 for a turn that ended with the model's text (``ANSWER_OUTCOMES``), 1 otherwise."""
    done = view.finished
    if done is not None and done.outcome not in ANSWER_OUTCOMES:
        sys.exit(ExitStatus.ERROR)


@main.command()
@_common
@click.argument("turn_id")
@click.option("--from-now", is_flag=True,
              help="Only what happens from now on (default: first replay what the turn's live "
                   "stream still holds).")  # fmt: skip
@click.option("--phases", is_flag=True, help="Show every phase transition too.")
def watch(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    turn_id: str, from_now: bool, phases: bool,
) -> None:  # fmt: skip
    """Follow a turn live until it is final: streamed text, tool calls and results, watchdog
    notes, and a marker where a new owner resumed it after a crash. Ctrl-C stops watching;
    the turn goes on. Exits 0 for an answered turn, 1 for one that ended otherwise."""
    settings = _settings(config_path, redis_url, namespace)
    keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
    check_turn_id(turn_id)
    view = LiveView(out, phases=phases)

    async def go(client: StoreClient) -> None:
        try:
            await _render(watch_turn(client, keys, turn_id, from_start=not from_now), view)
        except RecordNotFound:
            raise BadInput(f"no turn {turn_id} in namespace {keys.namespace!r}") from None

    try:
        _run(go, settings)
    except KeyboardInterrupt:
        console.print(f"\nstopped watching; turn {turn_id} goes on (phaseline watch {turn_id})")
        sys.exit(130)
    _exit_for(view)


def whoami() -> str:
    """``user@host``: who made a decision or a request, as the turn keeps it."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _say_queued(session: str, behind: str, place: int) -> None:
    console.print(
        f"queued in session {session} behind turn {behind} (place {place}): it opens the "
        "session's next turn when that one ends (on a deployment, or with phaseline resume)"
    )


def _check_naming(session: str | None, turn_id: str | None) -> None:
    """A turn is named by its session (``<session>/<n>``) or by an id, not both."""
    if session is not None and turn_id is not None:
        raise BadInput("give --session (its turns are named <session>/<n>) or --turn-id")
    if session is not None:
        check_session_id(session)
    if turn_id is not None:
        check_turn_id(turn_id)


@main.command()
@_common
@click.option("--agent", "agent_path", required=True,
              help="Import path of the agent (pkg.module:name).")  # fmt: skip
@click.option("--input", "input_text", required=True, help="The user message.")
@click.option("--session", default=None,
              help="Open the turn in this session: it starts from the session's previous "
                   "turn (refused while that one still runs).")  # fmt: skip
@click.option("--turn-id", default=None, help="Id of the turn (default: random).")
@click.option("--ray-address", default=None,
              help="Hand the turn to the deployment running on this Ray cluster ('auto': the "
                   "local one; see phaseline serve). Without it the turn is only written to "
                   "Redis: a running deployment adopts it, phaseline resume runs it.")  # fmt: skip
@click.option("--if-busy", type=click.Choice([p.value for p in IfBusy]), default="reject",
              show_default=True,
              help="With --session, while its turn runs: refuse; queue this message to open "
                   "the next turn when that one ends; or interrupt (cancel it at its next "
                   "boundary, then open the next turn from its transcript).")  # fmt: skip
@click.option("--watch", "then_watch", is_flag=True, help="Then follow it live (watch).")
def submit(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    agent_path: str, input_text: str, session: str | None, turn_id: str | None,
    ray_address: str | None, if_busy: str, then_watch: bool,
) -> None:  # fmt: skip
    """Submit one turn of an agent and print its id (on stdout, for scripts); a message queued
    behind a session's running turn prints nothing there (stderr says where it waits)."""
    settings = _settings(config_path, redis_url, namespace)
    keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
    _check_naming(session, turn_id)
    if not input_text.strip():
        raise BadInput("--input is empty")
    if session is None and if_busy != IfBusy.REJECT:
        raise BadInput("--if-busy is about a session: give --session")
    policy = IfBusy(if_busy)
    turn_input = TurnInput(message=input_text)
    check_agent(agent_path, turn_input)
    view = LiveView(out)
    by = whoami()

    async def write(client: StoreClient) -> str | None:
        store = RedisCheckpointStore(client, keys, durability=settings.redis.durability_policy())
        if session is not None:
            sessions = Sessions(store)
            try:
                spec, _ = await sessions.open(
                    session, session_turn(agent_path, turn_input, session)
                )
                return spec.turn_id
            except SessionBusy as busy:
                if policy is IfBusy.REJECT:
                    raise
                queued = QueuedTurn(agent=agent_path, input=turn_input,
                                    at_ms=int(time.time() * 1000), by=by)  # fmt: skip
                place, opened = await queue_behind(
                    sessions, Inbox(client, keys), session, busy.turn_id, queued,
                    interrupt=policy is IfBusy.INTERRUPT,
                )  # fmt: skip
                _say_queued(session, busy.turn_id, place)
                return None if opened is None else opened[0].turn_id
        tid = turn_id or new_run_id()
        await store.submit(*new_turns(agent_path, turn_input, [tid])[0])
        return tid

    async def go(client: StoreClient) -> str | None:
        if ray_address is None:
            tid = await write(client)
            if tid is not None:
                console.print(
                    f"[dim]turn {tid} is in Redis: a deployment of namespace {keys.namespace!r} "
                    f"adopts it within {settings.supervisor.adopt_interval_s:g} s; phaseline "
                    f"resume {tid} runs it here"
                )
        else:
            rt = await Runtime.attach(settings, ray_address=ray_address)
            try:
                if session is not None:
                    sent = await rt.submit_in_session(
                        agent_path, turn_input, session, if_busy=policy, by=by
                    )
                    if sent.turn_id is None:
                        _say_queued(session, sent.queued_behind or "?", sent.place)
                    tid = sent.turn_id
                else:
                    ids = [turn_id] if turn_id else [new_run_id()]
                    created = await rt.submit(agent_path, turn_input, ids)
                    if not created:
                        raise BadInput(f"turn {ids[0]} already exists")
                    tid = created[0]
            finally:
                await rt.detach()
        if tid is None:
            return None
        out.print(tid, highlight=False)
        if then_watch:
            await _render(watch_turn(client, keys, tid), view)
        return tid

    try:
        _run(go, settings)
    except TurnExists as exc:
        raise BadInput(str(exc)) from None
    except KeyboardInterrupt:
        sys.exit(130)
    _exit_for(view)


@main.command()
@_common
@click.option("--hosts", type=click.IntRange(1, 1024), default=2, show_default=True,
              help="Number of TurnActor actors.")  # fmt: skip
@click.option("--agent", "agents", multiple=True,
              help="Import path of an agent whose tools need Ray resources, so their tool "
                   "worker pools start (repeat it).")  # fmt: skip
@click.option("--ray-address", default=None,
              help="Join this Ray cluster (default: start a private one; others join it with "
                   "--ray-address and the address this prints).")  # fmt: skip
@click.option("--drain", is_flag=True, default=False,
              help="When stopped, wait for the running turns to finish (a second Ctrl-C stops "
                   "at once).")  # fmt: skip
def serve(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    hosts: int, agents: tuple[str, ...], ray_address: str | None, drain: bool,
) -> None:  # fmt: skip
    """Run a deployment until stopped. SIGTERM or Ctrl-C stops it cleanly: no new turns start,
    running ones get [supervisor] stop_grace_s to reach their next checkpoint (--drain: to
    finish), then it says how many are left in progress (they resume when the namespace is
    served again). A serve that finds its namespace already served on this Ray cluster
    attaches to it instead, and leaving stops nothing. Submit with phaseline submit
    --ray-address ..., follow turns with phaseline watch."""
    settings = _settings(config_path, redis_url, namespace)
    ns = settings.redis.namespace

    async def go(_client: StoreClient, url: str) -> None:
        rt = await Runtime.start(
            settings, redis_url=url, hosts=hosts, ray_address=ray_address, agents=agents
        )
        stops = _StopSignals()  # after Ray's start: its core worker sets a SIGTERM handler
        address = ray.get_runtime_context().gcs_address
        if rt.owner is None:
            console.print(
                f"attached to the deployment of namespace {ns!r} already running on this Ray "
                "cluster (this serve is a client of it: leaving stops nothing)"
            )
        console.print(
            f"serving namespace {ns!r}: {rt.dep.hosts} hosts on Redis {redact_url(url)}, Ray "
            f"cluster {address}; submit with: phaseline submit --ray-address {address} "
            "--agent PATH --input TEXT"
        )
        try:
            while not stops.first.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stops.first.wait(), SERVE_CHECK_S)  # the check period
                if not stops.first.is_set() and not await rt.alive():
                    raise click.ClickException(
                        f"the deployment of namespace {ns!r} stopped under this serve (its "
                        "supervisor is gone: the Ray cluster lost it, or another deployment took "
                        "the namespace over); in-progress turns stay in Redis"
                    )
            if rt.owner is None:
                console.print(f"leaving; the deployment of namespace {ns!r} keeps running")
                return
            await _stop_serving(rt, settings, drain, stops)
        finally:
            await rt.shutdown()
            stops.restore()

    try:
        _run_with_url(go, settings)
    except KeyboardInterrupt:  # Ctrl-C while starting: nothing ran yet
        sys.exit(130)


#: How often ``serve`` checks that its deployment still runs.
SERVE_CHECK_S = 2.0


class _StopSignals:
    """SIGTERM and SIGINT as events of the running loop: the first asks for a clean stop,
    the second for a stop now."""

    def __init__(self) -> None:
        self.first, self.second = asyncio.Event(), asyncio.Event()
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.second if self.first.is_set() else self.first).set()

    def restore(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(sig)


async def _stop_serving(rt: Runtime, settings: Settings, drain: bool, stops: _StopSignals) -> None:
    """No new turns; the running ones reach their next checkpoint (or finish, with
    ``drain``) unless a second signal comes; then say what is left."""
    running = await rt.stop_taking()
    before = {t: (await rt.store.load(t)).seq for t in await rt.store.list_in_progress()}
    grace = settings.supervisor.stop_grace_s
    if drain:
        console.print(f"stopping: waiting for {len(before)} turns in progress to finish "
                      "(Ctrl-C again stops now)")  # fmt: skip
    else:
        console.print(f"stopping: {running} turns running get {grace:g} s to reach their next "
                      "checkpoint (Ctrl-C again stops now)")  # fmt: skip

    async def settled() -> bool:
        left = await rt.store.list_in_progress()
        if drain:
            return not left
        for tid in left:
            if tid in before and (await rt.store.load(tid)).seq == before[tid]:
                return False
        return True

    deadline = None if drain else time.monotonic() + grace
    while not stops.second.is_set() and not await settled():
        if deadline is not None and time.monotonic() > deadline:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stops.second.wait(), 0.5)  # the poll period
    left = len(await rt.store.list_in_progress())
    console.print(
        f"stopped: {left} turns left in progress; they resume from their last checkpoints when "
        f"namespace {settings.redis.namespace!r} is served again"
        if left
        else "stopped: no turn left in progress"
    )


@main.command()
@_common
@click.option("--ray-address", default="auto", show_default=True,
              help="The Ray cluster the deployment runs on.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one sample as JSON (for scripts).")
@click.option("--watch", "every", type=click.FloatRange(0.5, 3600), default=None,
              help="Refresh every this many seconds until Ctrl-C.")  # fmt: skip
def status(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    ray_address: str, as_json: bool, every: float | None,
) -> None:  # fmt: skip
    """One screen of a running deployment (phaseline serve): hosts with generation and turns
    held, turns per phase, tool worker pools with queue depth and calls/s, MCP servers,
    checkpoints/s. Rates are measured over one second."""
    settings = _settings(config_path, redis_url, namespace)
    if as_json and every is not None:
        raise BadInput("--json prints one sample; drop --watch")

    async def go() -> None:
        rt = await Runtime.attach(settings, ray_address=ray_address)
        try:
            if as_json:
                out.print_json(json.dumps((await deployment_status(rt)).as_dict()))
                return
            if every is None:
                out.print(render(await deployment_status(rt)))
                return
            with Live(render(await deployment_status(rt)), console=out) as live:
                while True:
                    live.update(render(await deployment_status(rt, sample_s=every)))
        finally:
            await rt.detach()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(go())


class _Lines:
    """Lines of stdin for an event loop, read by a daemon thread (so Ctrl-C is never stuck in
    a blocking read, and the process can exit while it waits)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._loop = loop
        threading.Thread(target=self._read, daemon=True, name="stdin").start()

    def _read(self) -> None:
        for line in sys.stdin:
            self._put(line.rstrip("\n"))
        self._put(None)

    def _put(self, line: str | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            self._loop.call_soon_threadsafe(self.queue.put_nowait, line)


@main.command()
@_common
@click.option("--agent", "agent_path", required=True,
              help="Import path of the agent (pkg.module:name).")  # fmt: skip
@click.option("--session", default=None,
              help="Session to continue (default: a new one); a turn of it still running is "
                   "followed first.")  # fmt: skip
@click.option("--hosts", type=click.IntRange(1, 1024), default=2, show_default=True,
              help="TurnActors, if this chat starts the deployment.")  # fmt: skip
@click.option(
    "--ray-address",
    default=None,
    help="Join this Ray cluster and the deployment running there, if any.",
)
def chat(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    agent_path: str, session: str | None, hosts: int, ray_address: str | None,
) -> None:  # fmt: skip
    """An interactive session with an agent: type a message, watch its turn live, type the
    next. Ctrl-D ends the chat. Ctrl-C leaves: a turn that is running goes on on a cluster
    that outlives this command (or resumes from its checkpoint when you come back), and the
    command to reattach is printed."""
    settings = _settings(config_path, redis_url, namespace)
    _check_naming(session, None)
    load_agent(agent_path)
    sid = session or f"chat-{new_run_id()}"
    again = f"phaseline chat --agent {agent_path} --session {sid}" + (
        f" --ray-address {ray_address}" if ray_address else ""
    )
    current: list[str] = []

    async def converse(rt: Runtime) -> None:
        lines = _Lines(asyncio.get_running_loop())
        console.print(f"[dim]session {sid} with {agent_path}; Ctrl-D ends, Ctrl-C leaves")
        latest = await rt.sessions.latest(sid)
        if latest is not None and (await rt.store.load(latest)).in_progress:
            console.print(f"[dim]reattaching to turn {latest}")
            current[:] = [latest]
            await _render(rt.watch(latest), LiveView(out))
        while True:
            current.clear()
            if sys.stdin.isatty():
                out.print("[bold]you> ", end="")
            line = await lines.queue.get()
            if line is None:
                return
            if not line.strip():
                continue
            (tid,) = await rt.submit(agent_path, line, session=sid)
            current[:] = [tid]
            await _render(rt.watch(tid), LiveView(out))

    async def go(_client: StoreClient, url: str) -> None:
        try:
            rt = await Runtime.attach(settings, ray_address=ray_address)
            started = False
        except ConfigError:
            rt = await Runtime.start(settings, redis_url=url, hosts=hosts, ray_address=ray_address)
            started = True
        left_running = False
        try:
            await converse(rt)
        except asyncio.CancelledError:  # Ctrl-C
            if current:
                left_running = not rt.owns_ray
                where = (
                    "keeps running on the cluster"
                    if left_running
                    else "is saved in Redis and resumes from its last checkpoint when you come back"
                )
                console.print(
                    f"\nturn {current[0]} {where}; reattach: phaseline watch {current[0]}, "
                    f"or {again}"
                )
            raise
        finally:
            if started and not left_running:
                await rt.shutdown()
            else:
                await rt.detach()

    try:
        _run_with_url(go, settings)
    except KeyboardInterrupt:
        sys.exit(130)
    console.print(f"[dim]session {sid} ends here; continue it with {again}")


@main.command("redis")
@_common
@click.option("--data-dir", default=None,
              help="AOF directory (default: [redis] data_dir, else $PHASELINE_DATA_DIR, else "
                   "~/.local/state/phaseline/redis).")  # fmt: skip
def redis_cmd(
    redis_url: str | None, namespace: str | None, config_path: str | None, data_dir: str | None
) -> None:
    """Start the embedded redis-server, print its URL, keep it until interrupted."""
    settings = _settings(config_path, redis_url, namespace)
    server = EmbeddedRedis(
        data_dir=data_dir or settings.redis.data_path(),
        appendfsync=_appendfsync(settings),
    )
    try:
        url = server.start()
        out.print(redact_url(url), highlight=False)
        console.print(
            f"[dim]full URL (with the password) in {server.data_dir / 'url'}, mode 0600; "
            "commands without --redis-url find it there"
        )
        assert server.process is not None
        # Never one blocking wait: a signal that lands just before the waitpid call would
        # only run its handler once the call returns (never, the server runs on). A wait
        # with a timeout polls, and each poll lets a pending handler run.
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=1.0)
                break
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
