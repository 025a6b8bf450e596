"""What a turn loop talks to: every collaborator an interface (a checkpointer, tool batches,
an inbox, an approval desk, probation hooks), gathered in :class:`TurnDeps`, so tests and
engines (in process, on Ray, in memory) swap them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.turn.llm import LLMClient
from actors.turn.tools import ToolRegistry
from bus.events import LiveEvent
from bus.messages import ToolCall, ToolResult
from bus.phase import Listener
from store.records import Approval, CheckpointRecord, InboxItem, ReplyJournal, SaveAck, Settle


class Checkpointer(Protocol):
    """Where records are saved (the store, a CheckpointActor client)."""

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        """Save ``record`` fenced and atomically, journaling ``settles`` (tool outcomes) with
        it, before its fence and whatever the fence says."""
        ...


class TurnCheckpointer(Checkpointer, Protocol):
    """A turn's checkpoints: its saves, and the tool outcomes its batches leave. Each outcome
    is handed over once, with the save after its batch or alone when there is none; this
    alone decides how it is journaled, and keeps one it cannot journal now for the turn's
    next save (the final one at the latest)."""

    async def settle(self, turn_id: str, settles: Sequence[Settle]) -> None:
        """Journal outcomes no save carries (now, or with a later save if Redis fails)."""
        ...


@dataclass(frozen=True, slots=True)
class BatchRun:
    """What a tool batch leaves: its results, and the outcomes not journaled yet."""

    results: list[ToolResult]
    """One per call, in order, as the model reads them."""
    settles: tuple[Settle, ...] = ()
    """Outcomes of calls that ran, for the checkpoint after the batch to carry (a ``defer``
    batch's last ones, and any whose own write failed)."""


class InboxReader(Protocol):
    async def read_from(self, turn_id: str, offset: int) -> list[InboxItem]: ...


class ApprovalDesk(Protocol):
    async def request(
        self, turn_id: str, call_key: str, *, tool: str = "", args: str = ""
    ) -> None: ...
    async def decide(
        self, turn_id: str, call_key: str, approve: bool, *, by: str = "", reason: str = ""
    ) -> bool: ...
    async def decision(self, turn_id: str, call_key: str) -> Approval | None: ...


class ToolBatches(Protocol):
    def keys_for(self, turn_id: str, batch: int, calls: Sequence[ToolCall]) -> list[str]: ...
    async def run_batch(
        self,
        turn_id: str,
        epoch: int,
        batch: int,
        calls: Sequence[ToolCall],
        denied: Mapping[int, str] | None = ...,
        *,
        keys: Sequence[str] | None = ...,
        defer: bool = ...,
        reply: ReplyJournal | None = ...,
    ) -> BatchRun:
        """Run a batch under the ledger; :class:`StaleOwner` when ``epoch`` is fenced.
        ``defer``: the outcomes of the calls that end the batch are not journaled here but
        returned with the results (the checkpoint after the batch carries them);
        ``reply``: the reply that asked for the batch, journaled with its claim, before any
        call runs (:class:`RecordTooLarge`/:class:`UnstorableRecord` if it cannot be)."""
        ...

    async def journal(self, turn_id: str, epoch: int, reply: ReplyJournal) -> None:
        """Journal a reply on its own, fenced (before a batch's approval questions)."""
        ...


class ProbationHooks(Protocol):
    """What a probation run (a turn isolated by the poison-turn policy) reports."""

    async def step(self, step: str) -> None:
        """Durably note the step about to begin (``phase@position``), before it begins: if the
        process dies inside it, the next isolation host reads where."""
        ...

    @property
    def releases(self) -> bool:
        """Still on probation: the run stops (``released``) after its next checkpoint."""
        ...


@dataclass(frozen=True, slots=True)
class TurnDeps:
    """What a loop talks to; every member is an interface, so tests and engines swap them."""

    llm: LLMClient
    """The model."""
    tools: ToolBatches
    """Runs a tool batch under the ledger."""
    registry: ToolRegistry
    """Tool specs (approval flags)."""
    checkpoints: TurnCheckpointer
    """Durable saves (the store, or a CheckpointActor client) and the batches' outcomes."""
    inbox: InboxReader
    """Injected user messages."""
    approvals: ApprovalDesk
    """Approval decisions."""
    listener: Listener | None = None
    """Receives every phase transition (bus publisher, watchdog, progress display)."""
    events: Callable[[LiveEvent], None] | None = None
    """Receives what a watcher of the turn sees besides transitions: streamed text, tool calls
    and results, the restart marker, the final answer (advisory; must not block)."""
