"""What the actors answer, as frozen, validated types.

An actor answers with builtins (a ``hello`` with the model's plain ``model_dump()``, a save
with a ``(verdict, detail, inbox length)`` triple) and its ref (``actors.cluster.refs``) reads
them back with ``of``, so a reply of another build or a wrong actor is a clear
:class:`~bus.errors.PhaselineError` or an error answer, not a ``KeyError`` three calls later.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

import ray
from pydantic import BaseModel, ConfigDict, ValidationError

from bus.errors import PhaselineError, RecordTooLarge, StaleOwner, StoreError
from store.records import CheckpointRecord, SaveAck

__all__ = [
    "Answer",
    "HostInfo",
    "MCPSessionInfo",
    "SaveVerdict",
    "ServiceInfo",
    "SupervisorInfo",
    "this_node",
]


class _Info(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def of(cls, reply: Any) -> Self:
        """Validate a ``hello`` reply."""
        try:
            return cls.model_validate(reply)
        except ValidationError as exc:
            raise PhaselineError(f"unexpected {cls.__name__} reply: {exc}") from None

    def wire(self) -> dict[str, Any]:
        """The reply as builtins, for the Ray call."""
        return self.model_dump()


class HostInfo(_Info):
    """A TurnActor's answer."""

    slot: int
    """Its slot (the isolation slot after the shared ones)."""
    isolation: bool
    """Whether it is the isolation host."""
    generation: int
    """Its generation in the slot."""
    incarnation: str
    """Random id of this process's actor instance (tells a restart from the same actor)."""
    pid: int
    """Its process."""
    running: int
    """Turns running in it now."""
    finished: int
    """Turns it ended."""
    outcomes: dict[str, int]
    """Ended turns by outcome."""
    resumed: int
    """Turns it resumed."""
    rss_bytes: int
    """Resident memory of its process."""
    checkpoint_batches: int
    """Batches it sent to the CheckpointActor."""
    events_dropped: int
    """Bus events its bounded publisher dropped."""
    tool_queue: dict[str, int] = {}
    """Per tool worker pool: calls of its turns waiting for a free slot (the host sends at
    most a tool's ``max_concurrency`` x pool size calls of it at once)."""
    tool_inflight: dict[str, int] = {}
    """Per tool worker pool: calls of its turns running on it now."""
    node_id: str = ""
    """The Ray node it runs on (hex id): where the slot's standby must not be."""
    store_silent_s: float = 0.0
    """Seconds since it last reached Redis (its last lease renewal): about a renewal period
    while its link works; the Supervisor replaces a host cut off from Redis for long."""


class SupervisorInfo(_Info):
    """The Supervisor's answer."""

    pid: int
    """Its process."""
    hosts: int
    """Shared host slots of the deployment."""
    respawns: int
    """Hosts it replaced so far."""
    watching: bool
    """Whether its watch loop runs."""
    deployment: str
    """The deployment it runs, as JSON (``Deployment.from_wire``)."""
    node_id: str = ""
    """The Ray node it runs on (hex id)."""
    lost: str = ""
    """Why it stopped the deployment ("": it did not): another cluster took its namespace."""


class MCPSessionInfo(_Info):
    """A ToolWorker's session with one MCP server."""

    server: str
    """The server's name in its agent."""
    starts: int
    """Sessions started so far (more than one: restarts)."""
    connected: bool
    """Whether the session is open now."""


class ServiceInfo(_Info):
    """The answer of a CheckpointActor, WatchdogActor, RecoveryActor or ToolWorker."""

    pid: int
    """Its process."""
    counts: dict[str, int]
    """What it did so far (saves, batches, plans, calls, watched turns, ...)."""
    node_id: str = ""
    """The Ray node it runs on (hex id)."""
    mcp: tuple[MCPSessionInfo, ...] = ()
    """A ToolWorker's MCP sessions."""

    @classmethod
    def here(cls, counts: dict[str, int], mcp: tuple[MCPSessionInfo, ...] = ()) -> dict[str, Any]:
        """The reply of the calling actor: its process, its node, ``counts`` (and a ToolWorker's
        MCP sessions)."""
        return cls(pid=os.getpid(), counts=counts, node_id=this_node(), mcp=mcp).wire()


class SaveVerdict(StrEnum):
    """What became of one record of a batch."""

    OK = "ok"
    """Saved (or a replay of a save that had landed); the detail is the event id."""
    STALE = "stale"
    """Refused by fencing: a newer owner has the turn."""
    TOO_LARGE = "too_large"
    """Over the record size cap."""
    ERROR = "error"
    """Not saved: invalid record or a Redis failure; the loop retries at its next site."""


@dataclass(frozen=True, slots=True)
class Answer:
    """The CheckpointActor's answer for one record of a batch."""

    verdict: SaveVerdict
    """What became of the record."""
    detail: str
    """The event id for :attr:`SaveVerdict.OK`, else why."""
    inbox_len: int | None = None
    """For :attr:`SaveVerdict.OK`: the turn's inbox length the save saw (None: not told)."""

    def wire(self) -> tuple[str, str, int]:
        return (self.verdict.value, self.detail, -1 if self.inbox_len is None else self.inbox_len)

    @classmethod
    def of(cls, reply: object) -> Answer:
        """Read one answer off the wire; anything malformed is an error answer."""
        if (
            isinstance(reply, tuple | list)
            and len(reply) == 3
            and isinstance(reply[1], str)
            and isinstance(reply[2], int)
        ):
            with contextlib.suppress(ValueError):
                return cls(SaveVerdict(reply[0]), reply[1], None if reply[2] < 0 else reply[2])
        return cls(SaveVerdict.ERROR, f"malformed answer {reply!r:.80}")

    def ack(self, record: CheckpointRecord) -> SaveAck:
        """The save's ack, or its typed refusal raised."""
        if self.verdict is SaveVerdict.OK:
            return SaveAck(record.turn_id, record.epoch, record.seq, self.detail, self.inbox_len)
        if self.verdict is SaveVerdict.STALE:
            raise StaleOwner(self.detail)
        if self.verdict is SaveVerdict.TOO_LARGE:
            raise RecordTooLarge(self.detail)
        raise StoreError(self.detail)


def this_node() -> str:
    """Hex id of the Ray node this process runs on ("" outside Ray: an actor class driven in
    process, where asking would start a Ray)."""
    if not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())
