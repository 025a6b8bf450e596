"""Tool calls run in this process (``run --in-process``, and the gates a ToolWorker applies
to the calls it is sent): a tool's ``max_concurrency``, a bound on the threads sync tools take,
and the calls' ends mapped by :mod:`actors.engine.tools.call_ends`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence

from actors.engine.tools.call_ends import attempt_here, call_result
from actors.engine.tools.mcp import mcp_registry
from actors.engine.tools.toolrun import ToolJob
from actors.turn.agent import Agent
from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec
from bus.events import LiveEvent, ToolWait, ToolWaiting
from bus.messages import ToolCall, ToolResult
from store.records import TurnInput

__all__ = ["CallGates", "LocalToolRunner"]


class CallGates:
    """What a tool call waits for in this process before it runs: a free place under its
    tool's ``max_concurrency``, then, for a sync tool, a free thread (``[tools] threads``;
    0: none is waited for). Whoever is told (``waited``) hears when a call starts waiting and
    when its wait is over."""

    def __init__(self, threads: int = 0) -> None:
        self._limits: dict[object, asyncio.Semaphore] = {}
        self._threads = asyncio.Semaphore(threads) if threads else None

    @contextlib.asynccontextmanager
    async def entered(
        self,
        tool: object,
        max_concurrency: int,
        *,
        sync: bool,
        waited: Callable[[ToolWait, bool], None] | None = None,
    ) -> AsyncIterator[None]:
        """Hold a place of ``tool`` (at most ``max_concurrency`` at once) and, if ``sync``, a
        thread, while the block runs (taken in that order: no cycle)."""
        limit = self._limits.setdefault(tool, asyncio.Semaphore(max_concurrency))
        async with contextlib.AsyncExitStack() as held:
            for gate, why in ((limit, ToolWait.TOOL_LIMIT), (self._threads, ToolWait.THREADS)):
                if gate is None or (why is ToolWait.THREADS and not sync):
                    continue
                if gate.locked() and waited is not None:
                    waited(why, False)
                    await held.enter_async_context(gate)
                    waited(why, True)
                else:
                    await held.enter_async_context(gate)
            yield


class LocalToolRunner:
    """Runs tools as asyncio tasks in this process, with per-tool concurrency and timeout.

    A tool that fails because the store under it failed (``StoreError``) is an infrastructure
    failure, not the tool's answer: an idempotent tool is retried, a non-idempotent one is
    reported ``outcome_unknown``. A write Redis refused (:class:`StoreRefused`) did not happen,
    so any tool is tried again, and reported not run if it stays refused
    (:func:`~actors.engine.tools.call_ends.call_result`).
    """

    def __init__(
        self, *, threads: int = 0, on_event: Callable[[LiveEvent], None] | None = None
    ) -> None:
        self._gates = CallGates(threads)
        self._on_event = on_event

    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        def waited(why: ToolWait, over: bool) -> None:
            if self._on_event is not None:
                now = int(time.time() * 1000)
                self._on_event(
                    ToolWaiting(ctx.turn_id, ctx.epoch, call.id, call.name, why, now, over)
                )

        gates = self._gates.entered(spec.name, spec.max_concurrency, sync=spec.sync, waited=waited)
        async with gates:
            return await call_result(
                spec, call, lambda _n: attempt_here(lambda: spec.fn(call.args, ctx), spec.timeout_s)
            )

    async def run_group(self, jobs: Sequence[ToolJob]) -> list[ToolResult]:
        """Each call as :meth:`run` runs it, all at once: in one process there is no message
        to save."""
        return list(await asyncio.gather(*(self.run(j.spec, j.call, j.ctx) for j in jobs)))

    async def registry(self, agent_path: str, agent: Agent, turn_input: TurnInput) -> ToolRegistry:
        base = agent.registry(turn_input)
        return await mcp_registry(agent_path, base, agent.mcp) if agent.mcp else base
