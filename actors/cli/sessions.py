"""Talking to a deployment: ``submit`` (a turn, or a message for a session's next) and ``chat``."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from dataclasses import dataclass

import click

from actors.cli.app import (
    BadInput,
    _common,
    _run,
    _run_with_url,
    _settings,
    console,
    front_desk,
    main,
    out,
    whoami,
)
from actors.cli.views import _exit_for, _render
from actors.cluster.runtime import Runtime
from actors.engine.agents import check_agent, load_agent
from actors.engine.front_desk import FrontDesk
from actors.engine.run_stats import new_run_id
from actors.engine.settings.config import Settings
from actors.harness.live import LiveView
from bus.errors import ConfigError, TurnExists
from store.domain.sessions import IfBusy
from store.keys import check_session_id, check_turn_id
from store.records import TurnInput
from store.redis.connection import StoreClient
from store.views.watch import watch_turn


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
@click.option(
    "--agent", "agent_path", required=True, help="Import path of the agent (pkg.module:name)."
)
@click.option("--input", "input_text", required=True, help="The user message.")
@click.option(
    "--session",
    default=None,
    help="Open the turn in this session: it starts from the session's previous "
    "turn (refused while that one still runs).",
)
@click.option("--turn-id", default=None, help="Id of the turn (default: random).")
@click.option(
    "--ray-address",
    default=None,
    help="Hand the turn to the deployment on this Ray cluster (default: the one the "
    "namespace's owner record in Redis names, if any). With none, the turn is "
    "only written to Redis: phaseline serve or resume runs it.",
)
@click.option(
    "--if-busy",
    type=click.Choice([p.value for p in IfBusy]),
    default="reject",
    show_default=True,
    help="With --session, while its turn runs: refuse; queue this message to open "
    "the next turn when that one ends; or interrupt (cancel it at its next "
    "boundary, then open the next turn from its transcript).",
)
@click.option("--watch", "then_watch", is_flag=True, help="Then follow it live (watch).")
def submit(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    agent_path: str,
    input_text: str,
    session: str | None,
    turn_id: str | None,
    ray_address: str | None,
    if_busy: str,
    then_watch: bool,
) -> None:
    """Submit one turn of an agent and print its id (on stdout, for scripts); a message queued
    behind a session's running turn prints nothing there (stderr says where it waits)."""
    settings = _settings(config_path, redis_url, namespace)
    keys = settings.redis.key_layout()
    _check_naming(session, turn_id)
    if not input_text.strip():
        raise BadInput("--input is empty")
    if session is None and if_busy != IfBusy.REJECT:
        raise BadInput("--if-busy is about a session: give --session")
    policy = IfBusy(if_busy)
    turn_input = TurnInput(message=input_text)
    check_agent(agent_path, turn_input)
    view = LiveView(out)
    sub = _Submission(agent_path, turn_input, session, turn_id, policy, whoami())

    async def go(client: StoreClient) -> str | None:
        async with front_desk(settings, client, ray_address) as desk:
            tid = await _send(desk, sub)
            if tid is not None and not isinstance(desk, Runtime):
                console.print(
                    f"[dim]turn {tid} is in Redis; no deployment serves namespace "
                    f"{keys.namespace!r} now: phaseline serve runs it, phaseline resume {tid} "
                    "runs it here"
                )
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


@dataclass(frozen=True, slots=True)
class _Submission:
    """What ``phaseline submit`` was asked to send."""

    agent: str
    """Import path of the agent."""
    turn_input: TurnInput
    """The user's message."""
    session: str | None
    """The session to continue (None: a turn of its own)."""
    turn_id: str | None
    """The id asked for a turn of its own (None: a random one)."""
    policy: IfBusy
    """What a busy session does with it."""
    by: str
    """Who sends it (``user@host``)."""


async def _send(desk: FrontDesk, sub: _Submission) -> str | None:
    """Submit through the desk (a deployment's, which hands the turn to its host now, or
    Redis alone); the turn id, None when queued behind a session's running turn."""
    if sub.session is None:
        ids = [sub.turn_id or new_run_id()]
        if not await desk.submit(sub.agent, sub.turn_input, ids):
            raise BadInput(f"turn {ids[0]} already exists")
        return ids[0]
    sent = await desk.submit_in_session(
        sub.agent, sub.turn_input, sub.session, if_busy=sub.policy, by=sub.by
    )
    if sent.turn_id is None:
        _say_queued(sub.session, sent.queued_behind or "?", sent.place)
    return sent.turn_id


async def _converse(rt: Runtime, sid: str, agent_path: str, current: list[str]) -> None:
    """Read a line, run it as the session's next turn and show it live, until end of input;
    ``current`` holds the turn running now (what Ctrl-C leaves behind). A turn of the session
    still in progress is reattached first."""
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


async def _serving(
    settings: Settings, client: StoreClient, ray_address: str | None
) -> Runtime | None:
    """The deployment serving the namespace (on ``ray_address``, else where its owner record
    says), if one does."""
    if ray_address is None:
        return await Runtime.find(settings, client)
    try:
        return await Runtime.attach(settings, ray_address=ray_address)
    except ConfigError:  # that cluster runs none: this chat starts one there
        return None


@main.command()
@_common
@click.option(
    "--agent", "agent_path", required=True, help="Import path of the agent (pkg.module:name)."
)
@click.option(
    "--session",
    default=None,
    help="Session to continue (default: a new one); a turn of it still running is followed first.",
)
@click.option(
    "--hosts",
    type=click.IntRange(1, 1024),
    default=2,
    show_default=True,
    help="TurnActors, if this chat starts the deployment.",
)
@click.option(
    "--ray-address",
    default=None,
    help="Join this Ray cluster and the deployment running there, if any.",
)
def chat(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    agent_path: str,
    session: str | None,
    hosts: int,
    ray_address: str | None,
) -> None:
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

    async def go(client: StoreClient, url: str) -> None:
        found = await _serving(settings, client, ray_address)
        started = found is None
        rt = found or await Runtime.start(
            settings, redis_url=url, hosts=hosts, ray_address=ray_address
        )
        left_running = False
        try:
            await _converse(rt, sid, agent_path, current)
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
