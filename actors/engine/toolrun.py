"""Running a tool batch under the ledger, so a resumed turn never repeats a finished call.

:class:`BatchExecutor` holds the ledger rules (pure decisions over ledger entries plus the
writes that journal them); a :class:`ToolRunner` does the actual execution, in this process
(:class:`LocalToolRunner`) or on the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Protocol, TypeVar

from actors.engine.mcp import mcp_registry
from actors.turn.agent import Agent
from actors.turn.tools import EffectSink, ToolContext, ToolRegistry, ToolSpec
from bus.errors import StoreError, StoreRefused, ToolExecutorLost, UnknownTool
from bus.messages import ToolCall, ToolResult, ToolStatus
from store.codec import pack_model
from store.ledger import Change, Ledger, call_key
from store.records import LedgerEntry, LedgerState, TurnInput

log = logging.getLogger(__name__)


class ToolRunner(Protocol):
    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        """Execute one call; never raise for a tool's own failure, return its result instead."""
        ...

    async def registry(self, agent_path: str, agent: Agent, turn_input: TurnInput) -> ToolRegistry:
        """The tools of a turn of ``agent``: its own, and its MCP servers' as listed where the
        calls run (:class:`ConfigError` for a name given twice)."""
        ...


#: Rounds of deciding a batch again after losing compare-and-sets to a racing owner. An entry
#: only moves forward (prepared -> dispatched -> settled), so two rounds always suffice.
_DECIDE_ROUNDS = 3


def _now_ms() -> int:
    return int(time.time() * 1000)


#: Attempts of an idempotent call whose executor failed under it (worker died, Redis dropped).
IDEMPOTENT_ATTEMPTS = 3


def tool_result(call: ToolCall, status: ToolStatus, output: str) -> ToolResult:
    """The result of ``call`` as the model will read it."""
    return ToolResult(call_id=call.id, name=call.name, status=status, output=output)


def timed_out(call: ToolCall, spec: ToolSpec) -> ToolResult:
    return tool_result(call, "timeout", f"{call.name} timed out after {spec.timeout_s:g} s")


#: Waits before each new try of a write Redis refused (it ran nothing: trying again is safe).
REFUSED_BACKOFF_S = (0.5, 1.0, 2.0)

_T = TypeVar("_T")


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


def not_run(call: ToolCall, exc: StoreRefused) -> ToolResult:
    """The result of a call whose effect Redis refused to write every time it was tried: it is
    known not to have happened, which the model is told (it may call it again)."""
    return tool_result(
        call, "error", f"{call.name} was not run: the store refused its write ({exc}); it had no "
        "effect",
    )  # fmt: skip


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
    reported ``outcome_unknown``. A write Redis refused (:class:`StoreRefused`) did not happen,
    so any tool is tried again, and reported not run if it stays refused.
    """

    def __init__(self) -> None:
        self._limits: dict[str, asyncio.Semaphore] = {}

    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        limit = self._limits.setdefault(spec.name, asyncio.Semaphore(spec.max_concurrency))
        async with limit:
            try:
                return await refusals_waited(
                    f"write {call.name}'s effect", lambda: self._attempts(spec, call, ctx)
                )
            except StoreRefused as exc:
                return not_run(call, exc)

    async def _attempts(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        """Run the call, again if it is idempotent and its executor failed under it; a
        refusal (:class:`StoreRefused`) is raised: the call is known not to have run."""
        attempts = IDEMPOTENT_ATTEMPTS if spec.idempotent else 1
        for attempt in range(attempts):
            try:
                output = await asyncio.wait_for(spec.fn(call.args, ctx), spec.timeout_s)
                return tool_result(call, "ok", output)
            except TimeoutError:
                return timed_out(call, spec)
            except StoreRefused:
                raise
            except (StoreError, ToolExecutorLost) as exc:
                log.warning("tool %s lost its executor (attempt %d): %s", call.name, attempt, exc)
                if not spec.idempotent:
                    return lost_call(call, lost_why(exc))
                await asyncio.sleep(0.5 * (attempt + 1))  # backoff before the retry
            except Exception as exc:  # a tool's bug is the model's problem, not the turn's
                log.info("tool %s failed: %r", call.name, exc)
                return tool_result(call, "error", f"{type(exc).__name__}: {exc}")
        return tool_result(
            call, "error", f"{call.name}: its executor kept failing ({attempts} attempts)"
        )

    async def registry(self, agent_path: str, agent: Agent, turn_input: TurnInput) -> ToolRegistry:
        base = agent.registry(turn_input)
        return await mcp_registry(agent_path, base, agent.mcp) if agent.mcp else base


def lost_why(exc: Exception) -> str:
    """How a non-idempotent call's ``outcome_unknown`` result says what failed under it."""
    if isinstance(exc, ToolExecutorLost):
        return "lost its MCP server mid-call"
    return "lost its store mid-call"


