"""Running a tool batch under the ledger, so a resumed turn never repeats a finished call.

:class:`BatchExecutor` holds the ledger rules (pure decisions over ledger entries plus the
writes that journal them); a :class:`ToolRunner` does the actual execution, in this process
(:class:`LocalToolRunner`) or on the cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from actors.tools import EffectSink, ToolContext, ToolRegistry, ToolSpec
from bus.errors import StoreError, UnknownTool
from store.ledger import ToolLedger, call_key
from store.records import LedgerEntry, LedgerState, ToolCall, ToolResult, ToolStatus

log = logging.getLogger(__name__)


class ToolRunner(Protocol):
    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        """Execute one call; never raise for a tool's own failure, return its result instead."""
        ...


#: Attempts of an idempotent call whose executor failed under it (worker died, Redis dropped).
IDEMPOTENT_ATTEMPTS = 3


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


class LocalToolRunner:
    """Runs tools as asyncio tasks in this process, with per-tool concurrency and timeout.

    A tool that fails because the store under it failed (``StoreError``) is an infrastructure
    failure, not the tool's answer: an idempotent tool is retried, a non-idempotent one is
    reported ``outcome_unknown``.
    """

    def __init__(self) -> None:
        self._limits: dict[str, asyncio.Semaphore] = {}

    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        limit = self._limits.setdefault(spec.name, asyncio.Semaphore(spec.max_concurrency))
        attempts = IDEMPOTENT_ATTEMPTS if spec.idempotent else 1
        async with limit:
            for attempt in range(attempts):
                try:
                    output = await asyncio.wait_for(spec.fn(call.args, ctx), spec.timeout_s)
                    return tool_result(call, "ok", output)
                except asyncio.TimeoutError:
                    return timed_out(call, spec)
                except StoreError as exc:
                    log.warning("tool %s lost its store (attempt %d): %s", call.name, attempt, exc)
                    if not spec.idempotent:
                        return lost_call(call, "lost its store mid-call")
                    await asyncio.sleep(0.5 * (attempt + 1))  # backoff before the retry
                except Exception as exc:  # a tool's bug is the model's problem, not the turn's
                    log.info("tool %s failed: %r", call.name, exc)
                    return tool_result(call, "error", f"{type(exc).__name__}: {exc}")
        return tool_result(
            call, "error", f"{call.name}: its store kept failing ({attempts} attempts)"
        )


def resume_verdict(entry: LedgerEntry | None, idempotent: bool) -> str:
    """What to do with a call given its ledger entry: ``reuse``, ``unknown`` or ``run``."""
    if entry is None or entry.state == "prepared":
        return "run"
    if entry.result is not None and entry.state in ("committed", "failed", "outcome_unknown"):
        return "reuse"
    # dispatched: it was in flight when its host died.
    return "run" if idempotent else "unknown"


class BatchExecutor:
    """Runs one batch: journal, reuse what the ledger already has, run the rest concurrently."""

    def __init__(
        self,
        registry: ToolRegistry,
        runner: ToolRunner,
        ledger: ToolLedger,
        effects: EffectSink | None,
    ) -> None:
        self.registry = registry
        self.runner = runner
        self.ledger = ledger
        self.effects = effects

    def keys_for(self, turn_id: str, batch: int, calls: Sequence[ToolCall]) -> list[str]:
        return [call_key(turn_id, batch, c.name, c.args, i) for i, c in enumerate(calls)]

    async def run_batch(
        self,
        turn_id: str,
        batch: int,
        calls: Sequence[ToolCall],
        denied: frozenset[int] = frozenset(),
    ) -> list[ToolResult]:
        """Journal, decide per call from the ledger, run what must run; results in order.

        Round trips: one to journal ``prepared`` and read prior entries, one to mark every
        runnable call ``dispatched``, then one per call as it finishes.
        """
        keys = self.keys_for(turn_id, batch, calls)
        entries = await self.ledger.prepare(
            turn_id, [(k, c.name) for k, c in zip(keys, calls, strict=True)]
        )
        results: list[ToolResult | None] = [None] * len(calls)
        settled: dict[str, tuple[LedgerState, str, ToolResult | None]] = {}
        runnable: list[tuple[int, ToolSpec]] = []
        for i, (key, call) in enumerate(zip(keys, calls, strict=True)):
            decided = self._decide(call, entries[key], i in denied)
            if isinstance(decided, ToolSpec):
                runnable.append((i, decided))
                continue
            state, res = decided
            results[i] = res
            if state is not None:
                settled[key] = (state, call.name, res)
        journal = dict(settled)
        journal.update({keys[i]: ("dispatched", calls[i].name, None) for i, _ in runnable})
        if journal:
            await self.ledger.mark(turn_id, journal)
        for (i, _), res in zip(
            runnable,
            await asyncio.gather(
                *(self._run(turn_id, keys[i], calls[i], spec) for i, spec in runnable)
            ),
            strict=True,
        ):
            results[i] = res
        return [r for r in results if r is not None]

    def _decide(
        self, call: ToolCall, entry: LedgerEntry, denied: bool
    ) -> ToolSpec | tuple[LedgerState | None, ToolResult]:
        """Pure: run it (its spec), or its result and the ledger state to journal (None: keep)."""

        try:
            spec = self.registry.get(call.name)
        except UnknownTool as exc:
            return "failed", tool_result(call, "error", str(exc))
        verdict = resume_verdict(entry, spec.idempotent)
        if verdict == "reuse":
            assert entry.result is not None
            # The model-assigned call id may differ on replay; the outcome is what is reused.
            return None, entry.result.model_copy(update={"call_id": call.id})
        if verdict == "unknown":
            return "outcome_unknown", lost_call(call, "was running when its host died")
        if denied:
            return "committed", tool_result(call, "denied", f"{call.name} was not approved")
        return spec

    async def _run(self, turn_id: str, key: str, call: ToolCall, spec: ToolSpec) -> ToolResult:
        res = await self.runner.run(spec, call, ToolContext(turn_id, key, self.effects))
        state: LedgerState = "committed" if res.status == "ok" else "failed"
        if res.status == "outcome_unknown":
            state = "outcome_unknown"
        await self.ledger.mark(turn_id, {key: (state, call.name, res)})
        return res
