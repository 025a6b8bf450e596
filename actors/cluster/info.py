"""What the actors' ``hello`` calls answer, as frozen, validated types.

An actor answers with the model's plain ``model_dump()`` (only builtins cross the Ray call) and
the caller validates it back with :meth:`_Info.of`, so a reply of another build or a wrong
actor is a clear :class:`~bus.errors.PhaselineError`, not a ``KeyError`` three calls later.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Self

import ray
from pydantic import BaseModel, ConfigDict, ValidationError

from bus.errors import PhaselineError

__all__ = ["HostInfo", "MCPSessionInfo", "ServiceInfo", "SupervisorInfo", "this_node"]


class _Info(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def of(cls, reply: Any) -> Self:
        """Validate a ``hello`` reply."""
        try:
            return cls.model_validate(reply)
        except ValidationError as exc:
            raise PhaselineError(f"unexpected {cls.__name__} reply: {exc}") from None

    @classmethod
    async def asked(cls, handle: Any, timeout: float | None = None) -> Self:
        """The actor's ``hello``, typed (``timeout``: seconds to wait, :class:`TimeoutError`
        past them; None: as long as it takes)."""
        call = asyncio.wrap_future(handle.hello.remote().future())
        return cls.of(await (call if timeout is None else asyncio.wait_for(call, timeout)))

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


def this_node() -> str:
    """Hex id of the Ray node this process runs on."""
    return str(ray.get_runtime_context().get_node_id())
