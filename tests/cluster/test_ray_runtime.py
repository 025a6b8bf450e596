"""The Ray runtime under real SIGKILLs: hosts, tool workers, checkpoint, watchdog, recovery and
supervisor actors, a frozen zombie host, the watchdog on a hanging model, injected messages."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psutil
import pytest
import ray
import redis.asyncio as aioredis

from actors.cluster.info import HostInfo, ServiceInfo
from actors.cluster.refs import RecoveryRef
from actors.cluster.runtime import Runtime
from actors.engine.cancel import Cancelled, request_cancel
from actors.engine.models.scenario import Scenario, parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from actors.harness.chaos import poison_variant
from actors.harness.verdict import effect_findings, first_difference, judge
from actors.turn.recovery import Decision
from bus.errors import TurnNotRunning
from bus.events import Recovering, StatusEvent, decode_event
from bus.outcomes import Action, EngineProblem, Outcome, Problem
from store.domain.effects import EffectCounters
from store.domain.ledger import ToolLedger
from store.domain.sessions import IfBusy
from store.keys import KeyLayout
from store.records import CheckpointRecord
from tests.support.polling import eventually
from tests.support.reference import reference

pytestmark = pytest.mark.usefixtures("ray_cluster")

StartRuntime = Callable[..., Awaitable[Runtime]]


def settings(namespace: str, **sections: dict[str, Any]) -> Settings:
    base: dict[str, Any] = {
        "redis": {"namespace": namespace},
        "checkpoint": {"min_interval_s": 0},
        "loop": {"strict": True, "backoff_scale": 0.01},
        "supervisor": {"ping_interval_s": 0.2, "ping_timeout_s": 2.0},
        "approvals": {"poll_s": 0.02},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return Settings.model_validate(base)


@pytest.fixture
async def start_runtime(redis_url: str, namespace: str) -> AsyncIterator[StartRuntime]:
    started: list[Runtime] = []

    async def start(hosts: int = 2, **sections: dict[str, Any]) -> Runtime:
        rt = await Runtime.start(settings(namespace, **sections), redis_url=redis_url, hosts=hosts)
        started.append(rt)
        return rt

    yield start
    for rt in started:
        await rt.shutdown()


def scenario(**kw: Any) -> Scenario:
    base = {"name": "ray", "rounds": 5, "tools_per_round": 2, "tools": ["echo"],
            "llm_latency_ms": 150, "tool_latency_ms": 10, "payload_bytes": 200}  # fmt: skip
    return parse_scenario({**base, **kw})


async def checkpoints_written(client: aioredis.Redis, keys: KeyLayout, at_least: int) -> None:
    async def enough() -> bool:
        total = 0
        for s in keys.all_shards():
            total += await client.xlen(keys.events(s))
        return total >= at_least

    await eventually(enough, timeout=60, what=f"{at_least} checkpoints")


async def assert_all_correct(
    rt: Runtime, client: aioredis.Redis, sc: Scenario, finals: dict[str, CheckpointRecord]
) -> None:
    ref = await reference(client, sc, sorted(finals))
    for tid, final in finals.items():
        assert not final.in_progress, tid
        assert len(final.meta) == len(final.messages), tid
        assert final.messages == ref[tid].messages, tid
    assert await rt.store.list_in_progress() == []


async def final_events(client: aioredis.Redis, keys: KeyLayout) -> dict[str, int]:
    """How many final (in_progress = 0) saves each turn has in the events streams."""
    counts: dict[str, int] = {}
    for s in keys.all_shards():
        for _, f in await client.xrange(keys.events(s)):
            if f[b"in_progress"] == b"0":
                tid = f[b"turn_id"].decode()
                counts[tid] = counts.get(tid, 0) + 1
    return counts


async def test_sigkill_of_a_host_mid_turn(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    rt = await start_runtime(hosts=2)
    sc = scenario()
    ids = [f"h{i:03d}" for i in range(40)]
    await rt.submit(*scripted_turn(sc), ids)
    await checkpoints_written(real_client, rt.dep.keys, 40 + 60)
    victim = rt.dep.slot_of(ids[0])
    pid = await rt.kill_host(victim)

    async def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    await eventually(gone, timeout=10, what="the host process to die")
    finals = await rt.wait(ids, timeout=180)
    await assert_all_correct(rt, real_client, sc, finals)
    resumed = [t for t, r in finals.items() if r.counters.resume_attempts]
    assert resumed and all(rt.dep.slot_of(t) == victim for t in resumed)
    assert all(finals[t].epoch >= 2 for t in resumed)
    assert await rt.respawns() >= 1
    assert set((await final_events(real_client, rt.dep.keys)).values()) == {1}


async def test_every_host_sigkilled_mid_batch_runs_no_effect_twice_with_random_replies(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """20 turns whose model never answers alike; every TurnActor SIGKILLed while each turn's
    non-idempotent ``send`` is in flight on a ToolWorker (which lives on and finishes it).
    Counted from outside: no effect twice, none the model was not told of, no complete reply
    asked for again."""
    rt = await start_runtime(hosts=2)
    sc = scenario(rounds=2, tools=["echo", "send"], tool_latency_ms=3000, llm_latency_ms=20,
                  replies="random", seed=3)  # fmt: skip
    ids = [f"once{i:03d}" for i in range(20)]
    effects = EffectCounters(real_client, rt.dep.keys)
    await rt.submit(*scripted_turn(sc), ids)

    async def every_send_in_flight() -> bool:
        return all([await effects.counts(t) for t in ids])

    await eventually(every_send_in_flight, timeout=60, what="every turn's send to act")
    for slot in range(2):
        await rt.kill_host(slot)
    finals = await rt.wait(ids, timeout=180)
    verdict = await judge(real_client, rt.dep.keys, ids, None)
    assert verdict.ok, verdict.as_dict()["examples"]
    assert verdict.calls_repaid == 0
    for t, final in finals.items():
        assert final.counters.resume_attempts >= 1, t
        assert final.counters.replies_adopted >= 1, t
        assert len(await effects.counts(t)) == 2, t  # the first round's send, the second's
    assert await rt.respawns() >= 2


async def test_a_poison_turn_is_suspended_and_its_slot_mates_complete(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """A turn whose third model call SIGKILLs its host, among turns that do nothing wrong: it
    takes its shared host down twice (the first time after saving progress), then its
    isolation host twice in the same step, and is parked; everyone else finishes correctly.
    (Model calls in the hosts: on model workers the call kills a worker, the next test.)"""
    rt = await start_runtime(hosts=2, models={"remote": False})
    sc = scenario(rounds=4, tools=["echo", "counter_increment"], llm_latency_ms=100)
    ids = [f"ok{i}" for i in range(8)]
    await rt.submit(*scripted_turn(sc), ids)
    await rt.submit(*scripted_turn(poison_variant(sc)), ["bad"])
    finals = await rt.wait([*ids, "bad"], timeout=240)

    bad = finals.pop("bad")
    assert bad.counters.outcome == "suspended:poison" and not bad.in_progress
    (step,) = set(bad.counters.isolated_deaths)
    assert bad.counters.isolated_deaths == (step, step)
    assert bad.counters.resume_attempts == 4  # four owners lost: the host deaths it caused
    gens = await rt.hosts.generations()
    slot = rt.dep.slot_of("bad")
    assert gens == {slot: 2, 1 - slot: 0, rt.dep.isolation_slot: 2}
    assert await rt.respawns() == 4
    ref = await reference(real_client, sc, sorted(finals))
    effects = EffectCounters(real_client, rt.dep.keys)
    for tid, final in finals.items():
        # a non-idempotent call in flight at one of the deaths is answered outcome_unknown
        assert final.counters.outcome == "answered", tid
        assert first_difference(final.messages, ref[tid].messages) is None, tid
        assert all(n == 1 for n in (await effects.counts(tid)).values()), tid


async def test_a_model_call_that_kills_its_model_worker_parks_its_turn_and_no_other(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """The same poison turn with its model calls on model workers: its third call SIGKILLs
    the worker it runs on, twice (the generations of the others on it are asked again), then
    the isolation worker twice running it alone, and the turn is parked; no host died, and
    everyone else finishes correctly, each effect once. Mid-turn saves are debounced (as by
    default): the parked record still tells every effect the poison turn's batches had."""
    rt = await start_runtime(
        hosts=2, models={"remote": True, "workers": 2}, checkpoint={"min_interval_s": 60}
    )
    sc = scenario(rounds=4, tools=["echo", "counter_increment"], llm_latency_ms=100)
    ids = [f"mok{i}" for i in range(8)]
    await rt.submit(*scripted_turn(sc), ids)
    await rt.submit(*scripted_turn(poison_variant(sc)), ["mbad"])
    finals = await rt.wait([*ids, "mbad"], timeout=240)

    bad = finals.pop("mbad")
    assert bad.counters.outcome == "suspended:poison" and not bad.in_progress
    (step,) = set(bad.counters.isolated_deaths)
    assert step.startswith("model_worker:") and len(bad.counters.isolated_deaths) == 4
    assert bad.counters.last_error is not None and bad.counters.last_error.kind == "poison"
    assert bad.counters.resume_attempts == 0 and await rt.respawns() == 0
    ref = await reference(real_client, sc, sorted(finals))
    effects = EffectCounters(real_client, rt.dep.keys)
    ledger = ToolLedger(real_client, rt.dep.keys)
    told = effect_findings(await effects.counts("mbad"), bad, await ledger.entries("mbad"))
    assert told == ("", ""), told  # no effect run twice, none the transcript does not tell
    for tid, final in finals.items():
        assert final.counters.outcome == "answered", tid
        assert first_difference(final.messages, ref[tid].messages) is None, tid
        assert all(n == 1 for n in (await effects.counts(tid)).values()), tid


