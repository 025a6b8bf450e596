"""The ``phaseline`` command line.

Every verb takes ``--redis-url``, ``--namespace`` and ``--config``. Without a Redis URL (flag,
``PHASELINE_REDIS_URL`` or config) an embedded ``redis-server`` is used on the configured data
directory, so ``phaseline inspect`` after ``phaseline run`` sees the same records.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
import redis.asyncio as aioredis
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.config import Settings, load_settings
from actors.engine import LocalEngine, RunStats, new_run_id, turn_ids
from actors.scenario import load_scenario
from bus.errors import ConfigError, PhaselineError
from bus.phase import Transition, TurnPhase
from store.checkpoint import RedisCheckpointStore
from store.codec import dump_model
from store.connection import connect, translated
from store.embedded import EmbeddedRedis, attach_or_start
from store.keys import KeyLayout, check_turn_id

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
console = Console(stderr=True)
out = Console()


class BadInput(click.ClickException):
    """Bad flags, files or scenarios: exit status 2, like click's own usage errors."""

    exit_code = 2


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
        "--redis-url", default=None,
        help="Redis to use (else $PHASELINE_REDIS_URL, else the embedded server).",
    )(fn)  # fmt: skip
    return _guard(fn)


def _settings(config_path: str | None, redis_url: str | None, namespace: str | None) -> Settings:
    return load_settings(config_path).with_overrides(url=redis_url, namespace=namespace)


@contextmanager
def _redis(settings: Settings) -> Iterator[str]:
    """The Redis URL to use; starts (and later stops) the embedded server when needed."""
    if settings.redis.url:
        yield settings.redis.url
        return
    url, server = attach_or_start(settings.redis.data_dir)
    if server is not None:
        console.print(f"[dim]embedded redis-server at {url} (data in {settings.redis.data_dir})")
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


def _run(coro_fn: Callable[[aioredis.Redis], Awaitable[T]], settings: Settings) -> T:
    """Run ``coro_fn(client)`` on a fresh event loop against the configured Redis."""
    with _redis(settings) as url:
        return asyncio.run(_with_client(coro_fn, url))


async def _with_client(coro_fn: Callable[[aioredis.Redis], Awaitable[T]], url: str) -> T:
    client = connect(url)
    try:
        with translated(f"cannot reach Redis at {url}"):
            await client.ping()
        return await coro_fn(client)
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


class _Bar:
    """A live progress bar counting turns that reached ``done``."""

    def __init__(self, total: int, label: str) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=False,
            disable=not console.is_terminal,
        )  # fmt: skip
        self.task = self.progress.add_task(label, total=total)

    def on_transition(self, t: Transition) -> None:
        if t.dst is TurnPhase.DONE:
            self.progress.advance(self.task)


def _summary(title: str, stats: RunStats, report: str | None) -> None:
    data = stats.as_dict()
    table = Table(title=title, show_header=False)
    for k, v in data.items():
        table.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    out.print(table)
    if report:
        Path(report).write_text(json.dumps(data, indent=2) + "\n")


@main.command()
@_common
@click.option(
    "--scenario",
    "scenario_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Scenario file (configs/scenarios/*.toml).",
)
@click.option("--turns", type=click.IntRange(1, 1_000_000), default=1, show_default=True)
@click.option("--run-id", default=None, help="Prefix of the turn ids (default: random).")
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the summary as JSON here.",
)
def run(
    redis_url: str | None, namespace: str | None, config_path: str | None,
    scenario_path: str, turns: int, run_id: str | None, report: str | None,
) -> None:  # fmt: skip
    """Run TURNS scripted turns of a scenario concurrently, in this process."""
    settings = _settings(config_path, redis_url, namespace)
    scenario = load_scenario(scenario_path)
    rid = check_turn_id(run_id) if run_id else new_run_id()
    bar = _Bar(turns, f"run {rid}")

    async def go(client: aioredis.Redis) -> RunStats:
        engine = LocalEngine.from_settings(client, settings, on_transition=bar.on_transition)
        engine.registry.require(scenario.tools)
        with bar.progress:
            return await engine.run_new(scenario, turn_ids(rid, turns))

    stats = _run(go, settings)
    _summary(f"run {rid}: {scenario.name}", stats, report)
    if stats.outcomes.get("fenced"):
        sys.exit(1)


@main.command()
@_common
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the summary as JSON here.",
)
def resume(
    redis_url: str | None, namespace: str | None, config_path: str | None, report: str | None
) -> None:
    """Resume every in-progress turn in the store and run it to the end."""
    settings = _settings(config_path, redis_url, namespace)

    async def go(client: aioredis.Redis) -> RunStats:
        keys = KeyLayout(settings.redis.namespace, settings.redis.shards)
        bar = _Bar(len(await RedisCheckpointStore(client, keys).list_in_progress()), "resume")
        engine = LocalEngine.from_settings(client, settings, on_transition=bar.on_transition)
        with bar.progress:
            return await engine.resume_all()

    stats = _run(go, settings)
    _summary("resume", stats, report)
    if stats.quarantined:
        console.print(f"[red]quarantined: {', '.join(stats.quarantined)}")
        sys.exit(1)


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

    async def go(client: aioredis.Redis) -> Any:
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
    fields.add_row("counters", json.dumps(dump_model(record.counters)))
    out.print(fields)
    transcript = Table(title="transcript")
    for col in ("#", "role", "source", "id", "content"):
        transcript.add_column(col)
    for i, (m, meta) in enumerate(zip(record.messages, record.meta, strict=True)):
        content = m.text[:80]
        if m.tool_calls:
            content += " " + ", ".join(f"{c.name}()" for c in m.tool_calls)
        if m.tool_result is not None:
            content = f"[{m.tool_result.status}] {m.tool_result.output[:70]}"
        src = meta.source + (" (injected)" if meta.system_injected else "")
        transcript.add_row(str(i), m.role, src, meta.message_id[:12], escape(content))
    out.print(transcript)


@main.command("redis")
@_common
@click.option("--data-dir", default=None, help="AOF directory (default from config).")
def redis_cmd(
    redis_url: str | None, namespace: str | None, config_path: str | None, data_dir: str | None
) -> None:
    """Start the embedded redis-server, print its URL, keep it until interrupted."""
    settings = _settings(config_path, redis_url, namespace)
    server = EmbeddedRedis(data_dir=data_dir or settings.redis.data_dir)
    url = server.start()
    out.print(url)
    try:
        assert server.process is not None
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
