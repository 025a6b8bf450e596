"""Typed clients of the deployment's Ray actors: callers hold a ref, never an actor object.

Each actor is a plain class (``TurnActor``, ``Supervisor``, ...) with its Ray options in a
``RAY_OPTIONS`` class attribute; :func:`spawn` wraps it with ``ray.remote(...).options(...)``
when it is started, the way Ray's own ``ray.util.queue`` does, so its logic can be built and
tested without Ray. What crosses a call is builtins (JSON, msgpack bytes, plain dicts); each
ref method reads the reply back into the frozen type the caller works with (``HostInfo``,
``ResumePlan``, ``Transition``, ...), so a malformed reply is a typed error at the seam, not
a ``KeyError`` three calls later, and the method names of the actors are spelled in one place.

A method that takes ``timeout`` raises :class:`TimeoutError` past it (None: no bound). Ray's
own errors (``RayActorError`` for a dead actor, ``RayTaskError`` for one that raised) pass
through: what they mean depends on the caller (a dead host is replaced, a dead tool worker
retried), so each caller translates them where it knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, Self, cast

import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import RayActorError

from actors.cluster.info import Answer, HostInfo, ServiceInfo, SupervisorInfo
from actors.engine.models.generations import Answered
from actors.engine.resume import ResumePlan, plan_from_wire
from actors.turn.mcp import MCPToolInfo
from actors.turn.recovery import Decision
from bus.errors import PhaselineError, StoreError
from bus.events import decode_event
from bus.outcomes import Action, Problem
from bus.phase import Transition
from store.records import TurnInput

__all__ = [
    "RAY_NAMESPACE",
    "ActorRef",
    "CheckpointRef",
    "HostRef",
    "RecoveryRef",
    "ServiceRef",
    "SupervisorRef",
    "ToolWorkerRef",
    "ask",
    "named",
    "spawn",
]

#: Ray namespace of every phaseline actor (names inside it carry the phaseline namespace).
RAY_NAMESPACE = "phaseline"


class RayActor(Protocol):
    """A plain actor class: its Ray options travel with it."""

    RAY_OPTIONS: ClassVar[Mapping[str, Any]]


@functools.cache
def _remote(actor_class: type[RayActor]) -> ActorClass[Any]:
    # Once per class and process: the supervisor looks its pools' workers up every tick.
    return ray.remote(actor_class)


def spawn(
    actor_class: type[RayActor], name: str, /, *args: Any, **options: Any
) -> ActorHandle[Any]:
    """The detached actor named ``name`` of ``actor_class``: the one that exists, or a new one
    started with ``args`` and the class's ``RAY_OPTIONS`` updated by ``options``."""
    return cast(
        "ActorHandle[Any]",
        _remote(actor_class)
        .options(
            name=name,
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            **{**actor_class.RAY_OPTIONS, **options},
        )
        .remote(*args),
    )


def named(name: str) -> ActorHandle[Any] | None:
    """The live actor registered under ``name``, or None."""
    try:
        return ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return None


async def ask(ref: ray.ObjectRef[Any], timeout: float | None) -> Any:
    """Await a Ray call for at most ``timeout`` seconds (:class:`TimeoutError` past it)."""
    call = asyncio.wrap_future(ref.future())
    return await (call if timeout is None else asyncio.wait_for(call, timeout))


