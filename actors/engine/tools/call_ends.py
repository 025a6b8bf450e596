"""How a tool call ends, in one mapping for every runner.

An attempt of a call ends as one :class:`CallEnd` with a text, wherever it ran: in this
process (:func:`attempt_here`), on a ToolWorker (which answers the same pair for each call it
is sent, a lone call being a group of one), or not at all because the worker died under it
(the host's :attr:`CallEnd.DIED`). :func:`call_result` then turns a call's attempts into the
result the model reads: it is the one place that decides which endings are the tool's answer,
which are tried again (an idempotent call whose executor failed, a write Redis refused) and
which leave a non-idempotent call's outcome unknown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import TypeVar

from actors.turn.tools import ToolSpec, within_boundary
from bus.errors import StoreError, StoreRefused, ToolExecutorLost
from bus.messages import ToolCall, ToolResult, ToolStatus

__all__ = [
    "IDEMPOTENT_ATTEMPTS",
    "CallEnd",
    "Ending",
    "attempt_here",
    "call_result",
    "lost_call",
    "refusals_waited",
    "timed_out",
    "tool_result",
]

log = logging.getLogger(__name__)

#: Attempts of an idempotent call whose executor failed under it (worker died, Redis dropped).
IDEMPOTENT_ATTEMPTS = 3

#: Waits before each new try of a write Redis refused (it ran nothing: trying again is safe).
REFUSED_BACKOFF_S = (0.5, 1.0, 2.0)

_T = TypeVar("_T")


class CallEnd(StrEnum):
    """How one attempt of a call ended (on the wire from a ToolWorker: its value)."""

    OK = "ok"
    """It returned; the text is its output."""
    ERROR = "error"
    """It raised, or could not be sent: the tool's own failure, the text says which."""
    TIMEOUT = "timeout"
    """It ran past its tool's timeout and was cancelled."""
    LOST = "lost"
    """Its store or MCP server failed under it: it may be run again (if it is idempotent)
    after a backoff; the text says what failed."""
    DIED = "died"
    """Its worker died under it (seen by the host): like :attr:`LOST`, tried again at once
    on a worker that answers."""
    REFUSED = "refused"
    """Redis refused its effect's write: it did not happen, so it may be tried again."""


#: One attempt's end and its text.
Ending = tuple[CallEnd, str]


def tool_result(call: ToolCall, status: ToolStatus, output: str) -> ToolResult:
    """The result of ``call`` as the model will read it."""
    return ToolResult(call_id=call.id, name=call.name, status=status, output=output)


def timed_out(call: ToolCall, spec: ToolSpec) -> ToolResult:
    return tool_result(call, "timeout", f"{call.name} timed out after {spec.timeout_s:g} s")


def lost_call(call: ToolCall, why: str) -> ToolResult:
    """The result of a non-idempotent call whose executor failed under it: nobody can tell
    whether its effect happened, so the model is told so and the call is never re-run."""
    return tool_result(
        call,
        "outcome_unknown",
        f"{call.name} {why}; it may or may not have taken effect and will not be re-run",
    )


async def refusals_waited(what: str, op: Callable[[], Awaitable[_T]]) -> _T:
    """``op()``, tried again after each :class:`StoreRefused` (Redis out of memory, its disk
    failing) along :data:`REFUSED_BACKOFF_S`; the last refusal is raised."""
    for wait in REFUSED_BACKOFF_S:
        try:
            return await op()
        except StoreRefused as exc:
            log.warning("Redis refused to %s; trying again in %g s: %s", what, wait, exc)
            await asyncio.sleep(wait)
    return await op()


async def attempt_here(body: Callable[[], Awaitable[str]], timeout_s: float) -> Ending:
    """Run one attempt of a call in this process, bounded by ``timeout_s``; how it ended. Never
    raises but for a cancel of the caller (a tool's own ``CancelledError`` is its error,
    ``within_boundary``)."""
    try:
        async with asyncio.timeout(timeout_s) as bound:
            return CallEnd.OK, str(await within_boundary(body()))
    except TimeoutError as exc:
        if bound.expired():
            return CallEnd.TIMEOUT, ""
        return CallEnd.ERROR, f"{type(exc).__name__}: {exc}"
    except StoreRefused as exc:
        return CallEnd.REFUSED, str(exc)
    except ToolExecutorLost:
        return CallEnd.LOST, "lost its MCP server mid-call"
    except StoreError:
        return CallEnd.LOST, "lost its store mid-call"
    except Exception as exc:  # a tool's bug is the model's problem, not the turn's
        log.info("tool failed: %r", exc)
        return CallEnd.ERROR, f"{type(exc).__name__}: {exc}"


async def call_result(
    spec: ToolSpec,
    call: ToolCall,
    attempt: Callable[[int], Awaitable[Ending]],
    *,
    first: Ending | None = None,
) -> ToolResult:
    """The result the model reads of ``call``, from its attempts (``attempt(n)`` runs the
    n-th; ``first``: the end of an attempt already made, with a group). An idempotent call whose
    executor failed goes again, up to :data:`IDEMPOTENT_ATTEMPTS`; a non-idempotent one is then
    ``outcome_unknown``. A refused write did not happen: any call is tried again along
    :data:`REFUSED_BACKOFF_S`, and is reported not run if it stays refused."""
    attempts = IDEMPOTENT_ATTEMPTS if spec.idempotent else 1
    known = [first] if first is not None else []

    async def attempts_made() -> ToolResult:
        for n in range(attempts):
            how, text = known.pop() if known else await attempt(n)
            if how is CallEnd.OK:
                return tool_result(call, "ok", text)
            if how is CallEnd.TIMEOUT:
                return timed_out(call, spec)
            if how is CallEnd.ERROR:
                return tool_result(call, "error", text)
            if how is CallEnd.REFUSED:
                raise StoreRefused(text)
            log.warning("tool %s lost its executor (attempt %d): %s", call.name, n, text)
            if not spec.idempotent:
                return lost_call(call, text)
            if how is CallEnd.LOST and n + 1 < attempts:
                await asyncio.sleep(0.5 * (n + 1))  # backoff before the retry
        return tool_result(
            call, "error", f"{call.name}: its executor kept failing ({attempts} attempts)"
        )

    try:
        return await refusals_waited(f"write {call.name}'s effect", attempts_made)
    except StoreRefused as exc:
        return tool_result(
            call,
            "error",
            f"{call.name} was not run: the store refused its write ({exc}); it had no effect",
        )
