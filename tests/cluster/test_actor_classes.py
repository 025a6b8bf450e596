"""The Ray actors as plain classes, driven through their typed refs without Ray.

Each actor is a plain class wrapped with ``ray.remote`` only when it is spawned
(``actors.cluster.refs.spawn``), so its logic runs here in process against the real Redis; a
:class:`LocalHandle` stands in for the Ray handle with the same call shape
(``handle.method.remote(*args).future()``), and every reply still crosses as builtins and is
read back by the ref, as on Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest
import ray
from ray.actor import ActorHandle

from actors.cluster.checkpoint_actor import CheckpointActor, CheckpointClient, actor_sender
from actors.cluster.deployment import Deployment
from actors.cluster.info import SaveVerdict
from actors.cluster.recovery_actor import RecoveryActor
from actors.cluster.refs import CheckpointRef, HostRef, RecoveryRef
from actors.cluster.supervisor import Supervisor
from actors.cluster.tool_workers import ToolWorker
from actors.cluster.turn_actor import TurnActor
from actors.cluster.watchdog_actor import WatchdogActor
from actors.engine.resume import Skipped
from actors.engine.settings.config import Settings
from actors.engine.tools.call_ends import CallEnd
from actors.turn.recovery import Decision
from actors.turn.run_result import RunStop
from bus.errors import PhaselineError, StaleOwner, StoreError
from bus.events import Status, StatusEvent, encode_event
from bus.outcomes import Action, Problem
from tests.support.records import record


class _Call:
    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._fut = asyncio.ensure_future(coro)

    def future(self) -> asyncio.Future[Any]:
        return self._fut


class _Method:
    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> _Call:
        return _Call(self._fn(*args))


class LocalHandle:
    """A Ray actor handle's call shape over an object in this process."""

    def __init__(self, target: object) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name))


def local(target: object) -> ActorHandle[Any]:
    return cast("ActorHandle[Any]", LocalHandle(target))


def answering(reply: object) -> ActorHandle[Any]:
    """A handle whose every method answers ``reply``."""

    class Answers:
        def __getattr__(self, _name: str) -> Callable[..., Coroutine[Any, Any, object]]:
            async def method(*_args: Any) -> object:
                return reply

            return method

    return local(Answers())


def deployment(redis_url: str, namespace: str) -> Deployment:
    settings = Settings.model_validate({"redis": {"namespace": namespace}})
    return Deployment(redis_url=redis_url, settings=settings, hosts=1)


@pytest.mark.parametrize(
    "actor_class",
    [TurnActor, Supervisor, CheckpointActor, WatchdogActor, RecoveryActor, ToolWorker],
)
def test_each_actor_class_carries_ray_options_ray_accepts(actor_class: Any) -> None:
    ray.remote(actor_class).options(**actor_class.RAY_OPTIONS)  # validated by Ray here


def test_a_host_is_replaced_by_a_new_generation_never_restarted_in_place() -> None:
    assert TurnActor.RAY_OPTIONS["max_restarts"] == 0
    for service in (Supervisor, CheckpointActor, WatchdogActor, RecoveryActor, ToolWorker):
        assert service.RAY_OPTIONS["max_restarts"] == -1, service


async def test_the_checkpoint_actor_saves_fenced_through_its_ref(
    redis_url: str, namespace: str
) -> None:
    actor = CheckpointActor(deployment(redis_url, namespace).to_wire())
    ref = CheckpointRef(local(actor))
    client = CheckpointClient(actor_sender(lambda: ref))
    ack = await client.save(record("t1", epoch=2, seq=1))
    assert (ack.turn_id, ack.epoch, ack.seq) == ("t1", 2, 1)
    with pytest.raises(StaleOwner):  # an older epoch is refused, by the store's fence
        await client.save(record("t1", epoch=1, seq=2))
    answers = await ref.save_batch([b"not a record"])
    assert [a.verdict for a in answers] == [SaveVerdict.ERROR]
    counts = (await ref.hello()).counts
    assert counts["saves"] == 3 and counts["batches"] == 3


async def test_an_unregistered_checkpoint_actor_is_a_store_error() -> None:
    client = CheckpointClient(actor_sender(lambda: None))
    with pytest.raises(StoreError, match="not registered"):
        await client.save(record("t1"))


async def test_the_recovery_actor_plans_and_decides_through_its_ref(
    redis_url: str, namespace: str
) -> None:
    actor = RecoveryActor(deployment(redis_url, namespace).to_wire())
    ref = RecoveryRef(local(actor))
    (plan,) = await ref.plan_many(["no-such-turn"])
    assert plan == Skipped("no-such-turn", RunStop.UNUSABLE, plan.detail)
    assert (await ref.hello()).counts["plans"] == 1
    decided = await ref.decide(Problem.RETRYABLE, retry_attempts=1)
    assert decided == Decision(Action.RETRY, Problem.RETRYABLE, backoff_s=2.0)
    with pytest.raises(ValueError, match="retry_atempts"):
        await ref.decide(Problem.RETRYABLE, retry_atempts=1)


async def test_malformed_replies_are_typed_errors_at_the_seam() -> None:
    with pytest.raises(PhaselineError, match="HostInfo"):
        await HostRef(answering({"slot": 0})).hello()
    with pytest.raises(StoreError, match="to 2 saves"):
        await CheckpointRef(answering([("ok", "1-0")])).save_batch([b"a", b"b"])
    answers = await CheckpointRef(answering([("maybe", "x")])).save_batch([b"a"])
    assert answers[0].verdict is SaveVerdict.ERROR and "malformed" in answers[0].detail
    with pytest.raises(PhaselineError, match="decision"):
        await RecoveryRef(answering({"action": "dance"})).decide(Problem.RETRYABLE)
    status = encode_event(StatusEvent("t", 1, Status.IDLE_SOFT, "idle", 1))
    with pytest.raises(PhaselineError, match="StatusEvent"):
        await HostRef(answering([status])).phases()


async def test_a_tool_worker_ends_each_call_of_a_group_on_its_own(
    redis_url: str, namespace: str
) -> None:
    """One Ray call carries several calls of a batch: each comes back with how it ended, a
    call past its timeout is cut there, and no call's failure costs the others their result."""
    worker = ToolWorker(deployment(redis_url, namespace).to_wire())
    calls = [
        ("add", '{"a": 2, "b": 3}', "k1", 5.0),
        ("add", '{"a": "two"}', "k2", 5.0),
        ("explode", '{"reason": "on purpose"}', "k3", 5.0),
        ("nap", '{"seconds": 30}', "k4", 0.2),
        ("lose_store", "{}", "k5", 5.0),
        ("refuse_write", "{}", "k6", 5.0),
        ("nosuch", "{}", "k7", 5.0),
    ]
    ends = await worker.call_group("tests.support.agents:group_ends", "t1", calls)
    assert [how for how, _ in ends] == [
        CallEnd.OK, CallEnd.ERROR, CallEnd.ERROR, CallEnd.TIMEOUT, CallEnd.LOST,
        CallEnd.REFUSED, CallEnd.ERROR,
    ]  # fmt: skip
    assert ends[0][1] == "5"
    assert "a: Input should be a valid integer" in ends[1][1]
    assert ends[2][1] == "RuntimeError: on purpose"
    assert ends[4][1] == "lost its store mid-call" and "maxmemory" in ends[5][1]
    assert "nosuch" in ends[6][1]
    assert (await worker.hello())["counts"] == {"calls": 7, "active": 0}
