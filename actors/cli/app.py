"""The ``phaseline`` group every verb registers on, the options they share, and how a verb
reaches Redis and Ray.

Every verb takes ``--redis-url``, ``--namespace`` and ``--config``. Without a Redis URL (flag,
``PHASELINE_REDIS_URL`` or config) an embedded ``redis-server`` is used on the configured data
directory, so ``phaseline inspect`` after ``phaseline run`` sees the same records.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import getpass
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from actors.cluster.joining import gcs_address
from actors.cluster.runtime import Runtime
from actors.engine.front_desk import FrontDesk
from actors.engine.settings.config import Settings, load_settings
from bus.errors import ConfigError, PhaselineError
from store.redis.connection import StoreClient
from store.redis.embedded import EmbeddedRedis, appendfsync_for, attach_or_start
from store.redis.embedded_cluster import EmbeddedCluster
from store.redis.failures import translated
from store.redis.urls import redact_url

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


def count(n: int, noun: str) -> str:
    """``1 turn``, ``3 turns``: how every verb says how many (``noun`` singular, ``s`` added)."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


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
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="Settings file (configs/*.toml).",
    )(fn)
    fn = click.option("--namespace", default=None, help="Key namespace (default: pl).")(fn)
    fn = click.option(
        "--redis-url-file",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help="Read the Redis URL from this file (keeps a password out of argv and ps).",
    )(_url_from_file(fn))
    fn = click.option(
        "--redis-url",
        default=None,
        help="Redis to use (else --redis-url-file, else $PHASELINE_REDIS_URL, else the "
        "embedded server). A URL with a password is visible in ps: prefer the file or "
        "the variable.",
    )(fn)
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
    "--redis-cluster",
    is_flag=True,
    default=False,
    help="Run on a local Redis Cluster of 3 primaries with a replica each, started for the run.",
)


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


@asynccontextmanager
async def front_desk(
    settings: Settings, client: StoreClient, ray_address: str | None = None, *, join: bool = True
) -> AsyncIterator[FrontDesk]:
    """The desk a verb works through: the deployment's when one serves the namespace (the one
    on ``ray_address``, else, with ``join``, the one its owner record in Redis names; it also
    tells the hosts at once), else Redis alone (a deployment honours the request later)."""
    if ray_address is not None:
        rt: Runtime | None = await Runtime.attach(settings, ray_address=ray_address)
    elif join:
        rt = await Runtime.find(settings, client)
        if rt is not None:
            console.print(
                f"[dim]attached to the deployment of namespace {rt.keys.namespace!r} on Ray "
                f"cluster {gcs_address()} (its owner record in Redis says where)"
            )
    else:
        rt = None
    if rt is None:
        yield FrontDesk(client, settings)
        return
    try:
        yield rt
    finally:
        await rt.detach()


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


#: The signal that asked this command to stop, once one did (see :func:`raise_if_signalled`).
_signalled: list[int] = []


def _exit_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C (SIGINT), so every ``finally`` runs: above all,
    an embedded server this command started is stopped with it instead of orphaned."""

    def leave(signum: int, _frame: object) -> None:
        _signalled.append(signum)
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return  # called from a thread (a program embedding the CLI): signals are not ours

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


def raise_if_signalled() -> None:
    """Raise the exit a signal asked for if its handler's own raise was lost: a handler that
    runs while the garbage collector is in an object's ``__del__`` (a Redis connection pool's,
    say) has its exception printed and dropped, and a command that waits for ever would go on
    waiting. Long waits call this between polls."""
    if _signalled and _signalled[-1] == signal.SIGINT:
        raise KeyboardInterrupt
    if _signalled:
        raise SystemExit(128 + _signalled[-1])


def note_interrupts() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt as ever, and is also recorded for
    :func:`raise_if_signalled`, for a plain wait loop (not under asyncio, whose own SIGINT
    handler this would replace)."""

    def interrupted(signum: int, _frame: object) -> None:
        _signalled.append(signum)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupted)


def whoami() -> str:
    """``user@host``: who made a decision or a request, as the turn keeps it."""
    return f"{getpass.getuser()}@{socket.gethostname()}"
