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
    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        """Save ``record`` fenced and atomically, journaling ``settles`` (tool outcomes) with
        it, before its fence and whatever the fence says."""
        ...


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
    ) -> list[ToolResult]:
        """Run a batch under the ledger; :class:`StaleOwner` when ``epoch`` is fenced.
        ``defer``: the outcomes of the calls that end the batch are not journaled here but
        kept for :meth:`take_settles` (the checkpoint after the batch carries them);
        ``reply``: the reply that asked for the batch, journaled with its claim, before any
        call runs (:class:`RecordTooLarge`/:class:`UnstorableRecord` if it cannot be)."""
        ...

    async def journal(self, turn_id: str, epoch: int, reply: ReplyJournal) -> None:
        """Journal a reply on its own, fenced (before a batch's approval questions)."""
        ...

    def take_settles(self) -> tuple[Settle, ...]:
        """The outcomes a ``defer`` batch kept, handed over once."""
        ...

    async def settle(self, turn_id: str, settles: Sequence[Settle]) -> None:
        """Journal outcomes no checkpoint carried (:class:`StoreError` if Redis failed)."""
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
    checkpoints: Checkpointer
    """Durable saves (the store, or a CheckpointActor client)."""
    inbox: InboxReader
    """Injected user messages."""
    approvals: ApprovalDesk
    """Approval decisions."""
    listener: Listener | None = None
    """Receives every phase transition (bus publisher, watchdog, progress display)."""
    events: Callable[[LiveEvent], None] | None = None
    """Receives what a watcher of the turn sees besides transitions: streamed text, tool calls
    and results, the restart marker, the final answer (advisory; must not block)."""
