"""The ``on_finish`` hook: user code told of every turn the moment its final record is saved,
for those who archive (or bill, or notify) continuously rather than with ``phaseline export``.

Named by import path (``[retention] on_finish = "pkg.mod:fn"``) so every host of a deployment
loads it, or passed to :class:`~actors.engine.turn_engine.TurnEngine` in process. ``fn`` takes
a :class:`~store.views.archive.FinishedTurn` and may be a coroutine function. It runs in the host
that ended the turn, after the save: at most once per turn (a host that dies between the save
and the call does not call it; ``phaseline export --since`` catches up), and its failure is
logged and counted, never the turn's. It runs inside that turn's task, so a slow hook delays
only that task's end: hand long work off.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import cast

from actors.engine.imports import load_by_path
from bus.errors import ConfigError, StoreError
from store.domain.ledger import ToolLedger
from store.records import CheckpointRecord
from store.views.archive import FinishedTurn

__all__ = ["OnFinish", "call_on_finish", "load_on_finish", "on_finish_of"]

log = logging.getLogger(__name__)

OnFinish = Callable[[FinishedTurn], Awaitable[None] | None]
"""What the hook is: a function (or coroutine function) of the finished turn."""


def load_on_finish(path: str) -> OnFinish:
    """The hook at ``path`` (:class:`ConfigError` if it does not load or is not callable)."""
    hook = load_by_path(path, "on_finish hook")
    if not callable(hook):
        raise ConfigError(f"on_finish hook {path!r} is a {type(hook).__name__}, not a function")
    return cast(OnFinish, hook)


async def call_on_finish(hook: OnFinish, turn: FinishedTurn) -> bool:
    """Call ``hook``; False (and a logged traceback) if it raised."""
    try:
        result = hook(turn)
        if inspect.isawaitable(result):
            await result
    except Exception:  # the user's code: its failure is reported, never the turn's
        log.exception("on_finish hook failed for turn %s", turn.turn_id)
        return False
    return True


async def on_finish_of(hook: OnFinish, final: CheckpointRecord, ledger: ToolLedger) -> bool:
    """Call ``hook`` with a turn that ended here (its final record and its ledger); False if
    its ledger could not be read or the hook raised (each logged)."""
    try:
        entries = await ledger.entries(final.turn_id)
    except StoreError as exc:
        log.error(
            "on_finish of turn %s not called, its ledger is unreadable: %s", final.turn_id, exc
        )
        return False
    return await call_on_finish(hook, FinishedTurn(final, entries))
