"""Tools on the cluster: tool calls run as Ray actor tasks on a pool of ToolWorker actors.

Why a pool of async actors and not one plain Ray task per call: tools are I/O-bound and a turn
host may have thousands of calls in flight. Plain tasks need one worker process each; on the
2-core dev machine 50 turns of the plain scenario took 117 s that way, Ray starting 26 worker
processes (docs/CLUSTER.md). A ToolWorker runs hundreds of calls concurrently in one
process and the pool spreads over the cluster (and grows with ``[tools] workers``).

Per call: each worker runs at most the tool's ``max_concurrency`` calls of it at once, and a
host sends at most ``max_concurrency`` x pool size calls of a tool at once (the rest wait on
the host, counted as its queue depth: ``HostInfo.tool_queue``), so calls queue in a bounded
place and not as an unbounded list of Ray calls. The host enforces the timeout (cancelling the
actor task); the pool is chosen by the tool's Ray resources. If the worker dies mid-call, or the
tool's store fails under it, an idempotent tool is retried (on another worker), a
non-idempotent one is reported ``outcome_unknown`` and never re-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import ray
from ray.exceptions import RayActorError, RayError, TaskCancelledError

from actors.cluster.deployment import Deployment, pool_name
from actors.cluster.info import MCPSessionInfo, ServiceInfo
from actors.cluster.metrics import metrics
from actors.cluster.refs import ToolWorkerRef, ask
from actors.engine.agents import load_agent
from actors.engine.tools.call_ends import CallEnd, Ending, attempt_here, call_result
from actors.engine.tools.local_tools import CallGates
from actors.engine.tools.mcp import hub, hub_states, mcp_spec, mcp_target, merged
from actors.engine.tools.toolrun import ToolJob
from actors.turn.agent import Agent
from actors.turn.mcp import MCPToolInfo
from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec
from bus.errors import ConfigError
from bus.events import LiveEvent, ToolWait, ToolWaiting
from bus.messages import ToolCall, ToolResult
from store.domain.effects import EffectCounters
from store.domain.pools import PoolSizes
from store.records import TurnInput
from store.redis.connection import connect

log = logging.getLogger(__name__)

RETRY_WAIT_S = 30.0
"""How long a retry waits for a live worker of its pool (Ray restarting a killed one)."""

#: Seconds a host reuses a worker's handle before looking its name up again. A worker is
#: replaced under its name only when its pool shrank past it (retired 2.5 s after the resize,
#: which hosts read within 1 s, so none has looked it up in the second before) and grew
#: again; a worker Ray restarts in place keeps its handle.
HANDLE_TTL_S = 1.0

#: Seconds a host waits for a group past its longest timeout (the worker enforces each call's
#: own) before it takes the worker for hung and reports the group's calls timed out.
GROUP_GRACE_S = 10.0


class ToolWorker:
    """Runs registered tools; one process serves many concurrent calls."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]] = {
        "num_cpus": 0,  # a pool's resources are given at spawn (``worker_options``)
        "max_restarts": -1,
        "max_task_retries": 0,  # a call is retried by the host, by its tool's ledger rule
        "max_concurrency": 10_000,
    }

    def __init__(self, deployment_json: str) -> None:
        dep = Deployment.from_wire(deployment_json)
        # the effects store, what the tools here write to: the chaos witness is one server
        self._client = (
            connect(dep.effects_url, max_connections=64, retry_s=dep.settings.redis.retry_s)
            if dep.effects_url
            else dep.connect(max_connections=64)
        )
        self._effects = EffectCounters(self._client, dep.keys)
        self._gates = CallGates(dep.settings.tools.threads)
        self.calls = 0
        self.active = 0

    async def _call(
        self, agent: str, name: str, args_json: str, turn_id: str, call_key: str
    ) -> str:
        loaded = load_agent(agent)
        args = json.loads(args_json)
        target = None if name in loaded.tools else mcp_target(loaded.mcp, name)
        if target is not None:
            server, tool = target
            async with self._gates.entered((agent, name), server.max_concurrency, sync=False):
                return await hub().call(agent, server, tool, args, call_key)
        spec = loaded.tools.get(name)
        async with self._gates.entered((agent, name), spec.max_concurrency, sync=spec.sync):
            ctx = ToolContext(turn_id, call_key, self._effects, agent=agent)
            return await spec.fn(args, ctx)

    async def call_group(
        self, agent: str, turn_id: str, calls: list[tuple[str, str, str, float]]
    ) -> list[tuple[str, str]]:
        """Calls of one batch of ``agent``'s turn ``turn_id`` (one, or several of idempotent
        tools), each ``(name, args_json, call_key, timeout_s)``, run at once here: each ends as
        ``(how, text)`` (:class:`~actors.engine.tools.call_ends.CallEnd`; a call past its timeout is
        cancelled here). Arguments travel as JSON, never as pickles; a tool's exception (an
        agent that does not load here included) is its error. Never raises for one call: the
        others' ends still come back."""
        return list(await asyncio.gather(*(self._ended(agent, turn_id, *c) for c in calls)))

    async def _ended(
        self, agent: str, turn_id: str, name: str, args_json: str, call_key: str, timeout_s: float
    ) -> tuple[str, str]:
        self.calls += 1
        self.active += 1
        try:
            how, text = await attempt_here(
                lambda: self._call(agent, name, args_json, turn_id, call_key), timeout_s
            )
            return how.value, text
        finally:
            self.active -= 1

    async def list_mcp(self, agent: str, server: str) -> list[dict[str, Any]]:
        """The tools of ``agent``'s MCP server ``server`` as this worker's session lists them
        (each :class:`MCPToolInfo` as builtins); :class:`ToolUnavailable` if it does not
        start."""
        spec = next((s for s in load_agent(agent).mcp if s.name == server), None)
        if spec is None:
            raise ConfigError(f"agent {agent} has no MCP server {server!r}")
        infos = await hub().list_tools(agent, spec)
        return [dataclasses.asdict(i) for i in infos]

    async def hello(self) -> dict[str, Any]:
        sessions = tuple(
            MCPSessionInfo(server=s.server, starts=s.starts, connected=s.state == "connected")
            for s in hub_states()
        )
        return ServiceInfo.here({"calls": self.calls, "active": self.active}, sessions)


