"""The operator's verbs on turns: list them, export and purge, cancel, inject, and decide
approvals; each is a call of the front desk (``actors.engine.front_desk``).

Each works against Redis alone (the durable request is honoured by whichever incarnation owns
the turn); ``cancel`` also tells the deployment that serves the namespace at once (found from
its owner record, or ``--ray-address``), so an in-flight model call ends instead of finishing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from actors.cli.app import (
    BadInput,
    _common,
    _run,
    _settings,
    console,
    count,
    front_desk,
    main,
    out,
    whoami,
)
from actors.engine.cancel import Cancelled
from actors.engine.front_desk import FrontDesk, Waiting
from actors.engine.settings.config import Settings
from bus.phase import TurnPhase
from store.codec import dump_model
from store.keys import check_turn_id
from store.redis.connection import StoreClient
from store.views.summaries import MAX_LOOKBACK_S, TurnFilter, TurnPage

__all__ = ["approvals", "approve", "cancel", "deny", "export", "inject", "purge", "turns"]

#: Characters of arguments or a message shown in a table cell.
CELL = 80


def _ray_address_option(what: str) -> Callable[[Any], Any]:
    return click.option(
        "--ray-address",
        default=None,
        help=f"The deployment's Ray cluster ({what}); default: the one the namespace's owner "
        "record in Redis names. With none, the durable request is honoured at the "
        "turn's next boundary.",
    )


def _age(ms: int) -> str:
    if not ms:
        return "-"
    s = max(0.0, time.time() - ms / 1000)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


# -- turns ------------------------------------------------------------------------------------


@main.command()
@_common
@click.option("--session", default=None, help="Only this session's turns.")
@click.option("--agent", default=None, help="Only this agent's turns (its import path).")
@click.option(
    "--outcome",
    default=None,
    help="Only turns that ended so (answered, cancelled, aborted, aborted:retryable, "
    "suspended ...).",
)
@click.option(
    "--phase",
    type=click.Choice([p.value for p in TurnPhase]),
    default=None,
    help="Only running turns in this phase.",
)
@click.option(
    "--since",
    "since_s",
    type=click.FloatRange(0, MAX_LOOKBACK_S),
    default=None,
    help="Only turns submitted in the last SECONDS.",
)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per turn.")
def turns(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    session: str | None,
    agent: str | None,
    outcome: str | None,
    phase: str | None,
    since_s: float | None,
    limit: int,
    as_json: bool,
) -> None:
    """List turns, newest first (from the turns index, not a scan of the keyspace): status,
    agent, tokens and the last error of each."""
    settings = _settings(config_path, redis_url, namespace)
    since_ms = 0 if since_s is None else int((time.time() - since_s) * 1000)
    try:
        where = TurnFilter(
            session=session,
            agent=agent,
            outcome=outcome,
            since_ms=since_ms,
            phase=None if phase is None else TurnPhase(phase),
        )
    except ValueError as exc:
        raise BadInput(str(exc)) from None

    async def go(client: StoreClient) -> TurnPage:
        return await FrontDesk(client, settings).page(
            where, limit=limit, scan=max(5000, 20 * limit)
        )

    page = _run(go, settings)
    if as_json:
        for row in page.rows:
            click.echo(
                json.dumps(
                    {
                        "turn_id": row.turn_id,
                        "session_id": row.session_id,
                        "agent": row.agent,
                        "submitted_at_ms": row.submitted_at_ms,
                        "in_progress": row.in_progress,
                        "phase": row.phase.value,
                        "outcome": row.outcome,
                        "tokens": row.tokens,
                        "resumes": row.resumes,
                        "last_error": None
                        if row.last_error is None
                        else dump_model(row.last_error),
                    }
                )
            )
        return
    table = Table(title=f"turns of namespace {settings.redis.namespace!r}")
    for col in ("turn", "submitted", "status", "agent", "tokens", "resumes", "last error"):
        table.add_column(col, justify="right" if col in ("tokens", "resumes") else "left")
    for row in page.rows:
        error = "" if row.last_error is None else escape(row.last_error.line()[:CELL])
        table.add_row(
            row.turn_id,
            _age(row.submitted_at_ms) + " ago",
            row.status,
            row.agent or "-",
            f"{row.tokens:,}",
            str(row.resumes),
            error,
        )
    out.print(table)
    if not page.rows:
        console.print("[dim]no turn matches")
    if page.next is not None and len(page.rows) < limit:
        console.print(f"[dim]stopped after {page.scanned:,} turns; older ones were not read")


def _where(session: str | None, outcome: str | None, since_ms: int) -> TurnFilter:
    try:
        return TurnFilter(session=session, outcome=outcome, since_ms=since_ms)
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def _finished_filters(fn: Any) -> Any:
    ended_so = "Only turns that ended so (answered, cancelled, aborted, ...)."
    fn = click.option("--outcome", default=None, help=ended_so)(fn)
    fn = click.option("--session", default=None, help="Only this session's turns.")(fn)
    return fn


@main.command()
@_common
@_finished_filters
@click.option(
    "--since",
    "since_s",
    type=click.FloatRange(0, MAX_LOOKBACK_S),
    default=None,
    help="Only turns submitted in the last SECONDS.",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    required=True,
    help="The JSON Lines file to write ('-': standard output).",
)
def export(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    session: str | None,
    outcome: str | None,
    since_s: float | None,
    output: str,
) -> None:
    """Write finished turns as JSON Lines, one turn a line, as they are read: the record
    (transcript, meta, counters, outcome, last error) and its tool ledger. Archive before
    [retention] finished_ttl_s lets them expire, or before phaseline purge."""
    settings = _settings(config_path, redis_url, namespace)
    since_ms = 0 if since_s is None else int((time.time() - since_s) * 1000)

    where = _where(session, outcome, since_ms)

    async def go(client: StoreClient) -> int:
        with click.open_file(output, "w", encoding="utf-8") as sink:
            return await FrontDesk(client, settings).export(where, sink)

    written = _run(go, settings)
    console.print(f"[dim]exported {count(written, 'finished turn')} to {output}")


@main.command()
@_common
@_finished_filters
@click.option(
    "--older-than",
    "older_s",
    type=click.FloatRange(0, MAX_LOOKBACK_S),
    default=None,
    help="Only turns whose last save is older than SECONDS.",
)
@click.option("--all", "everything", is_flag=True, help="Every finished turn (no filter).")
@click.option("--dry-run", is_flag=True, help="Say what would go; remove nothing.")
def purge(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    session: str | None,
    outcome: str | None,
    older_s: float | None,
    everything: bool,
    dry_run: bool,
) -> None:
    """Remove finished turns now: every key of each (record, transcript, spec, ledger,
    effects, inbox, approvals, live stream) and its index entry, in one step per turn. A turn
    in progress is never removed, nor a suspended one (it waits for phaseline resume) unless
    --outcome names its suspension. Give a filter, or --all."""
    settings = _settings(config_path, redis_url, namespace)
    if not (everything or session or outcome or older_s is not None):
        raise BadInput("say which finished turns: --older-than, --session, --outcome, or --all")
    cutoff = None if older_s is None else int((time.time() - older_s) * 1000)
    where = _where(session, outcome, 0)

    async def go(client: StoreClient) -> tuple[int, int]:
        desk = FrontDesk(client, settings)
        chosen = await desk.purgeable(where, older_than_ms=cutoff)  # first: purging moves pages
        return len(chosen), 0 if dry_run else await desk.purge(chosen)

    chosen, removed = _run(go, settings)
    if dry_run:
        out.print(f"{count(chosen, 'finished turn')} would be removed", highlight=False)
    else:
        out.print(f"removed {count(removed, 'finished turn')}", highlight=False)


# -- cancel and inject ------------------------------------------------------------------------


@main.command()
@_common
@click.argument("turn_ids", nargs=-1, required=True)
@click.option("--reason", default="", help="Why (kept in the turn's record).")
@_ray_address_option("an in-flight model call is cancelled now")
def cancel(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_ids: tuple[str, ...],
    reason: str,
    ray_address: str | None,
) -> None:
    """Cancel turns: each ends ``cancelled`` at its next boundary (tools in flight finish and
    are journaled first), by whichever incarnation owns it, also one that resumes after a
    crash; its session is free again. A suspended turn ends at once."""
    settings = _settings(config_path, redis_url, namespace)
    for tid in turn_ids:
        check_turn_id(tid)
    by = whoami()

    async def go(client: StoreClient) -> dict[str, Cancelled]:
        async with front_desk(settings, client, ray_address) as desk:
            return {t: await desk.cancel(t, reason, by=by) for t in turn_ids}

    for tid, done in _run(go, settings).items():
        out.print(
            f"{tid}: ended, cancelled (it was suspended)"
            if done is Cancelled.ENDED
            else f"{tid}: cancel requested; it ends at its next boundary",
            highlight=False,
        )


@main.command()
@_common
@click.argument("turn_id")
@click.argument("text")
def inject(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_id: str,
    text: str,
) -> None:
    """Send a running turn a user message: it enters the transcript at the turn's next
    boundary, exactly once (also after a crash). Refused for a turn that is not in progress."""
    settings = _settings(config_path, redis_url, namespace)

    async def go(client: StoreClient) -> str:
        item = await FrontDesk(client, settings).inject(turn_id, text, by=whoami())
        return item.message_id

    message_id = _run(go, settings)
    out.print(message_id, highlight=False)
    console.print(f"[dim]queued for turn {turn_id}: it enters at the turn's next boundary")


# -- approvals --------------------------------------------------------------------------------


@main.command()
@_common
@click.option("--turn", "turn_id", default=None, help="Only this turn's calls.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per call.")
def approvals(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_id: str | None,
    as_json: bool,
) -> None:
    """List tool calls waiting for a decision: turn, call, tool, arguments and age. Decide with
    phaseline approve / deny TURN CALL (a unique start of the call key will do)."""
    settings = _settings(config_path, redis_url, namespace)

    async def go(client: StoreClient) -> list[Waiting]:
        return await FrontDesk(client, settings).waiting(turn_id)

    waiting = _run(go, settings)
    if as_json:
        for w in waiting:
            click.echo(
                json.dumps({"turn_id": w.turn_id, "call": w.call_key, **dump_model(w.approval)})
            )
        return
    table = Table(title="calls waiting for a decision")
    for col in ("turn", "call", "tool", "arguments", "waiting"):
        table.add_column(col, no_wrap=col == "call", overflow="fold")  # a key is copied whole
    for w in waiting:
        a = w.approval
        table.add_row(
            w.turn_id, w.call_key, a.tool or "?", escape(a.args[:CELL]), _age(a.asked_at_ms)
        )
    out.print(table)
    if not waiting:
        console.print("[dim]nothing waits for a decision")


def _decide(settings: Settings, turn_id: str, call: str, approve: bool, reason: str) -> None:
    async def go(client: StoreClient) -> str:
        return await FrontDesk(client, settings).decide(
            turn_id, call, approve, by=whoami(), reason=reason
        )

    key = _run(go, settings)
    verb = "approved" if approve else "denied"
    out.print(f"{turn_id} {key}: {verb}", highlight=False)


@main.command()
@_common
@click.argument("turn_id")
@click.argument("call")
@click.option("--reason", default="", help="Why (kept with the call's result).")
def approve(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_id: str,
    call: str,
    reason: str,
) -> None:
    """Approve a waiting tool call (CALL: its key, or a unique start of it)."""
    _decide(_settings(config_path, redis_url, namespace), turn_id, call, True, reason)


@main.command()
@_common
@click.argument("turn_id")
@click.argument("call")
@click.option("--reason", default="", help="Why (the model reads it in the call's result).")
def deny(
    redis_url: str | None,
    namespace: str | None,
    config_path: str | None,
    turn_id: str,
    call: str,
    reason: str,
) -> None:
    """Deny a waiting tool call (CALL: its key, or a unique start of it)."""
    _decide(_settings(config_path, redis_url, namespace), turn_id, call, False, reason)
