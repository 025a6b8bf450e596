"""Running a tool batch under the ledger, so a resumed turn never repeats a finished call.

:class:`BatchExecutor` holds the ledger rules (pure decisions over ledger entries plus the
writes that journal them); a :class:`ToolRunner` does the actual execution, in this process
(``actors.engine.tools.local_tools``) or on the cluster (``actors.cluster.tool_workers``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from actors.engine.tools.call_ends import lost_call, refusals_waited, tool_result
from actors.turn.agent import Agent
from actors.turn.deps import BatchRun
from actors.turn.loop_state import new_id
from actors.turn.tools import EffectSink, ToolContext, ToolRegistry, ToolSpec
from bus.errors import StoreError, UnknownTool
from bus.messages import ToolCall, ToolResult
from store.codec import DEFAULT_MAX_RECORD_BYTES, check_record_size, pack_model
from store.domain.ledger import Change, Claim, Ledger, LedgerRead, call_key
from store.records import LedgerEntry, LedgerState, ReplyJournal, Settle, TurnInput

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolJob:
    """One dispatched call handed to a :class:`ToolRunner`."""

    spec: ToolSpec
    """The tool, as the turn's registry has it (timeout, flags, resources)."""
    call: ToolCall
    """The model's call."""
    ctx: ToolContext
    """What the tool is given: its turn, its call key, the effect sink."""