class ActorRef:
    """A handle on one actor; subclasses name its methods and type its replies."""

    def __init__(self, handle: ActorHandle[Any]) -> None:
        self.handle = handle

    @classmethod
    def named(cls, name: str) -> Self | None:
        """The live actor registered under ``name``, or None."""
        handle = named(name)
        return None if handle is None else cls(handle)

    def _call(self, method: str, *args: Any) -> ray.ObjectRef[Any]:
        return getattr(self.handle, method).remote(*args)  # type: ignore[no-any-return]

    async def _ask(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return await ask(self._call(method, *args), timeout)

    async def alive(self) -> bool:
        """False once Ray itself says the actor is dead (a slow answer is not death)."""
        try:
            await self._ask("hello", timeout=0.05)
        except RayActorError:
            return False
        except TimeoutError:
            return True
        return True

    def kill(self) -> None:
        """Kill the actor for good (no restart), if it still exists."""
        with contextlib.suppress(RayActorError, ValueError):
            ray.kill(self.handle, no_restart=True)


class HostRef(ActorRef):
    """A TurnActor: hosts many turns of one slot."""

    async def hello(self, timeout: float | None = None) -> HostInfo:
        return HostInfo.of(await self._ask("hello", timeout=timeout))

    async def run_turns(self, turn_ids: Sequence[str]) -> int:
        """Start submitted turns; how many started."""
        return int(await self._ask("run_turns", list(turn_ids)))

    async def adopt(self, predecessor_died: bool | None = None) -> int:
        """Resume the slot's in-progress turns it does not run (see ``TurnActor.adopt``)."""
        return int(await self._ask("adopt", predecessor_died))

    async def reach_store(self, timeout: float) -> bool:
        """Whether the host reaches Redis now (it renews its lease within ``timeout``)."""
        return bool(await self._ask("reach_store", timeout, timeout=timeout + 1))

    async def agent_problem(self, agent: str, turn_input: TurnInput, timeout: float) -> str:
        """Why the host could not start a turn of ``agent`` ("" if it could)."""
        return str(
            await self._ask("agent_problem", agent, turn_input.model_dump(), timeout=timeout)
        )

    async def stop_taking(self, timeout: float) -> int:
        """Start no more turns; how many run there now."""
        return int(await self._ask("stop_taking", timeout=timeout))

    async def cancel_turn(self, turn_id: str, timeout: float) -> bool:
        return bool(await self._ask("cancel_turn", turn_id, timeout=timeout))

    async def cancel_llm(self, turn_id: str, epoch: int) -> bool:
        return bool(await self._ask("cancel_llm", turn_id, epoch))

    async def phases(self, timeout: float | None = None) -> list[Transition]:
        """The current phase of every turn running there."""
        out = []
        for fields in await self._ask("phases", timeout=timeout):
            event = decode_event(fields)
            if not isinstance(event, Transition):
                raise PhaselineError(f"a host's phases answered a {type(event).__name__}")
            out.append(event)
        return out

    async def park(self) -> None:
        """Returns only when the host dies (as ``RayActorError``): a death notice."""
        await self._ask("park")

    async def drain(self) -> None:
        """Returns when no turn runs there."""
        await self._ask("drain")


class SupervisorRef(ActorRef):
    """The deployment's Supervisor."""

    async def ensure(self) -> SupervisorInfo:
        """Bring the deployment up (idempotent); its answer once it is."""
        return SupervisorInfo.of(await self._ask("ensure"))

    async def hello(self, timeout: float | None = None) -> SupervisorInfo:
        return SupervisorInfo.of(await self._ask("hello", timeout=timeout))

    async def stop(self) -> None:
        """Kill every actor of the deployment but the Supervisor."""
        await self._ask("stop")


class ServiceRef(ActorRef):
    """A CheckpointActor, WatchdogActor, RecoveryActor or ToolWorker."""

    async def hello(self, timeout: float | None = None) -> ServiceInfo:
        return ServiceInfo.of(await self._ask("hello", timeout=timeout))


class CheckpointRef(ServiceRef):
    """A CheckpointActor."""

    async def save_batch(self, blobs: list[bytes]) -> list[Answer]:
        """One answer per wire record, in order (a malformed one is an error answer)."""
        replies = await self._ask("save_batch", blobs)
        if not isinstance(replies, list) or len(replies) != len(blobs):
            raise StoreError(f"checkpoint actor answered {replies!r:.80} to {len(blobs)} saves")
        return [Answer.of(r) for r in replies]


class RecoveryRef(ServiceRef):
    """The RecoveryActor."""

    async def plan_many(self, turn_ids: Sequence[str]) -> list[ResumePlan]:
        """Each turn claimed for a new owner, its resume plan, in order."""
        return [plan_from_wire(w) for w in await self._ask("plan_many", list(turn_ids))]

    async def decide(self, problem: Problem, **situation: Any) -> Decision:
        """The recovery policy's answer (``ValueError`` raised there for an unknown field)."""
        reply = await self._ask("decide", problem.value, situation)
        try:
            return Decision(
                Action(reply["action"]),
                Problem(reply["cause"]),
                backoff_s=float(reply["backoff_s"]),
                more_room=bool(reply["more_room"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PhaselineError(f"unexpected decision {reply!r:.80}: {exc}") from None


class ModelWorkerRef(ServiceRef):
    """A model worker: runs the model calls of the deployment's turns."""

    def submit(
        self, listener: str, asks: list[tuple[int, str, str, int, bytes]]
    ) -> ray.ObjectRef[Any]:
        """Start (or join) a batch of generations, each ``(token, name, agent, epoch,
        request)``, their answers for ``listener`` to collect; the returned ref is the
        worker's incarnation."""
        return self._call("submit", listener, asks)

    async def collect(self, listener: str, wait_s: float) -> tuple[str, list[Answered]]:
        """The worker's incarnation and the answers waiting for ``listener`` (``(token,
        answer bytes)`` each), after up to ``wait_s`` for the first."""
        incarnation, answers = await self._ask("collect", listener, wait_s)
        return str(incarnation), [(int(t), bytes(raw)) for t, raw in answers]

    def cancel(self, gen_id: str, epoch: int) -> ray.ObjectRef[Any]:
        """End generation ``gen_id`` where it runs (unless a newer incarnation owns it)."""
        return self._call("cancel", gen_id, epoch)


class ToolWorkerRef(ServiceRef):
    """A ToolWorker of a pool."""

    def call(
        self, agent: str, name: str, args_json: str, turn_id: str, call_key: str
    ) -> ray.ObjectRef[Any]:
        """Start a tool call; the caller awaits (or cancels) the returned ref (its output)."""
        return self._call("call", agent, name, args_json, turn_id, call_key)

    def call_group(
        self, agent: str, turn_id: str, calls: list[tuple[str, str, str, float]]
    ) -> ray.ObjectRef[Any]:
        """Start several calls of one batch, each ``(name, args_json, call_key, timeout_s)``;
        the returned ref is their ends, ``(how, text)`` each, in order."""
        return self._call("call_group", agent, turn_id, calls)

    async def list_mcp(self, agent: str, server: str, timeout: float) -> list[MCPToolInfo]:
        """The tools of ``agent``'s MCP server as this worker's session lists them."""
        raw = await self._ask("list_mcp", agent, server, timeout=timeout)
        return [MCPToolInfo(**d) for d in raw]
