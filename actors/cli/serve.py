"""Running things: ``serve`` (a deployment, until a signal, optionally draining), ``redis``
(the embedded server) and ``model-server`` (a real model on this machine)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import click

from actors.cli.app import (
    BadInput,
    _appendfsync,
    _common,
    _run_with_url,
    _settings,
    console,
    count,
    main,
    note_interrupts,
    out,
    raise_if_signalled,
)
from actors.cluster.joining import gcs_address, ray_auth
from actors.cluster.runtime import Runtime
from actors.engine.models import local_model
from actors.engine.settings.config import Settings
from bus.errors import StoreError
from store.domain.ownership import RayAuth
from store.redis.connection import StoreClient
from store.redis.embedded import EmbeddedRedis
from store.redis.urls import redact_url


@main.command()
@_common
@click.option(
    "--hosts",
    type=click.IntRange(1, 1024),
    default=2,
    show_default=True,
    help="Number of TurnActor actors.",
)
@click.option(
    "--agent",
    "agents",
    multiple=True,
    help="Import path of an agent whose tools need Ray resources, so their tool "
    "worker pools start (repeat it).",
)
@click.option(
    "--ray-address",
    default=None,
    help="Join this Ray cluster (default: start a private one; others join it with "
    "--ray-address and the address this prints).",
)
@click.option(
    "--drain",
    is_flag=True,
    default=False,
    help="When stopped, wait for the running turns to finish (a second Ctrl-C stops at once).",
)
def serve(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    hosts: int,
    agents: tuple[str, ...],
    ray_address: str | None,
    drain: bool,
) -> None:
    """Run a deployment until stopped. SIGTERM or Ctrl-C stops it cleanly: no new turns start,
    running ones get [supervisor] stop_grace_s to reach their next checkpoint (--drain: to
    finish), then it says how many are left in progress (they resume when the namespace is
    served again). A serve that finds its namespace already served on this Ray cluster
    attaches to it instead, and leaving stops nothing. Submit with phaseline submit (it finds
    the deployment from Redis), follow turns with phaseline watch; a replaced host is said."""
    settings = _settings(config_path, redis_url, namespace)
    ns = settings.redis.namespace

    async def go(_client: StoreClient, url: str) -> None:
        rt = await Runtime.start(
            settings, redis_url=url, hosts=hosts, ray_address=ray_address, agents=agents
        )
        stops = _StopSignals()  # after Ray's start: its core worker sets a SIGTERM handler
        address = gcs_address()
        if rt.owner is None:
            console.print(
                f"attached to the deployment of namespace {ns!r} already running on this Ray "
                "cluster (this serve is a client of it: leaving stops nothing)"
            )
        changes = _HostChanges(rt)
        await changes.report()  # the generations now: what the first check compares with
        console.print(
            f"serving namespace {ns!r}: {rt.dep.hosts} hosts on Redis {redact_url(url)}, Ray "
            f"cluster {address}; submit with: phaseline submit --agent PATH --input TEXT "
            "(clients find this deployment from its owner record in Redis"
            + (
                ", and need this machine's ~/.ray/auth_token on theirs)"
                if ray_auth() is RayAuth.TOKEN
                else ")"
            )
        )
        lost = False
        try:
            while not stops.first.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stops.first.wait(), SERVE_CHECK_S)  # the check period
                if not stops.first.is_set():
                    await changes.report()
                why = "" if stops.first.is_set() else await rt.stopped()
                if why:
                    raise _Lost(
                        f"the deployment of namespace {ns!r} stopped under this serve: {why}; "
                        "in-progress turns stay in Redis"
                    )
            if rt.owner is None:
                console.print(f"leaving; the deployment of namespace {ns!r} keeps running")
                return
            await _stop_serving(rt, settings, drain, stops)
        except _Lost:
            lost = True
            raise
        finally:
            # A deployment that lost its namespace is abandoned, not shut down: the namespace
            # (and its hosts' generations in Redis) are another deployment's now.
            await (rt.abandon() if lost else rt.shutdown())
            stops.restore()

    try:
        _run_with_url(go, settings)
    except KeyboardInterrupt:  # Ctrl-C while starting: nothing ran yet
        sys.exit(130)


class _HostChanges:
    """Says when the supervisor replaced a host (a new generation of its slot): an operator
    watching ``serve`` sees the crashes its deployment absorbs."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.seen: dict[int, int] | None = None

    async def report(self) -> None:
        try:
            now = await self.rt.hosts.generations()
        except StoreError as exc:  # Redis away for a moment: the next check reads again
            console.print(f"[yellow]cannot read the hosts' generations: {exc}")
            return
        if self.seen is not None:
            for slot, generation in sorted(now.items()):
                if generation > self.seen.get(slot, generation):
                    console.print(
                        f"{self.rt.dep.host_label(slot)} replaced (generation {generation}): its "
                        "turns resume from their last checkpoints; "
                        f"{await self.rt.respawns()} replacements so far"
                    )
        self.seen = now


