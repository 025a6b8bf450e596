"""Looking at turns and the deployment: ``inspect``, ``watch`` and ``status``."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import click
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from actors.cli.app import (
    BadInput,
    ExitStatus,
    _common,
    _run,
    _settings,
    console,
    front_desk,
    main,
    out,
)
from actors.cluster.runtime import Runtime
from actors.cluster.status import deployment_status
from actors.engine.front_desk import FrontDesk
from actors.harness.live import LiveView
from actors.harness.status_view import render
from actors.turn.poison import evidence
from bus.errors import RecordNotFound
from bus.events import WatchEvent
from bus.outcomes import ANSWER_OUTCOMES, Outcome
from bus.phase import TurnPhase
from store.codec import dump_model
from store.keys import check_turn_id
from store.records import CheckpointRecord
from store.redis.connection import StoreClient
from store.views.watch import watch_turn


@main.command()
@_common
@click.argument("turn_id")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
def inspect(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_id: str,
    as_json: bool,
) -> None:
    """Print a turn's stored transcript, meta and checkpoint fields."""
    settings = _settings(config_path, redis_url, namespace)
    check_turn_id(turn_id)

    async def go(client: StoreClient) -> Any:
        return await FrontDesk(client, settings).store.load(turn_id)

    record = _run(go, settings)
    if as_json:
        out.print_json(json.dumps(dump_model(record)))
        return
    out.print(_fields_table(record))
    out.print(_transcript_table(record))


def _fields_table(record: CheckpointRecord) -> Table:
    """A record's checkpoint fields, counters, outcome and, for a suspended turn, why and how
    to run it again."""
    turn_id = record.turn_id
    fields = Table(title=f"turn {turn_id}", show_header=False)
    for name in (
        "session_id",
        "epoch",
        "seq",
        "phase",
        "in_progress",
        "reason",
        "baseline",
        "updated_at",
    ):
        value = getattr(record, name)
        fields.add_row(name, value.value if isinstance(value, TurnPhase) else str(value))
    c = record.counters
    fields.add_row("counters", json.dumps(dump_model(c.model_copy(update={"last_error": None}))))
    if c.outcome is not None:
        fields.add_row("outcome", c.outcome.value)
    fields.add_row("tokens", c.tokens_line())
    fields.add_row("model calls", c.calls_line())
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
    return fields


def _transcript_table(record: CheckpointRecord) -> Table:
    """One row per message: role, source, id and its content cut at ``INSPECT_TEXT``."""
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
    return transcript


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
@click.option(
    "--from-now",
    is_flag=True,
    help="Only what happens from now on (default: first replay what the turn's live "
    "stream still holds).",
)
@click.option("--phases", is_flag=True, help="Show every phase transition too.")
def watch(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_id: str,
    from_now: bool,
    phases: bool,
) -> None:
    """Follow a turn live until it is final: streamed text, tool calls and results, watchdog
    notes, and a marker where a new owner resumed it after a crash. Ctrl-C stops watching;
    the turn goes on. Exits 0 for an answered turn, 1 for one that ended otherwise."""
    settings = _settings(config_path, redis_url, namespace)
    keys = settings.redis.key_layout()
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


@main.command()
@_common
@click.option(
    "--ray-address",
    default=None,
    help="The Ray cluster the deployment runs on (default: the one the namespace's "
    "owner record in Redis names).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one sample as JSON (for scripts).")
@click.option(
    "--watch",
    "every",
    type=click.FloatRange(0.5, 3600),
    default=None,
    help="Refresh every this many seconds until Ctrl-C.",
)
def status(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    ray_address: str | None,
    as_json: bool,
    every: float | None,
) -> None:
    """One screen of a running deployment (phaseline serve): hosts with generation and turns
    held, turns per phase, tool worker pools with queue depth and calls/s, MCP servers,
    checkpoints/s. Rates are measured over one second."""
    settings = _settings(config_path, redis_url, namespace)
    if as_json and every is not None:
        raise BadInput("--json prints one sample; drop --watch")

    async def go(client: StoreClient) -> None:
        async with front_desk(settings, client, ray_address) as desk:
            if not isinstance(desk, Runtime):
                raise BadInput(
                    f"no deployment serves namespace {settings.redis.namespace!r} (nothing "
                    "holds it, or a command that runs turns in its own process does): start "
                    "one with phaseline serve"
                )
            if as_json:
                out.print_json(json.dumps((await deployment_status(desk)).as_dict()))
                return
            if every is None:
                out.print(render(await deployment_status(desk)))
                return
            with Live(render(await deployment_status(desk)), console=out) as live:
                while True:
                    live.update(render(await deployment_status(desk, sample_s=every)))

    with contextlib.suppress(KeyboardInterrupt):
        _run(go, settings)