class ToolRunner(Protocol):
    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        """Execute one call; never raise for a tool's own failure, return its result instead."""
        ...

    async def run_group(self, jobs: Sequence[ToolJob]) -> list[ToolResult]:
        """Execute several calls of one batch; their results in order, once all have ended.
        A runner may send them together (one message instead of one each), so the batch
        executor hands it only calls whose early result it need not journal at once: calls of
        idempotent tools, which a resume runs again anyway if their outcome was not kept."""
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
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        """``agent``: import path of the agent whose tools these are (a ToolWorker on another
        process loads the tool from it); ``max_result_bytes``: the cap on one result;
        ``max_record_bytes``: the cap on a journaled reply, the same as on a record."""
        self.max_result_bytes = max_result_bytes
        self.max_record_bytes = max_record_bytes
        self.registry = registry
        self.runner = runner
        self.ledger = ledger
        self.effects = effects
        self.agent = agent

    def keys_for(self, turn_id: str, batch: int, calls: Sequence[ToolCall]) -> list[str]:
        return [call_key(turn_id, batch, c, i) for i, c in enumerate(calls)]

    async def run_batch(
        self,
        turn_id: str,
        epoch: int,
        batch: int,
        calls: Sequence[ToolCall],
        denied: Mapping[int, str] | None = None,
        *,
        keys: Sequence[str] | None = None,
        defer: bool = False,
        reply: ReplyJournal | None = None,
    ) -> BatchRun:
        """Journal, decide per call from the ledger, run what must run; results in order.

        ``reply``: the model reply that asked for the batch, journaled by the claim itself
        (before any call is dispatched, fenced with it, no round trip of its own);
        :class:`~bus.errors.RecordTooLarge` or :class:`~bus.errors.UnstorableRecord` when it
        cannot be, and then nothing of the batch was journaled or run.

        The owner's decisions (``dispatched`` for what runs, the settled state of what does not) are
        fenced on ``epoch``: a fenced owner gets :class:`~bus.errors.StaleOwner` and runs nothing. A
        batch's new calls are claimed in one script with the fence check
        (:meth:`~store.domain.ledger.ToolLedger.claim`); a call the ledger already holds (a resume,
        a racing owner) is decided from its entry and moved by a compare-and-set, decided again from
        what won if another owner changed it meanwhile. The calls of idempotent tools run as one
        group (:meth:`ToolRunner.run_group`), the others each alone. Round trips: one for the claim
        (two when the ledger held some of the calls), then one per call (or group) as it finishes
        while others of the batch still run. The calls that finish last (none other still running)
        journal their outcome the same way, unless ``defer``: then it is returned with the results
        (:class:`~actors.turn.deps.BatchRun`), and the checkpoint after the batch journals it (so a
        crash before that checkpoint loses no more than the outcome's own write would: the batch's
        results are not in any checkpoint yet either); so is an outcome whose own write failed.
        ``keys``: the calls' keys if the caller has them already (:meth:`keys_for`)."""
        keys = list(keys) if keys is not None else self.keys_for(turn_id, batch, calls)
        refused = denied or {}
        results: list[ToolResult | None] = [None] * len(calls)
        runnable: dict[int, tuple[ToolSpec, bytes]] = {}
        claims = []
        fresh: list[ToolSpec | ToolResult] = []  # what each call's claim means if it wins
        for i, (key, call) in enumerate(zip(keys, calls, strict=True)):
            prepared = LedgerEntry(state="prepared", name=call.name, updated_at=_now_ms())
            entry, outcome = self._step(call, None, refused.get(i), epoch)
            assert entry is not None  # a new call always gets an entry
            claims.append(Claim(key, pack_model(prepared), pack_model(entry)))
            fresh.append(outcome)
        packed = b"" if reply is None else self._packed(turn_id, reply)
        held = await refusals_waited(
            f"claim batch {batch} of {turn_id}",
            partial(self.ledger.claim, turn_id, epoch, claims, reply=packed),
        )
        reads: dict[str, LedgerRead] = {}
        for i, (key, claim) in enumerate(zip(keys, claims, strict=True)):
            read = held[key]
            if read is not None:
                reads[key] = read
                continue
            outcome = fresh[i]
            if isinstance(outcome, ToolSpec):
                runnable[i] = (outcome, claim.decided)
            else:
                results[i] = outcome
        if reads:
            await self._decide_held(
                turn_id, epoch, batch, calls, keys, reads, refused, results, runnable
            )
        running = [len(runnable)]  # calls of the batch still running
        left: list[Settle] = []  # outcomes for the checkpoint after the batch to carry

        async def ended(indices: list[int], raw: Sequence[ToolResult]) -> None:
            """Calls that ended together: their results, their outcomes journaled in one
            compare-and-set (or kept for the save if no other call of the batch runs)."""
            running[0] -= len(indices)
            changes: dict[str, Change] = {}
            for i, out in zip(indices, raw, strict=True):
                results[i], entry = self._outcome(calls[i], out)
                changes[keys[i]] = Change(runnable[i][1], entry)
            if defer and not running[0]:
                left.extend(Settle(k, c.expected, pack_model(c.entry)) for k, c in changes.items())
            else:
                left.extend(await self._settle_now(turn_id, changes))

        def job(i: int) -> ToolJob:
            return ToolJob(runnable[i][0], calls[i], self._context(turn_id, keys[i], epoch))

        async def run_one(i: int) -> None:
            one = job(i)
            await ended([i], [await self.runner.run(one.spec, one.call, one.ctx)])

        async def run_group(indices: list[int]) -> None:
            await ended(indices, await self.runner.run_group([job(i) for i in indices]))

        # Calls of idempotent tools go to the runner together: a resume re-runs them anyway if
        # their outcomes were not kept, so journaling the first to end at once would only
        # save a re-run, and one message for the group halves the cost of a two-call batch.
        group = [i for i, (spec, _) in runnable.items() if spec.idempotent]
        group = group if len(group) > 1 else []
        singles = [i for i in runnable if i not in group]
        await asyncio.gather(*(run_one(i) for i in singles), *([run_group(group)] if group else []))
        return BatchRun([r for r in results if r is not None], tuple(left))

    async def journal(self, turn_id: str, epoch: int, reply: ReplyJournal) -> None:
        """Journal ``reply`` on its own, fenced (:class:`StaleOwner`): for a batch that waits
        for approvals first, whose question must not outlive the reply that asked it."""
        packed = self._packed(turn_id, reply)
        await refusals_waited(
            f"journal the reply of {turn_id}",
            partial(self.ledger.claim, turn_id, epoch, [], reply=packed),
        )

    def _packed(self, turn_id: str, reply: ReplyJournal) -> bytes:
        """``reply`` as the claim journals it; :class:`UnstorableRecord` (a value msgpack
        refuses) or :class:`RecordTooLarge` (over the record cap) if it cannot be."""
        packed = pack_model(reply)
        check_record_size(turn_id, len(packed), self.max_record_bytes)
        return packed

    async def _settle_now(self, turn_id: str, changes: dict[str, Change]) -> list[Settle]:
        """Journal outcomes now; those whose write failed come back, for the checkpoint after
        the batch to carry."""
        try:
            won = await refusals_waited(
                f"journal the outcome of {', '.join(changes)}",
                partial(self.ledger.transition, turn_id, changes, epoch=None),
            )
        except StoreError as exc:
            # The model still reads the results, and the checkpoint after the batch journals
            # these outcomes too (handed over with the deferred ones), or the next one that
            # lands: a finished turn's ledger holds every result its transcript does. Only a
            # resume from before that finds the calls dispatched (and re-runs those that are
            # idempotent, else reports them outcome_unknown): true, as their results are lost.
            log.warning("turn %s: outcome of %s not journaled yet: %s", turn_id, list(changes), exc)
            return [Settle(k, c.expected, pack_model(c.entry)) for k, c in changes.items()]
        for key in changes:
            if not won[key]:
                log.warning(
                    "turn %s: outcome of %s not journaled: a successor settled it", turn_id, key
                )
        return []

    def _step(
        self, call: ToolCall, entry: LedgerEntry | None, denied: str | None, epoch: int
    ) -> tuple[LedgerEntry | None, ToolSpec | ToolResult]:
        """The owner's step for one call given its entry (None: the ledger has none): the
        entry to write (None: keep it) and what to do, run (its spec) or answer (a result)."""
        decided = self._decide(call, entry, denied)
        if isinstance(decided, ToolSpec):
            return LedgerEntry(
                state="dispatched",
                name=call.name,
                updated_at=_now_ms(),
                epoch=epoch,
                writer=new_id(),
            ), decided
        state, res = decided
        if state is None:
            return None, res
        return LedgerEntry(
            state=state,
            name=call.name,
            result=res,
            updated_at=_now_ms(),
            epoch=epoch,
            writer=new_id(),
        ), res

    async def _decide_held(
        self,
        turn_id: str,
        epoch: int,
        batch: int,
        calls: Sequence[ToolCall],
        keys: list[str],
        reads: dict[str, LedgerRead],
        denied: Mapping[int, str],
        results: list[ToolResult | None],
        runnable: dict[int, tuple[ToolSpec, bytes]],
    ) -> None:
        """The calls the ledger already held (``reads``): each decided from its entry, the
        decisions one fenced compare-and-set, those that lost decided again from what won.
        Fills ``results`` and ``runnable``."""
        pending = {i: k for i, k in enumerate(keys) if k in reads}
        for _ in range(_DECIDE_ROUNDS):
            changes: dict[str, Change] = {}
            for i, key in pending.items():
                entry, outcome = self._step(calls[i], reads[key].entry, denied.get(i), epoch)
                if entry is not None:
                    changes[key] = Change(reads[key].raw, entry)
                if isinstance(outcome, ToolSpec):
                    assert entry is not None
                    runnable[i] = (outcome, pack_model(entry))
                else:
                    results[i] = outcome
            won = await refusals_waited(
                f"dispatch batch {batch} of {turn_id}",
                partial(self.ledger.transition, turn_id, changes, epoch=epoch),
            )
            lost = {i: k for i, k in pending.items() if k in won and not won[k]}
            if not lost:
                return
            # Another owner changed these entries since we read them: decide again from theirs.
            for i in lost:
                runnable.pop(i, None)
                results[i] = None
            reads.update(await self.ledger.get_many(turn_id, list(lost.values())))
            pending = lost
        raise StoreError(f"turn {turn_id}: ledger of batch {batch} kept changing under it")

    def _decide(
        self, call: ToolCall, entry: LedgerEntry | None, denied: str | None
    ) -> ToolSpec | tuple[LedgerState | None, ToolResult]:
        """Pure: run it (its spec), or its result and the ledger state to journal (None: keep).
        ``denied``: the decision that refused the call (None: it may run)."""
        try:
            spec = self.registry.get(call.name)
        except UnknownTool as exc:
            return "failed", tool_result(call, "error", str(exc))
        verdict = resume_verdict(entry, spec.idempotent)
        if verdict == "reuse":
            assert entry is not None and entry.result is not None
            # The model-assigned call id may differ on replay; the outcome is what is reused.
            return None, entry.result.model_copy(update={"call_id": call.id})
        if verdict == "unknown":
            return "outcome_unknown", lost_call(call, "was running when its host died")
        if denied is not None:
            return "committed", tool_result(
                call, "denied", f"{call.name} was not approved: {denied}"
            )
        return spec

    def _context(self, turn_id: str, key: str, epoch: int) -> ToolContext:
        return ToolContext(turn_id, key, self.effects, agent=self.agent, epoch=epoch)

    def _outcome(self, call: ToolCall, raw: ToolResult) -> tuple[ToolResult, LedgerEntry]:
        """A dispatched call's result as the model reads it, and the journal entry of its
        outcome (not fenced: the call ran, so its outcome is true whoever owns the turn now;
        compared with our own dispatch, so it never overwrites what a successor settled
        meanwhile)."""
        res = capped(raw, self.max_result_bytes)
        state: LedgerState = "committed" if res.status == "ok" else "failed"
        if res.status == "outcome_unknown":
            state = "outcome_unknown"
        entry = LedgerEntry(
            state=state,
            name=call.name,
            result=res,
            updated_at=_now_ms(),
            writer=new_id(),
        )
        return res, entry