class _Lost(click.ClickException):
    """The deployment stopped under ``serve`` (exit 1, saying why)."""


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
        console.print(
            f"stopping: waiting for {count(len(before), 'turn')} in progress to finish "
            "(Ctrl-C again stops now)"
        )
    else:
        console.print(
            f"stopping: {count(running, 'turn')} running get {grace:g} s to reach "
            "their next checkpoint (Ctrl-C again stops now)"
        )

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
        f"stopped: {count(left, 'turn')} left in progress; they resume from their last "
        f"checkpoints when namespace {settings.redis.namespace!r} is served again"
        if left
        else "stopped: no turn left in progress"
    )


@main.command("redis")
@_common
@click.option(
    "--data-dir",
    default=None,
    help="AOF directory (default: [redis] data_dir, else $PHASELINE_DATA_DIR, else "
    "~/.local/state/phaseline/redis).",
)
def redis_cmd(
    redis_url: str | None, namespace: str | None, config_path: str | None, data_dir: str | None
) -> None:
    """Start the embedded redis-server, print its URL, keep it until interrupted."""
    settings = _settings(config_path, redis_url, namespace)
    note_interrupts()
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
            raise_if_signalled()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@main.command("model-server")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(512, 32768),
    default=2048,
    show_default=True,
    help="Context window, in tokens.",
)
@click.option("--threads", type=click.IntRange(1, 256), default=2, show_default=True)
@click.option(
    "--cpp",
    is_flag=True,
    help="llama.cpp's own C++ server (scripts/build_llama_server builds it): requests served "
    "concurrently, /v1/responses and /v1/messages too.",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="With --cpp: requests served at once (they share --ctx).",
)
def model_server(port: int, host: str, n_ctx: int, threads: int, cpp: bool, parallel: int) -> None:
    """Serve a real model on this machine, from any directory: llama.cpp's OpenAI-compatible
    server with SmolLM2-135M-Instruct (the llm extra; nothing is downloaded). It runs in the
    foreground until Ctrl-C; point the example agent at it with the variables it prints."""
    missing = local_model.available()
    if missing is None and cpp and local_model.cpp_server() is None:
        missing = "llama.cpp's C++ server is not built: scripts/build_llama_server (once)"
    if missing is not None:
        raise BadInput(missing)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1"
    console.print(
        f"llama.cpp's server on {url}, model {local_model.MODEL_ALIAS!r}; for the example "
        f"agent: export OPENAI_BASE_URL={url} PHASELINE_MODEL={local_model.MODEL_ALIAS}",
        highlight=False,
    )
    argv = (
        local_model.cpp_command(port, host=host, n_ctx=n_ctx, threads=threads, parallel=parallel)
        if cpp
        else local_model.command(port, host=host, n_ctx=n_ctx, threads=threads)
    )
    sys.stderr.flush()
    os.execv(argv[0], argv)  # the server is this process: a signal reaches it, not a wrapper