async def test_wait_reports_a_record_corrupted_mid_run_and_returns_the_others(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """A record that turns unreadable while its turn runs is quarantined by the next adopt;
    ``wait`` reports it and returns the others instead of waiting for it until its timeout."""
    rt = await start_runtime(hosts=1, supervisor={"adopt_interval_s": 0.5})
    sc = scenario(rounds=6, llm_latency_ms=200)
    ids = [f"w{i}" for i in range(4)]
    await rt.submit(*scripted_turn(sc), ids)
    await checkpoints_written(real_client, rt.dep.keys, 4 + 2)
    await real_client.hset(rt.dep.keys.turn("w0"), "epoch", "not-a-number")
    unusable: dict[str, str] = {}
    finals = await rt.wait(
        ids, timeout=120, on_unusable=lambda tid, exc: unusable.__setitem__(tid, str(exc))
    )
    assert sorted(finals) == ["w1", "w2", "w3"] and list(unusable) == ["w0"]
    assert all(f.counters.outcome == "answered" for f in finals.values())
    assert any("w0" in key for key in await rt.store.quarantined())


async def test_sigkill_of_tool_workers_mid_call(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """Each turn's batch: a non-idempotent call alone, and two echo calls sent together as one
    group (``ToolWorker.call_group``); the group's worker dies, so each echo goes again alone."""
    rt = await start_runtime(hosts=1)
    sc = scenario(
        rounds=1, tools=["counter_increment", "echo", "echo"], tools_per_round=3,
        tool_latency_ms=3000, llm_latency_ms=10,
    )  # fmt: skip
    ids = ["tool0", "tool1"]
    await rt.submit(*scripted_turn(sc), ids)

    async def in_flight() -> bool:
        states = [e.state for t in ids for e in (await ledger(rt).entries(t)).values()]
        return states.count("dispatched") == 6

    async def on_workers() -> bool:
        return sum(w.counts["active"] for w in await tool_worker_info(rt)) == 6

    await eventually(in_flight, timeout=60, what="6 tool calls dispatched")
    await eventually(on_workers, timeout=60, what="6 tool calls running on the workers")
    for pid in [w.pid for w in await tool_worker_info(rt)]:
        os.kill(pid, signal.SIGKILL)
    finals = await rt.wait(ids, timeout=120)
    for tid in ids:
        results = [m.tool_result for m in finals[tid].messages if m.tool_result]
        ends = sorted((r.name, r.status) for r in results)
        assert ends == [("counter_increment", "outcome_unknown"), ("echo", "ok"), ("echo", "ok")]
        effects = await rt_effects(rt, tid)
        assert all(n <= 1 for n in effects.values())  # never ran twice
        states = sorted((e.name, e.state) for e in (await ledger(rt).entries(tid)).values())
        assert states == [
            ("counter_increment", "outcome_unknown"), ("echo", "committed"), ("echo", "committed")
        ]  # fmt: skip


def ledger(rt: Runtime) -> Any:
    from store.domain.ledger import ToolLedger

    return ToolLedger(rt.client, rt.dep.keys)


async def rt_effects(rt: Runtime, turn_id: str) -> dict[str, int]:
    from store.domain.effects import EffectCounters

    return await EffectCounters(rt.client, rt.dep.keys).counts(turn_id)


async def tool_worker_info(rt: Runtime) -> list[ServiceInfo]:
    out = []
    for i in range(rt.dep.settings.tools.workers):
        worker = rt.tool_worker("default", i)
        assert worker is not None, i
        out.append(await worker.hello())
    return out


async def test_sigkill_of_the_checkpoint_actor_during_saves(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    rt = await start_runtime(hosts=2)
    sc = scenario(llm_latency_ms=50, tool_latency_ms=5)
    ids = [f"c{i:03d}" for i in range(60)]
    await rt.submit(*scripted_turn(sc), ids)
    await checkpoints_written(real_client, rt.dep.keys, 60 + 50)
    old = await rt.service_pid("checkpoint")
    os.kill(old, signal.SIGKILL)
    finals = await rt.wait(ids, timeout=180)
    assert await rt.service_pid("checkpoint") != old  # restarted by Ray
    await assert_all_correct(rt, real_client, sc, finals)  # every record whole and right


async def test_checkpoint_actors_sharded_by_key_shard_share_the_saves_and_survive_a_kill(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """``[checkpoint] actors = 2``: each turn's saves go to the actor of its key shard, both
    actors carry saves, and one of them SIGKILLed mid-run is restarted with no turn lost."""
    rt = await start_runtime(hosts=2, checkpoint={"actors": 2})
    roles = rt.dep.checkpoint_roles()
    assert roles == ["checkpoint", "checkpoint1"]
    sc = scenario(llm_latency_ms=50, tool_latency_ms=5)
    ids = [f"k{i:03d}" for i in range(60)]
    assert {rt.dep.checkpoint_role(t) for t in ids} == set(roles)
    await rt.submit(*scripted_turn(sc), ids)
    await checkpoints_written(real_client, rt.dep.keys, 60 + 50)
    old = await rt.service_pid("checkpoint1")
    os.kill(old, signal.SIGKILL)
    finals = await rt.wait(ids, timeout=180)
    assert await rt.service_pid("checkpoint1") != old
    await assert_all_correct(rt, real_client, sc, finals)
    for role in roles:
        service = rt.service(role)
        assert service is not None, role
        assert (await service.hello()).counts["saves"] > 0, role


@pytest.mark.parametrize("role", ["watchdog", "recovery", "supervisor"])
async def test_a_killed_service_actor_comes_back_and_works(
    start_runtime: StartRuntime, real_client: aioredis.Redis, role: str
) -> None:
    rt = await start_runtime(
        hosts=2, watchdog={"tick_s": 0.1, "soft_idle_s": 0.3, "hard_idle_s": 1.0}
    )
    old = await rt.service_pid(role)
    os.kill(old, signal.SIGKILL)

    async def new_pid() -> int | None:
        try:
            pid = await rt.service_pid(role)
        except ray.exceptions.RayActorError:
            return None
        return pid if pid != old else None

    await eventually(new_pid, timeout=60, what=f"{role} restarted")
    if role == "recovery":  # the policy it hosts answers operators too
        actor = RecoveryRef.named(rt.dep.name(role))
        assert actor is not None
        decided = await actor.decide(Problem.RETRYABLE, retry_attempts=1)
        assert decided == Decision(Action.RETRY, Problem.RETRYABLE, backoff_s=2.0)
    # and it still does its job: a host dies (supervisor + recovery), a model hangs (watchdog)
    sc = scenario()
    ids = [f"{role}{i}" for i in range(10)]
    hang = scenario(name="hang", faults=[{"at_call": 2, "kind": "hang"}])
    await rt.submit(*scripted_turn(sc), ids)
    await rt.submit(*scripted_turn(hang), [f"{role}-hang"])
    await checkpoints_written(real_client, rt.dep.keys, 11 + 10)
    await rt.kill_host(rt.dep.slot_of(ids[0]))
    finals = await rt.wait([*ids, f"{role}-hang"], timeout=180)
    assert finals[f"{role}-hang"].counters.outcome == "aborted:hard_idle_timeout"
    del finals[f"{role}-hang"]
    await assert_all_correct(rt, real_client, sc, finals)


async def freeze_a_host(
    start_runtime: StartRuntime, client: aioredis.Redis, sc: Scenario, prefix: str
) -> tuple[Runtime, list[str], int, Any, int, list[str]]:
    """Start 20 turns on 2 hosts that do not kill what they replace, then SIGSTOP the host of
    the first turn: (runtime, turn ids, its slot, its handle, its pid, its turns in progress)."""
    rt = await start_runtime(
        hosts=2, supervisor={"ping_timeout_s": 0.5, "lease_ttl_s": 1.0, "kill_replaced": False}
    )
    ids = [f"{prefix}{i:03d}" for i in range(20)]
    await rt.submit(*scripted_turn(sc), ids)
    await checkpoints_written(client, rt.dep.keys, 20 + 20)
    slot = rt.dep.slot_of(ids[0])
    zombie = await rt.hosts.handle(slot)
    pid = await rt.kill_host(slot, signal.SIGSTOP)
    frozen = [t for t in await rt.store.list_in_progress() if rt.dep.slot_of(t) == slot]
    assert frozen
    return rt, ids, slot, zombie, pid, frozen


async def test_a_frozen_host_is_replaced_and_its_zombie_writes_are_refused(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    sc = scenario(llm_latency_ms=300)
    rt, ids, slot, zombie, pid, frozen = await freeze_a_host(start_runtime, real_client, sc, "z")

    async def claimed() -> bool:
        # replaced, and the successor holds every turn the frozen host had in progress
        if await rt.respawns() < 1:
            return False
        records = [await rt.store.load(t) for t in frozen]
        return all(r.epoch >= 2 or not r.in_progress for r in records)

    try:
        await eventually(claimed, timeout=60, what="the frozen host's turns claimed")
    finally:
        os.kill(pid, signal.SIGCONT)
    finals = await rt.wait(ids, timeout=180)
    await assert_all_correct(rt, real_client, sc, finals)
    assert set((await final_events(real_client, rt.dep.keys)).values()) == {1}  # none twice

    async def zombie_fenced() -> HostInfo | None:
        info = await zombie.hello()
        return info if info.running == 0 else None

    info = await eventually(zombie_fenced, timeout=60, what="the zombie to give up its turns")
    # Woken up, the zombie finished nothing: each of its turns ended refused by the fence
    # ("fenced") or cut off by Redis having dropped its stale connections ("interrupted").
    assert info.outcomes and set(info.outcomes) <= {"fenced", "interrupted"}, info
    taken_over = [t for t in ids if rt.dep.slot_of(t) == slot]
    assert taken_over and all(finals[t].epoch >= 2 for t in taken_over)
    zombie.kill()


async def test_a_woken_zombie_cannot_dispatch_a_non_idempotent_call(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """A SIGSTOPped host, woken after its successor claimed its turns, races the successor on
    the next tool dispatch: the fence refuses it, so no call runs twice."""
    sc = scenario(tools=["counter_increment"], llm_latency_ms=300)
    rt, ids, _, zombie, pid, frozen = await freeze_a_host(start_runtime, real_client, sc, "zd")

    async def claimed() -> bool:
        records = [await rt.store.load(t) for t in frozen]
        return all(r.epoch >= 2 or not r.in_progress for r in records)

    try:
        await eventually(claimed, timeout=60, what="the frozen host's turns claimed")
    finally:
        os.kill(pid, signal.SIGCONT)  # wake the zombie: its model calls end, it tries to dispatch
    finals = await rt.wait(ids, timeout=180)
    assert all(not f.in_progress for f in finals.values())
    effects = EffectCounters(real_client, rt.dep.keys)
    for t in ids:
        counts = await effects.counts(t)
        assert counts and max(counts.values()) == 1, (t, counts)

    async def zombie_fenced() -> HostInfo | None:
        info = await zombie.hello()
        return info if info.running == 0 else None

    info = await eventually(zombie_fenced, timeout=60, what="the zombie to give up its turns")
    assert info.outcomes and set(info.outcomes) <= {"fenced", "interrupted"}, info
    zombie.kill()


async def test_watchdog_soft_then_hard_on_a_hanging_model(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    rt = await start_runtime(
        hosts=1, watchdog={"tick_s": 0.1, "soft_idle_s": 0.5, "hard_idle_s": 2.0}
    )
    sc = scenario(name="hang", faults=[{"at_call": 3, "kind": "hang"}])
    await rt.submit(*scripted_turn(sc), ["hung"])
    (final,) = (await rt.wait(["hung"], timeout=60)).values()
    assert final.counters.outcome == "aborted:hard_idle_timeout"
    assert not final.in_progress and len(final.messages) == 2 + 2 * 3  # partial, saved
    keys = rt.dep.keys

    async def both_published() -> list[StatusEvent] | None:
        # advisory events: the watchdog publishes the cancel's after sending it, so it may land
        # after the turn's final save
        found = [
            e for _, f in await real_client.xrange(keys.bus(keys.shard_of("hung")))
            if isinstance(e := decode_event(f), StatusEvent)
        ]  # fmt: skip
        kinds = {s.status for s in found}
        return found if {"idle_soft", "hard_idle_timeout"} <= kinds else None

    statuses = await eventually(both_published, timeout=30, what="both status events")
    kinds = [s.status for s in statuses]
    assert kinds.index("idle_soft") < kinds.index("hard_idle_timeout")
    assert "waiting for the model" in statuses[kinds.index("idle_soft")].label


async def test_injected_messages_during_a_turn_and_during_recovery(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    rt = await start_runtime(hosts=2)
    sc = scenario(llm_latency_ms=300)
    live, crashed = "inject-live", "inject-crash"
    await rt.submit(*scripted_turn(sc), [live, crashed])
    await checkpoints_written(real_client, rt.dep.keys, 2 + 2)
    await rt.inject(live, "hello during the turn", message_id="m-live")
    before = await rt.store.load(crashed)
    await rt.kill_host(rt.dep.slot_of(crashed))
    await rt.inject(crashed, "hello during recovery", message_id="m-crash")
    finals = await rt.wait([live, crashed], timeout=120)
    for tid, mid in ((live, "m-live"), (crashed, "m-crash")):
        ids = [m.message_id for m in finals[tid].meta]
        assert ids.count(mid) == 1, tid
        assert ids.index(mid) >= 2
        assert finals[tid].counters.inbox_offset == 1
    # the recovered turn got it after its restored transcript, not inside it
    assert [m.message_id for m in finals[crashed].meta].index("m-crash") >= len(before.messages)


async def test_approvals_through_the_runtime(start_runtime: StartRuntime) -> None:
    rt = await start_runtime(hosts=1)
    sc = scenario(rounds=1, tools_per_round=1, require_approval=["echo"], llm_latency_ms=10)
    await rt.submit(*scripted_turn(sc), ["gate"])

    async def pending() -> list[str] | None:
        return [w.call_key for w in await rt.waiting("gate")] or None

    (key,) = await eventually(pending, timeout=60, what="the approval request")
    digest = key.split(".")[-1]
    assert await rt.decide("gate", digest[:6], approve=True) == key  # a start of its digest
    (final,) = (await rt.wait(["gate"], timeout=60)).values()
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.status == "ok"
    assert (
        await rt.submit(*scripted_turn(sc), ["gate"]) == []
    )  # resubmitting is a no-op, not a second run


async def test_a_cancel_ends_a_turn_on_ray_also_across_a_sigkill_of_its_host(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    rt = await start_runtime(hosts=2)
    sc = scenario(rounds=20, llm_latency_ms=3_000)  # every model call takes 3 s
    ids = ["cx-told", "cx-killed"]
    await rt.submit(*scripted_turn(sc), ids)
    await checkpoints_written(real_client, rt.dep.keys, 4)  # both under way
    # told at once: the in-flight model call is cancelled, the turn ends
    assert await rt.cancel("cx-told", "enough", by="ops") is Cancelled.REQUESTED
    # only written to Redis, then its host is killed before any boundary: the incarnation
    # that resumes it reads the request first
    assert await request_cancel(rt.store, rt.inbox, "cx-killed", "stop") is Cancelled.REQUESTED
    await rt.kill_host(rt.dep.slot_of("cx-killed"))
    finals = await rt.wait(ids, timeout=180)
    told, killed = finals["cx-told"], finals["cx-killed"]
    assert told.counters.outcome == Outcome.CANCELLED and told.counters.cancel_reason == (
        "enough (by ops)"
    )
    assert killed.counters.outcome == Outcome.CANCELLED and killed.counters.cancel_reason == "stop"
    assert killed.epoch >= 2 and killed.counters.resume_attempts >= 1
    assert all(len(f.messages) < 2 + 20 * 3 for f in finals.values())  # neither ran to its end
    with pytest.raises(TurnNotRunning):
        await rt.cancel("cx-told")


async def test_a_queued_message_opens_the_sessions_next_turn_on_ray(
    start_runtime: StartRuntime,
) -> None:
    rt = await start_runtime(hosts=2)
    recall = "tests.support.agents:recall"
    first = await rt.submit_in_session(recall, "#sleep 2", "rq")
    assert first.turn_id == "rq/1"
    queued = await rt.submit_in_session(recall, "then this", "rq", if_busy=IfBusy.QUEUE)
    assert (queued.turn_id, queued.queued_behind, queued.place) == (None, "rq/1", 1)
    # the host that ends rq/1 opens rq/2 from the queue and it runs

    async def opened() -> bool:
        return await rt.sessions.latest("rq") == "rq/2"

    await eventually(opened, timeout=60, what="the queued turn to open")
    (done,) = (await rt.wait(["rq/2"], timeout=120)).values()
    assert done.answer == "heard: #sleep 2 | then this"


async def test_a_turn_failing_on_a_live_host_is_suspended_not_spun(
    start_runtime: StartRuntime, real_client: aioredis.Redis
) -> None:
    """A bug that fails one turn on every run (the buggy model adapter's KeyError): its host
    backs off and, after three runs, suspends it with the error; a turn beside it answers."""
    rt = await start_runtime(hosts=2)
    await rt.submit("tests.support.agents:buggy", "2+3", ["buggy"])
    await rt.submit("tests.support.agents:calculator", "2+3", ["fine"])
    finals = await rt.wait(["buggy", "fine"], timeout=120)
    assert finals["fine"].counters.outcome is Outcome.ANSWERED
    bug = finals["buggy"]
    assert bug.counters.outcome is Outcome.SUSPENDED_FAILING and not bug.in_progress
    # three runs, not thousands: two resumed after a backoff (what the live stream says),
    # then the suspension. The first run is epoch 1, or 2 when an adopt claimed the turn
    # between its submission and its hand-over to the host (harmless, and seen in CI).
    live = [decode_event(f) for _, f in await real_client.xrange(rt.dep.keys.live("buggy"))]
    reruns = [
        e for e in live if isinstance(e, Recovering) and e.problem is EngineProblem.RUN_FAILED
    ]
    assert len(reruns) == 2 and bug.epoch in (3, 4)
    error = bug.counters.last_error
    assert error is not None and "KeyError: 'choices'" in error.message
    # The calculator's batch on Ray: its three calls of the idempotent ``add`` went to a
    # worker together, each with its own end, as they do in one process
    # (tests/engine/test_agents.py::test_bad_calls_become_error_results_the_model_reads).
    ends = {m.tool_result.call_id: m.tool_result for m in finals["fine"].messages if m.tool_result}
    assert (ends["c1"].status, ends["c1"].output) == ("ok", "5")
    assert ends["c2"].status == "error" and "a: Input should be a valid integer" in (
        ends["c2"].output
    )
    assert ends["c4"].status == "error" and "nosuch" in ends["c4"].output
    assert ends["c5"].status == "error" and "RuntimeError: on purpose" in ends["c5"].output