def resume_verdict(entry: LedgerEntry | None, idempotent: bool) -> str:
    """What to do with a call given its ledger entry: ``reuse``, ``unknown`` or ``run``."""
    if entry is None or entry.state == "prepared":
        return "run"
    if entry.result is not None and entry.state in ("committed", "failed", "outcome_unknown"):
        return "reuse"
    # dispatched: it was in flight when its host died.
    return "run" if idempotent else "unknown"


#: Default cap on one tool result's UTF-8 bytes (``[checkpoint] max_tool_result_bytes``).
DEFAULT_MAX_TOOL_RESULT_BYTES = 1 << 20


def capped(res: ToolResult, limit: int) -> ToolResult:
    """``res``, or an error result in its place if its output is over ``limit`` bytes: the
    call fails, not its turn, and the model reads how large it was."""
    size = len(res.output.encode("utf-8"))
    if size <= limit:
        return res
    return res.model_copy(
        update={
            "status": "error",
            "output": f"{res.name} returned {size:,} bytes, over the limit of {limit:,} bytes "
            "for one tool result; ask for less (a page, a summary, a range)",
        }
    )


class BatchExecutor:
    """Runs one batch: journal, reuse what the ledger already has, run the rest concurrently."""

    def __init__(
        self,
        registry: ToolRegistry,
        runner: ToolRunner,
        ledger: Ledger,
        effects: EffectSink | None,
        *,
        agent: str = "",
        max_result_bytes: int = DEFAULT_MAX_TOOL_RESULT_BYTES,
    ) -> None:
        """``agent``: import path of the agent whose tools these are (a ToolWorker on another
        process loads the tool from it); ``max_result_bytes``: the cap on one result."""
        self.max_result_bytes = max_result_bytes
        self.registry = registry
        self.runner = runner
        self.ledger = ledger
        self.effects = effects
        self.agent = agent

    def keys_for(self, turn_id: str, batch: int, calls: Sequence[ToolCall]) -> list[str]:
        return [call_key(turn_id, batch, c.name, c.args, i) for i, c in enumerate(calls)]

    async def run_batch(
        self,
        turn_id: str,
        epoch: int,
        batch: int,
        calls: Sequence[ToolCall],
        denied: Mapping[int, str] | None = None,
    ) -> list[ToolResult]:
        """Journal, decide per call from the ledger, run what must run; results in order.

        The owner's decisions (``dispatched`` for what runs, the settled state of what does
        not) are one compare-and-set fenced on ``epoch``: a fenced owner gets
        :class:`~bus.errors.StaleOwner` and runs nothing; a call whose entry changed since it
        was read (a racing owner dispatched or settled it) is decided again from what won.
        Round trips: one to journal ``prepared`` and read prior entries, one for the fenced
        step, then one per call as it finishes.
        """
        keys = self.keys_for(turn_id, batch, calls)
        named = [(k, c.name) for k, c in zip(keys, calls, strict=True)]
        reads = await refusals_waited(
            f"journal batch {batch} of {turn_id}", partial(self.ledger.prepare, turn_id, named)
        )
        results: list[ToolResult | None] = [None] * len(calls)
        runnable: dict[int, tuple[ToolSpec, bytes]] = {}
        pending = dict(enumerate(keys))
        for _ in range(_DECIDE_ROUNDS):
            changes: dict[str, Change] = {}
            for i, key in pending.items():
                decided = self._decide(calls[i], reads[key].entry, (denied or {}).get(i))
                if isinstance(decided, ToolSpec):
                    entry = LedgerEntry(
                        state="dispatched", name=calls[i].name, updated_at=_now_ms(),
                        epoch=epoch, writer=uuid.uuid4().hex,
                    )  # fmt: skip
                    changes[key] = Change(reads[key].raw, entry)
                    runnable[i] = (decided, pack_model(entry))
                    continue
                state, res = decided
                results[i] = res
                if state is not None:
                    entry = LedgerEntry(
                        state=state, name=calls[i].name, result=res, updated_at=_now_ms(),
                        epoch=epoch, writer=uuid.uuid4().hex,
                    )  # fmt: skip
                    changes[key] = Change(reads[key].raw, entry)
            won = await refusals_waited(
                f"dispatch batch {batch} of {turn_id}",
                partial(self.ledger.transition, turn_id, changes, epoch=epoch),
            )
            lost = {i: k for i, k in pending.items() if k in won and not won[k]}
            if not lost:
                break
            # Another owner changed these entries since we read them: decide again from theirs.
            for i in lost:
                runnable.pop(i, None)
                results[i] = None
            reads.update(await self.ledger.get_many(turn_id, list(lost.values())))
            pending = lost
        else:
            raise StoreError(f"turn {turn_id}: ledger of batch {batch} kept changing under it")
        for i, res in zip(
            runnable,
            await asyncio.gather(
                *(
                    self._run(turn_id, keys[i], calls[i], spec, dispatched)
                    for i, (spec, dispatched) in runnable.items()
                )
            ),
            strict=True,
        ):
            results[i] = res
        return [r for r in results if r is not None]

    def _decide(
        self, call: ToolCall, entry: LedgerEntry, denied: str | None
    ) -> ToolSpec | tuple[LedgerState | None, ToolResult]:
        """Pure: run it (its spec), or its result and the ledger state to journal (None: keep).
        ``denied``: the decision that refused the call (None: it may run)."""

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
        if denied is not None:
            return "committed", tool_result(
                call, "denied", f"{call.name} was not approved: {denied}"
            )
        return spec

    async def _run(
        self, turn_id: str, key: str, call: ToolCall, spec: ToolSpec, dispatched: bytes
    ) -> ToolResult:
        res = capped(
            await self.runner.run(
                spec, call, ToolContext(turn_id, key, self.effects, agent=self.agent)
            ),
            self.max_result_bytes,
        )
        state: LedgerState = "committed" if res.status == "ok" else "failed"
        if res.status == "outcome_unknown":
            state = "outcome_unknown"
        # Not fenced: the call ran, so its outcome is true whoever owns the turn now. Compared
        # with our own dispatch, so it never overwrites what a successor settled meanwhile.
        entry = LedgerEntry(
            state=state, name=call.name, result=res, updated_at=_now_ms(),
            writer=uuid.uuid4().hex,
        )  # fmt: skip
        try:
            settle = {key: Change(dispatched, entry)}
            won = await refusals_waited(
                f"journal the outcome of {key}",
                partial(self.ledger.transition, turn_id, settle, epoch=None),
            )
        except StoreError as exc:
            # The model still reads the result; the batch's checkpoint keeps it. Only a resume
            # from before that checkpoint finds the call dispatched (and re-runs it if it is
            # idempotent, else reports it outcome_unknown): true, as its result is lost then.
            log.warning("turn %s: outcome of %s not journaled: %s", turn_id, key, exc)
            return res
        if not won[key]:
            log.warning(
                "turn %s: outcome of %s not journaled: a successor settled it", turn_id, key
            )
        return res