class RayToolRunner:
    """A :class:`~actors.engine.tools.toolrun.ToolRunner` that sends each call to a ToolWorker."""

    def __init__(
        self,
        dep: Deployment,
        sizes: PoolSizes,
        *,
        on_event: Callable[[LiveEvent], None] | None = None,
    ) -> None:
        self.dep = dep
        self.sizes = sizes
        self._on_event = on_event
        self._listed: dict[tuple[str, str], list[MCPToolInfo]] = {}
        self._running: Counter[str] = Counter()
        self._freed: dict[str, asyncio.Condition] = {}
        self.waiting: Counter[str] = Counter()
        """Per pool: calls waiting on this host for a free slot of the pool."""
        self.inflight: Counter[str] = Counter()
        """Per pool: calls this host has running on the pool."""
        self._turns: Counter[str] = Counter()
        self._handles: dict[str, tuple[ToolWorkerRef, float]] = {}
        """Worker handles by name, with when each was looked up (``HANDLE_TTL_S``)."""

    async def size(self, pool: str) -> int:
        """The pool's current size (the Supervisor's, read at most once a second)."""
        return await self.sizes.get(pool, self.dep.settings.tools.workers)

    async def registry(self, agent_path: str, agent: Agent, turn_input: TurnInput) -> ToolRegistry:
        """The agent's tools, with its MCP servers' tools as a ToolWorker of each server's pool
        lists them (cached per process after the first success; a server that cannot be
        listed now is left out and asked again next time). The specs' functions never run
        here: :meth:`run` sends every call to a worker."""
        base = agent.registry(turn_input)
        specs: list[ToolSpec] = []
        for server in agent.mcp:
            key = (agent_path, server.name)
            if key not in self._listed:
                pool = pool_name(server.resources)
                size = await self.size(pool)
                try:
                    worker = self._pick(pool, server.name, 0, size)
                    self._listed[key] = await worker.list_mcp(agent_path, server.name, 60)
                except (TimeoutError, RayError, ValueError) as exc:  # ValueError: not registered
                    log.error(
                        "agent %s: MCP server %s not listed: %s",
                        agent_path,
                        server.name,
                        _last_line(exc),
                    )
                    continue
            specs.extend(mcp_spec(agent_path, server, info) for info in self._listed[key])
        return merged(agent_path, base, specs)

    async def _worker(self, pool: str, attempt: int) -> ToolWorkerRef | None:
        """The next worker of the pool, round robin over its current size; None if none could
        be found for ``RETRY_WAIT_S`` (the pool is being recreated).

        A retry (``attempt > 0``) goes to a worker that has just answered ``hello``: after a
        SIGKILL of the pool, a call to a worker Ray is still restarting fails at once, and
        three instant failures would turn a recoverable loss into an error. Waiting for a live
        worker bounds the retry by the restart time, not by the number of tries."""
        if attempt == 0:
            self._turns[pool] += 1
        deadline = asyncio.get_running_loop().time() + RETRY_WAIT_S
        offset = self._turns[pool] + attempt
        while True:
            try:
                worker = self._pick(pool, "", offset, await self.size(pool))
                if attempt == 0:
                    return worker
                await worker.hello(5.0)
                return worker
            except ValueError:  # not registered: being (re)started by the Supervisor
                pass
            except (RayActorError, TimeoutError) as exc:  # dead or restarting: try the next
                log.info("tool worker of pool %s not up yet: %s", pool, _last_line(exc))
                offset += 1
            if asyncio.get_running_loop().time() > deadline:
                return None
            await asyncio.sleep(0.2)  # backoff before looking again

    def _pick(self, pool: str, key: str, offset: int, size: int) -> ToolWorkerRef:
        """The pool's worker for ``key`` and ``offset``; ``ValueError`` if it is not registered
        (being started or restarted by the Supervisor)."""
        index = (zlib.crc32(key.encode()) + offset) % size
        name = self.dep.tool_worker_name(pool, index)
        now = time.monotonic()
        cached = self._handles.get(name)
        if cached is not None and now - cached[1] < HANDLE_TTL_S:
            return cached[0]
        worker = ToolWorkerRef.named(name)  # a lookup in Ray's GCS: once a second at most
        if worker is None:
            raise ValueError(f"tool worker {index} of pool {pool} is not registered")
        self._handles[name] = (worker, now)
        return worker

    async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
        (result,) = await self._admitted(pool_name(spec.resources), [ToolJob(spec, call, ctx)])
        return result

    async def run_group(self, jobs: Sequence[ToolJob]) -> list[ToolResult]:
        """The calls of idempotent tools go to one worker of their pool in one Ray call
        (:meth:`ToolWorker.call_group`), a group per pool; any other call goes alone."""
        results: list[ToolResult | None] = [None] * len(jobs)
        by_pool: dict[str, list[int]] = {}
        alone: list[list[int]] = []
        for i, job in enumerate(jobs):
            if job.spec.idempotent:
                by_pool.setdefault(pool_name(job.spec.resources), []).append(i)
            else:
                alone.append([i])

        async def run(indices: list[int]) -> None:
            group = [jobs[i] for i in indices]
            ended = await self._admitted(pool_name(group[0].spec.resources), group)
            for i, res in zip(indices, ended, strict=True):
                results[i] = res

        await asyncio.gather(*(run(indices) for indices in [*by_pool.values(), *alone]))
        return [r for r in results if r is not None]

    async def _admitted(self, pool: str, group: list[ToolJob]) -> list[ToolResult]:
        """``group``'s results, run once admitted (:meth:`_admit`), its slots freed after."""
        counts = Counter(job.spec.name for job in group)
        specs = {job.spec.name: job.spec for job in group}
        admitted: list[str] = []
        try:
            for name in sorted(counts):  # one order for every group: none waits in a cycle
                waiting = [job for job in group if job.spec.name == name]
                await self._admit(specs[name], pool, counts[name], partial(self._waited, waiting))
                admitted.append(name)
            ended = await self._send(pool, group)
            for res in ended:
                metrics().tool_calls.inc(1, tags={"status": res.status})
            return ended
        finally:
            for name in admitted:
                await self._free(name, pool, counts[name])

    def _waited(self, jobs: list[ToolJob], over: bool) -> None:
        """Tell watchers that ``jobs`` wait for their tool's place (or, ``over``, run now)."""
        if self._on_event is None:
            return
        now = int(time.time() * 1000)
        for job in jobs:
            self._on_event(
                ToolWaiting(
                    job.ctx.turn_id,
                    job.ctx.epoch,
                    job.call.id,
                    job.call.name,
                    ToolWait.TOOL_LIMIT,
                    now,
                    over,
                )
            )

    async def _admit(
        self, spec: ToolSpec, pool: str, n: int, waited: Callable[[bool], None]
    ) -> None:
        """Wait until ``n`` more of the tool's calls fit under its limit x pool size of calls
        running from here, or none runs (a group larger than the limit then runs alone). The
        ``n`` are taken at once, never one by one: two groups each holding part of what they
        need could wait for each other forever. The bound is re-read while waiting: a pool
        that grows admits more. ``waited`` hears when the calls start waiting (False) and
        when they may run after waiting (True)."""
        freed = self._freed.setdefault(spec.name, asyncio.Condition())
        self.waiting[pool] += n
        waits = False
        try:
            async with freed:  # checked and waited under its lock: no release is missed
                while (running := self._running[spec.name]) and (
                    running + n > spec.max_concurrency * await self.size(pool)
                ):
                    if not waits:
                        waits = True
                        waited(False)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):  # or the pool grew: re-read
                            await freed.wait()
        finally:
            self.waiting[pool] -= n
        if waits:
            waited(True)
        self._running[spec.name] += n
        self.inflight[pool] += n
        metrics().inflight_tools.set(self.inflight[pool], tags={"pool": pool})

    async def _free(self, name: str, pool: str, n: int) -> None:
        self._running[name] -= n
        self.inflight[pool] -= n
        metrics().inflight_tools.set(self.inflight[pool], tags={"pool": pool})
        freed = self._freed[name]
        async with freed:
            # as many waiters as slots came free, not all: each woken one re-checks under the
            # lock, and a host with a thousand waiting calls woke them all at every free
            freed.notify(n)

    async def _send(self, pool: str, group: list[ToolJob]) -> list[ToolResult]:
        """``group``'s results from workers of ``pool``: its first attempt in one Ray call for
        all (a lone call is a group of one); a call that must be tried again (its worker died,
        its store failed under it, Redis refused its write) goes on alone from there. Each
        call's ends are read by :func:`~actors.engine.tools.call_ends.call_result`, the one
        mapping of how a call ended."""
        firsts = await self._attempt(pool, group, 0)
        return list(
            await asyncio.gather(
                *(
                    call_result(job.spec, job.call, partial(self._alone, pool, job), first=first)
                    for job, first in zip(group, firsts, strict=True)
                )
            )
        )

    async def _alone(self, pool: str, job: ToolJob, attempt: int) -> Ending:
        (end,) = await self._attempt(pool, [job], attempt)
        return end

    async def _attempt(self, pool: str, group: list[ToolJob], attempt: int) -> list[Ending]:
        """One attempt of each call of ``group``, in one Ray call to a worker of ``pool`` (a
        retry, ``attempt`` > 0, to one that answers): how each ended, as its worker says, or
        as the host saw it (the worker died, hung past the calls' timeouts plus
        :data:`GROUP_GRACE_S`, or could not be reached)."""
        worker = await self._worker(pool, attempt)
        if worker is None:  # never sent: nothing can have happened
            return [
                (CallEnd.ERROR, f"{j.call.name}: no worker of pool {pool} is up") for j in group
            ]
        ctx = group[0].ctx
        wire = [
            (j.call.name, json.dumps(j.call.args), j.ctx.call_key, j.spec.timeout_s) for j in group
        ]
        ref = worker.call_group(ctx.agent, ctx.turn_id, wire)
        try:
            # each call's timeout is kept on the worker; this bounds a worker that hangs
            ends = await ask(ref, max(j.spec.timeout_s for j in group) + GROUP_GRACE_S)
        except TimeoutError:
            ray.cancel(ref)
            return [(CallEnd.TIMEOUT, "")] * len(group)
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except TaskCancelledError:
            return [(CallEnd.ERROR, f"{j.call.name} was cancelled") for j in group]
        except RayActorError as exc:
            log.warning("tool worker died during %d calls: %s", len(group), exc)
            self._handles.clear()  # look every worker up again
            return [(CallEnd.DIED, "had its worker die mid-call")] * len(group)
        except RayError as exc:  # the call itself failed (a malformed message)
            return [(CallEnd.ERROR, _last_line(exc))] * len(group)
        if not isinstance(ends, list) or len(ends) != len(group):
            log.error("a tool worker answered %d calls with %.200r", len(group), ends)
            return [_UNREADABLE] * len(group)
        return [_ending(end) for end in ends]


#: A worker's answer that cannot be read: what ran cannot be told from it.
_UNREADABLE: Ending = (CallEnd.LOST, "had its worker answer what cannot be read")


def _ending(end: Any) -> Ending:
    """One call's ``(how, text)`` from a worker's answer."""
    try:
        return CallEnd(end[0]), str(end[1])
    except (TypeError, ValueError, IndexError, KeyError):
        log.error("a tool worker answered %.200r for a call", end)
        return _UNREADABLE


def _last_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[-1][:500]
