"""The poison-turn policy: unlucky turns are isolated and finish; a turn whose isolation host
dies inside the same step twice is suspended; deaths it cannot have caused do not count."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.models.scenario import Scenario, parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.resume import (
    Parked,
    Resume,
    Skipped,
    plan_from_wire,
    plan_resume,
    plan_to_wire,
    reopen,
)
from actors.engine.settings.engine_settings import EngineHooks, EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.harness.chaos import poison_ids, poison_variant
from actors.harness.targets import parse_targets
from actors.harness.timeline import label_levels
from actors.turn.poison import (
    BACKOFF_CAP_S,
    ISOLATE_AFTER,
    Placement,
    evidence,
    isolation_backoff_s,
    place,
)
from actors.turn.run_result import RunStop
from actors.turn.settings import LoopSettings
from bus.errors import RecordError, StoreError
from bus.messages import Message, ToolCall
from bus.outcomes import Outcome, SaveReason
from store.codec import pack_model
from store.domain.isolation import Isolation
from store.keys import KeyLayout
from store.msgpack_wire import pack
from store.records import (
    CheckpointRecord,
    MessageMeta,
    ReplyJournal,
    Settle,
    TurnInput,
    TurnSpec,
)
from tests.support.agents import BUGGY_CALLS
from tests.support.polling import eventually
from tests.support.records import record
from tests.support.reference import reference

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)


def scenario(**kw: Any) -> Scenario:
    return parse_scenario({"name": "p", "rounds": 3, "tools_per_round": 2, **kw})


HANG_FIRST_CALL = {"faults": [{"at_call": 1, "kind": "hang"}]}


def engine_on(client: aioredis.Redis, keys: KeyLayout) -> TurnEngine:
    return TurnEngine(client, keys, EngineSettings(loop=FAST, watchdog=None))


# -- the pure policy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stalled", "deaths", "want"),
    [
        (1, (), Placement.SHARED),
        (ISOLATE_AFTER - 1, (), Placement.SHARED),
        (ISOLATE_AFTER, (), Placement.ISOLATED),
        (9, (), Placement.ISOLATED),  # never aborted, however unlucky
        (3, ("awaiting_llm@7",), Placement.ISOLATED),
        (3, ("awaiting_llm@7", "executing_tools@8"), Placement.ISOLATED),
        (3, ("awaiting_llm@7", "awaiting_llm@7"), Placement.SUSPEND),
        (3, ("a@1", "b@2", "c@3"), Placement.ISOLATED),
        (3, ("a@1", "b@2", "c@3", "d@4"), Placement.SUSPEND),
    ],
)
def test_placement(stalled: int, deaths: tuple[str, ...], want: Placement) -> None:
    assert place(stalled, deaths) is want


def test_isolation_backoff_doubles_and_is_capped() -> None:
    assert [isolation_backoff_s(n) for n in range(4)] == [0.0, 1.0, 2.0, 4.0]
    assert isolation_backoff_s(50) == BACKOFF_CAP_S


def test_evidence_names_the_steps() -> None:
    text = evidence(4, ("awaiting_llm@7", "awaiting_llm@7"))
    assert "2 times" in text and "awaiting_llm@7 x2" in text and "4 stalled" in text


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"kind": "explode"}, "unknown plan kind"), ({"kind": "skipped", "stop": "whim"}, "whim"),
     ({"kind": "resume", "record": None}, "CheckpointRecord"), ({"kind": "skipped"}, "stop")],
)  # fmt: skip
def test_a_malformed_plan_on_the_wire_is_a_record_error(
    fields: dict[str, object], why: str
) -> None:
    wire = pack({"turn_id": "t", "detail": "", **fields})
    with pytest.raises(RecordError, match=why):
        plan_from_wire(wire)


def test_every_plan_shape_round_trips_the_wire() -> None:
    rec = record("t", epoch=2, seq=3)
    spec = TurnSpec(turn_id="t", session_id="s1", agent="a.b:c", input={"message": "hi"},
                    created_at=1)  # fmt: skip
    reply = Message(role="assistant", tool_calls=(ToolCall(id="c", name="echo", args={}),))
    journal = ReplyJournal(
        epoch=2, batch=0, base_len=len(rec.messages), messages=(reply,),
        meta=(MessageMeta(source="llm", message_id="m", at_ms=1),), counters=rec.counters,
    )  # fmt: skip
    for plan in (
        Resume("t", rec, spec, SaveReason.TOOL_BATCH, in_flight=1, pending_inbox=2, detail="d"),
        Resume("t", rec, spec, SaveReason.TOOL_BATCH, journal=journal, lost_reply=""),
        Resume("t", rec, spec, SaveReason.TOOL_BATCH, lost_reply="told"),
        Parked("t", rec, detail="poison"),
        Skipped("t", RunStop.FENCED, detail="newer owner"),
    ):
        assert plan_from_wire(plan_to_wire(plan)) == plan


def test_poison_turns_are_spread_and_crash_at_their_third_call() -> None:
    ids = [f"t{i}" for i in range(100)]
    assert poison_ids(ids, 4) == ["t12", "t37", "t62", "t87"]
    assert poison_ids(ids[:2], 5) == ["t0", "t1"]
    sc = poison_variant(scenario(rounds=8))
    assert [(f.at_call, f.kind) for f in sc.faults] == [(3, "crash")]
    assert poison_variant(scenario(rounds=1)).faults[0].at_call == 2
    assert parse_targets("none", embedded=True) == ()


def test_kill_labels_that_would_touch_go_on_separate_levels() -> None:
    assert label_levels([1.0, 1.1, 1.2, 5.0, 5.05], gap=0.5) == [0, 1, 2, 0, 1]
    assert label_levels([], gap=1.0) == []


# -- the store's isolation facts (the same assertions on fakeredis and the real server) ---------


async def test_isolation_queue_and_probation_marker(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    iso = Isolation(any_client, keys)
    await iso.enqueue("a")
    await iso.enqueue("b", delay_s=60)
    assert await iso.members() == {"a", "b"}
    ready, wait_s = await iso.due()
    assert ready == ["a"] and wait_s is not None and 50 < wait_s <= 60
    await iso.remove("a")
    assert (await iso.due())[0] == [] and await iso.members() == {"b"}

    assert await iso.current() is None
    await iso.begin("b", 3)
    assert await iso.step("b", 3, "awaiting_llm@2")
    marker = await iso.current()
    assert marker is not None and (marker.turn_id, marker.epoch, marker.step) == (
        "b", 3, "awaiting_llm@2",
    )  # fmt: skip
    await iso.begin("b", 4)  # a successor's probation: the old incarnation may not touch it
    assert not await iso.step("b", 3, "executing_tools@3")
    assert not await iso.end("b", 3)
    assert (await iso.current()).step == ""  # type: ignore[union-attr]
    assert await iso.end("b", 4)
    assert await iso.current() is None

    await any_client.hset(keys.probation(), mapping={"turn_id": "x y", "epoch": "1"})
    assert await iso.current() is None  # malformed: never evidence
    await any_client.hset(keys.probation(), mapping={"turn_id": "x", "epoch": "NaN"})
    assert await iso.current() is None


# -- the engine under the policy (real server) --------------------------------------------------


async def claims(engine: TurnEngine, turn_id: str, n: int) -> None:
    for _ in range(n):
        plan = await plan_resume(engine.store, engine.ledger, engine.inbox, turn_id)
        assert plan.what == "resume"


async def test_a_stalled_turn_is_isolated_then_released_and_completes(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = engine_on(real_client, keys)
    sc = scenario()
    await engine.submit(*scripted_turn(sc), "unlucky")
    await claims(engine, "unlucky", ISOLATE_AFTER - 1)  # lost its host, resumed, lost it again
    before = await engine.store.load("unlucky")
    plan = await plan_resume(engine.store, engine.ledger, engine.inbox, "unlucky")
    assert plan == Skipped("unlucky", RunStop.ISOLATE, plan.detail)
    assert (await engine.store.load("unlucky")).epoch == before.epoch  # no claim by a shared host

    assert (await engine.resume("unlucky")).outcome == "isolate"
    assert await engine.isolation.members() == {"unlucky"}
    released = await engine.probations.run("unlucky")
    assert released.outcome == "released"
    assert await engine.isolation.members() == set()
    assert await engine.isolation.current() is None  # ended without a death
    after = await engine.store.load("unlucky")
    assert after.in_progress and after.reason == "tool_batch" and after.epoch == before.epoch + 1

    assert (await engine.resume("unlucky")).outcome == "answered"
    final = await engine.store.load("unlucky")
    ref = await reference(real_client, sc, ["unlucky"])
    assert final.messages == ref["unlucky"].messages
    assert final.counters.isolated_deaths == () and final.counters.outcome == "answered"


async def die_in_probation(engine: TurnEngine, turn_id: str) -> str:
    """Run a probation until its step is noted, then cut it off as a SIGKILL would (no code of
    the host runs after it). Returns the step it died in."""
    epoch = (await engine.store.load(turn_id)).epoch
    task = asyncio.ensure_future(engine.probations.run(turn_id))

    async def stepped() -> str | None:
        m = await engine.isolation.current()
        begun = m is not None and m.turn_id == turn_id and m.epoch > epoch
        return m.step if begun and m.step else None  # "" is a probation not yet in a step

    step = await eventually(stepped, what="the probation's first step")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return step


async def poisoned(client: aioredis.Redis, keys: KeyLayout, turn_id: str) -> TurnEngine:
    engine = engine_on(client, keys)
    await engine.submit(*scripted_turn(scenario(**HANG_FIRST_CALL)), turn_id)
    await engine.isolation.enqueue(turn_id)
    return engine


async def test_two_isolated_deaths_in_one_step_suspend_the_turn(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    first = await poisoned(real_client, keys, "poison")
    step = await die_in_probation(first, "poison")
    assert step == "awaiting_llm@2"

    second = engine_on(real_client, keys)  # the next isolation host, told its predecessor died
    await second.probations.note_predecessor(died=True)
    assert (await second.probations.next_turn())[0] is None  # the dead turn waits out its backoff
    ready, wait_s = await second.isolation.due()
    assert ready == [] and wait_s is not None and 0 < wait_s <= isolation_backoff_s(1)
    assert await die_in_probation(second, "poison") == step  # ... then dies in the same step
    assert (await real_client.hget(keys.turn("poison"), "reason")) == b"resume"
    counted = await second.store.load("poison")
    assert counted.counters.isolated_deaths == (step,)

    third = engine_on(real_client, keys)
    await third.probations.note_predecessor(died=True)
    outcome = await third.probations.run("poison")
    assert outcome.outcome == Outcome.SUSPENDED_POISON
    parked = await third.store.load("poison")
    assert not parked.in_progress and parked.reason == "suspended"
    assert parked.counters.outcome == Outcome.SUSPENDED_POISON
    assert parked.counters.isolated_deaths == (step, step)
    assert "poison" not in await third.store.list_in_progress()
    assert await third.isolation.members() == set()
    assert third.stats.turns == 0  # the CLI counts it from its outcome
    assert "awaiting_llm@2 x2" in evidence(parked.counters.stalled_resumes, (step, step))


async def test_deaths_the_turn_cannot_have_caused_do_not_count(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    # killed before its first step: the marker names no step
    engine = await poisoned(real_client, keys, "early")
    await engine.isolation.begin("early", 1)
    await engine.probations.note_predecessor(died=True)
    plan = await plan_resume(engine.store, engine.ledger, engine.inbox, "early", isolated=True,
                             marker=await engine.isolation.current())  # fmt: skip
    assert isinstance(plan, Resume)
    assert plan.record.counters.isolated_deaths == ()

    # a freeze: the supervisor replaced a host that stopped answering
    frozen = await poisoned(real_client, keys, "frozen")
    await die_in_probation(frozen, "frozen")
    successor = engine_on(real_client, keys)
    await successor.probations.note_predecessor(died=False)
    assert await successor.isolation.current() is None
    assert (await successor.probations.next_turn())[0] == "early"  # queue order: no dead turn first
    task = asyncio.ensure_future(successor.probations.run("frozen"))
    claimed = await eventually(
        lambda: _epoch_past(successor, "frozen", 2), what="the successor's claim"
    )
    task.cancel()
    assert claimed.counters.isolated_deaths == ()

    # a marker left by an owner that was claimed since (a stale epoch) is no evidence either
    stale = engine_on(real_client, keys)
    await stale.submit(*scripted_turn(scenario()), "moved")
    await stale.isolation.begin("moved", 1)
    await stale.isolation.step("moved", 1, "awaiting_llm@2")
    await claims(stale, "moved", 1)  # epoch 2 now
    plan = await plan_resume(stale.store, stale.ledger, stale.inbox, "moved", isolated=True,
                             marker=await stale.isolation.current())  # fmt: skip
    assert isinstance(plan, Resume) and plan.record.counters.isolated_deaths == ()


async def _epoch_past(engine: TurnEngine, turn_id: str, epoch: int) -> CheckpointRecord | None:
    record = await engine.store.load(turn_id)
    return record if record.epoch > epoch else None


class _Unreachable:
    """A checkpoint path whose Redis has gone away."""

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> Any:
        raise StoreError("connection refused")


async def test_a_redis_failure_cutting_a_probation_leaves_no_evidence(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = TurnEngine(
        real_client,
        keys,
        EngineSettings(loop=FAST, watchdog=None),
        EngineHooks(checkpoints=_Unreachable()),
    )
    await engine.submit(*scripted_turn(scenario()), "cut")
    await engine.isolation.enqueue("cut")
    outcome = await engine.probations.run("cut")
    assert outcome.outcome == "interrupted"
    assert await engine.isolation.current() is None  # not a death: the host lived on
    assert await engine.isolation.members() == {"cut"}  # still queued for its probation


async def test_a_suspended_turn_resumes_by_id_after_a_fix(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = await poisoned(real_client, keys, "fixme")
    for _ in range(2):
        await die_in_probation(engine, "fixme")
        engine = engine_on(real_client, keys)
        await engine.probations.note_predecessor(died=True)
    assert (await engine.probations.run("fixme")).outcome == Outcome.SUSPENDED_POISON

    # the fix: the agent no longer hangs (a new spec, as a redeploy would bring)
    spec = await engine.store.load_spec("fixme")
    fixed = spec.model_copy(update={"input": scripted_turn(scenario())[1]})
    await real_client.set(keys.spec("fixme"), pack_model(fixed))

    reopened = await reopen(engine.store, "fixme")
    assert reopened.in_progress and reopened.reason == "unsuspended"
    assert reopened.counters.isolated_deaths == () and reopened.counters.outcome is None
    assert "fixme" in await engine.store.list_in_progress()
    stats = await engine.resume_turns(["fixme"])
    assert stats.outcomes["answered"] == 1 and stats.all_final
    final = await engine.store.load("fixme")
    assert final.counters.outcome == "answered"
    # reopening a final turn changes nothing
    assert (await reopen(engine.store, "fixme")).seq == final.seq


async def test_a_slow_probation_does_not_hold_the_queue(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = TurnEngine(
        real_client, keys, EngineSettings(loop=FAST, watchdog=None, probation_patience_s=0.2)
    )
    await engine.submit(*scripted_turn(scenario(**HANG_FIRST_CALL)), "slow")
    await engine.submit(*scripted_turn(scenario()), "next")
    await engine.isolation.enqueue("slow")
    await engine.isolation.enqueue("next", delay_s=0.01)
    assert (await engine.probations.next_turn())[0] == "slow"
    slow = await engine.probations.run_settled("slow")
    assert not slow.done()  # still in its (hanging) model call, no longer on probation
    assert await engine.isolation.members() == {"next"}
    assert await engine.isolation.current() is None
    released = await engine.probations.run_settled("next")
    assert released.done() and released.result().outcome == "released"
    slow.cancel()


async def test_a_turn_whose_runs_keep_failing_backs_off_then_is_suspended(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """A bug (here the model adapter's KeyError) fails one turn, not the run: it is resumed
    with a backoff, and suspended with the error after three runs in a row; the other turns of
    the run answer."""
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    ask = TurnInput(message="2+3")
    await asyncio.gather(
        engine.run_new("tests.support.agents:buggy", ask, ["bug"]),
        engine.run_new("tests.support.agents:calculator", ask, ["ok1", "ok2"]),
    )
    for tid in ("ok1", "ok2"):
        assert (await engine.store.load(tid)).counters.outcome is Outcome.ANSWERED
    assert BUGGY_CALLS["bug"] == 3  # three runs, then it stopped: no spinning
    record = await engine.store.load("bug")
    assert not record.in_progress and record.counters.outcome is Outcome.SUSPENDED_FAILING
    error = record.counters.last_error
    assert error is not None and error.source == "host" and "KeyError: 'choices'" in error.message
    assert record.epoch == 3  # resumed twice, each a new incarnation
