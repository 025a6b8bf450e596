"""The turn loop against a real redis-server: checkpoint sites, recovery paths, ledger, inbox."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.cancel import Cancelled, request_cancel
from actors.engine.models.scenario import Scenario, parse_scenario
from actors.engine.models.scripted import OVERSIZED_REPLY_BYTES, ScriptedLLM, scripted_turn
from actors.engine.resume import Resume, claim_for_resume, plan_resume
from actors.engine.run_stats import still_in_progress
from actors.engine.settings.engine_settings import EngineHooks, EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.llm import LLMReply, LLMRequest
from actors.turn.loop import TurnLoop
from actors.turn.model_steps import reply_bytes
from actors.turn.poison import ISOLATE_AFTER
from actors.turn.run_result import RunStop, TurnOutcome
from actors.turn.settings import LoopSettings
from actors.turn.watchdog import WatchdogSettings
from bus.errors import AwaitingAdmission, StoreError, StoreUnavailable, TurnNotRunning
from bus.messages import ToolResult
from bus.outcomes import Outcome, SaveReason
from bus.phase import Transition, TurnPhase
from store.domain.ledger import call_key
from store.keys import KeyLayout
from store.records import CheckpointRecord, InboxItem, LedgerEntry, SaveAck, Settle
from store.redis.connection import connect
from store.redis.embedded import EmbeddedRedis
from store.write.checkpoint import RedisCheckpointStore
from tests.support.polling import eventually
from tests.support.records import put_ledger

P = TurnPhase
FAST = LoopSettings(
    strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01, approval_poll_s=0.01
)


def scenario(**kw: Any) -> Scenario:
    return parse_scenario(
        {"name": "t", "rounds": 3, "tools_per_round": 2, "payload_bytes": 50, **kw}
    )


class Recorder:
    """A Checkpointer that records what it saved (and can be told to fail)."""

    def __init__(self, store: RedisCheckpointStore, fail: int = 0) -> None:
        self.store = store
        self.saved: list[CheckpointRecord] = []
        self.carried: list[int] = []
        """How many tool outcomes each save carried."""
        self.fail = fail

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        if self.fail:
            self.fail -= 1
            raise StoreError("injected failure")
        ack = await self.store.save(record, settles)
        self.saved.append(record)
        self.carried.append(len(settles))
        return ack


def make_engine(client: aioredis.Redis, keys: KeyLayout, **kw: Any) -> TurnEngine:
    """An engine on the test loop settings; ``kw`` are :class:`EngineSettings` fields."""
    return TurnEngine(client, keys, EngineSettings(**{"loop": FAST, **kw}))


async def run_with_recorder(
    engine: TurnEngine, sc: Scenario, turn_id: str, *, fail: int = 0, settings: LoopSettings = FAST
) -> tuple[TurnLoop, Recorder, list[Transition]]:
    record = await engine.submit(*scripted_turn(sc), turn_id)
    rec = Recorder(engine.store, fail)
    moves: list[Transition] = []
    loop = await engine.build_loop(
        record,
        await engine.store.load_spec(record.turn_id),
        settings=settings,
        checkpoints=rec,
        listener=moves.append,
    )
    await engine.drive(loop)
    return loop, rec, moves


def assert_well_formed(r: CheckpointRecord, pre_meta: tuple[Any, ...]) -> None:
    assert len(r.meta) == len(r.messages)
    assert r.meta[: r.baseline] == pre_meta
    ids = [m.message_id for m in r.meta]
    assert len(ids) == len(set(ids)), "duplicate messages in a checkpoint"


async def test_fault_free_turn_checkpoints_at_each_batch_and_final(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    _, rec, moves = await run_with_recorder(engine, scenario(), "plain")
    assert [r.reason for r in rec.saved] == ["tool_batch"] * 3 + ["final"]
    assert [r.seq for r in rec.saved] == [1, 2, 3, 4]
    pre = rec.saved[0].meta[:2]
    for r in rec.saved:
        assert_well_formed(r, pre)
    # each checkpoint extends the previous one: the final save duplicates nothing
    for a, b in itertools.pairwise(rec.saved):
        assert b.messages[: len(a.messages)] == a.messages
    stored = await engine.store.load("plain")
    assert stored == rec.saved[-1] and not stored.in_progress
    assert len(stored.messages) == 2 + 3 * 3 + 1
    assert stored.counters.outcome == "answered"
    assert moves[-1].dst is P.DONE
    assert await engine.store.list_in_progress() == []


async def test_idempotent_rebuild_across_a_shrinking_compaction(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    sc = scenario(rounds=5, faults=[{"at_call": 4, "kind": "context_length"}])
    engine = make_engine(real_client, keys)
    _, rec, moves = await run_with_recorder(engine, sc, "compact")
    reasons = [r.reason for r in rec.saved]
    assert reasons == ["tool_batch"] * 3 + ["compaction"] + ["tool_batch"] * 2 + ["final"]
    pre = rec.saved[0].meta[:2]
    for r in rec.saved:
        assert_well_formed(r, pre)
    before, after = rec.saved[2], rec.saved[3]
    assert len(after.messages) < len(before.messages)  # compaction shrank the list
    assert after.counters.reactive_compacted
    assert P.COMPACTING in {m.dst for m in moves}
    final = rec.saved[-1]
    assert final.counters.outcome == "answered"
    # compare with the same scenario run again: same transcript, message for message
    _, rec2, _ = await run_with_recorder(engine, sc, "compact-again")
    assert rec2.saved[-1].messages == final.messages


async def test_retryable_errors_back_off_in_retrying_llm_and_leave_no_trace(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    faulty = scenario(faults=[{"at_call": 2, "kind": "retryable", "times": 3}])
    _, rec, moves = await run_with_recorder(engine, faulty, "retry")
    assert [m.dst for m in moves].count(P.RETRYING_LLM) == 3
    assert rec.saved[-1].counters.outcome == "answered"
    _, clean, _ = await run_with_recorder(engine, scenario(), "clean")
    assert rec.saved[-1].messages == clean.saved[-1].messages


async def test_four_retryable_errors_abort(real_client: aioredis.Redis, keys: KeyLayout) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(faults=[{"at_call": 2, "kind": "retryable", "times": 4}])
    _, rec, _ = await run_with_recorder(engine, sc, "giveup")
    final = rec.saved[-1]
    assert final.counters.outcome == "aborted:retryable" and not final.in_progress
    assert len(final.messages) == 2 + 3  # the first round was kept


async def test_a_loop_is_nudged_then_force_stopped_with_a_checkpoint_first(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(rounds=20, tools_per_round=1, faults=[{"at_call": 2, "kind": "loop"}])
    _, rec, moves = await run_with_recorder(engine, sc, "loopy")
    final = rec.saved[-1]
    assert final.counters.outcome == "force_stopped"
    assert final.counters.nudges == 3  # the 3rd, 4th and 5th same result in a row
    assert rec.saved[-2].reason == "force_stop"
    stop_save = rec.saved[-2]
    assert stop_save.phase is P.AWAITING_LLM  # saved *before* entering force_stop
    assert [m.dst for m in moves][-2:] == [P.FORCE_STOP, P.DONE]
    nudges = [m for m, meta in zip(final.messages, final.meta, strict=True) if meta.system_injected]
    assert len(nudges) == 3 and all(m.text.startswith("[nudge]") for m in nudges)
    skipped = [m for m in final.messages if m.tool_result and m.tool_result.status == "skipped"]
    assert len(skipped) == 4
    assert "returned the same result 3 times in a row" in skipped[0].tool_result.output  # type: ignore[union-attr]
    assert final.messages[-1].text.startswith("Stopping here.")


async def test_an_empty_reply_is_nudged_once(real_client: aioredis.Redis, keys: KeyLayout) -> None:
    engine = make_engine(real_client, keys)
    _, rec, moves = await run_with_recorder(
        engine, scenario(faults=[{"at_call": 2, "kind": "empty"}]), "empty"
    )
    final = rec.saved[-1]
    assert final.counters.outcome == "answered" and final.counters.nudges == 1
    assert P.INJECTING_MESSAGE in {m.dst for m in moves}


async def test_an_oversized_reply_is_not_kept_and_the_model_is_told_its_size(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(faults=[{"at_call": 2, "kind": "oversized"}])
    _, rec, _ = await run_with_recorder(engine, sc, "big")
    final = rec.saved[-1]
    assert final.counters.outcome == "answered" and final.counters.nudges == 1
    assert max(reply_bytes(m) for m in final.messages) < FAST.max_reply_bytes  # never stored
    (nudge,) = [
        m for m, meta in zip(final.messages, final.meta, strict=True) if meta.system_injected
    ]
    assert f"it was {OVERSIZED_REPLY_BYTES:,} bytes" in nudge.text
    assert f"over the limit of {FAST.max_reply_bytes:,} bytes" in nudge.text
    error = final.counters.last_error
    assert error is not None and error.kind == "oversized_reply"


async def test_replies_that_stay_oversized_end_the_turn_after_three_nudges(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(faults=[{"at_call": 1, "kind": "oversized", "times": 4}])
    _, rec, _ = await run_with_recorder(engine, sc, "huge")
    final = rec.saved[-1]
    assert final.counters.outcome == Outcome.ABORTED_OVERSIZED_REPLY and not final.in_progress
    assert final.counters.nudges == 3
    assert max(reply_bytes(m) for m in final.messages) < FAST.max_reply_bytes


async def test_a_failed_save_stays_dirty_and_is_retried_at_the_next_site(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    loop, rec, _ = await run_with_recorder(engine, scenario(), "flaky", fail=1)
    assert loop.failed_saves == 1
    assert [r.reason for r in rec.saved] == ["tool_batch", "tool_batch", "final"]
    assert len(rec.saved[0].messages) == 2 + 2 * 3  # the retry carried the first batch too


async def test_every_tool_outcome_is_journaled_whether_a_save_carries_it_or_not(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    debounced = LoopSettings(strict=True, checkpoint_min_interval_s=3600)
    alone = scenario(tools=["counter_increment"])  # not idempotent: each call runs alone
    runs = {
        "carried": await run_with_recorder(engine, scenario(), "carried"),
        "debounced": await run_with_recorder(engine, scenario(), "debounced", settings=debounced),
        "failed": await run_with_recorder(engine, scenario(), "failed", fail=1),
        "alone": await run_with_recorder(engine, alone, "alone"),
        "alone-debounced": await run_with_recorder(
            engine, alone, "alone-debounced", settings=debounced
        ),
    }
    for turn_id in runs:
        entries = await engine.ledger.entries(turn_id)
        assert len(entries) == 3 * 2 and {e.state for e in entries.values()} == {"committed"}
    # A batch of two echo calls runs as one group: both outcomes ride on its checkpoint.
    assert runs["carried"][1].carried == [2, 2, 2, 0]
    assert runs["debounced"][1].carried == [2, 0]  # the others were journaled alone
    # Two calls that run each alone: the one that ended the batch rode on its checkpoint.
    assert runs["alone"][1].carried == [1, 1, 1, 0]
    assert runs["alone-debounced"][1].carried == [1, 0]


async def test_the_inbox_is_skipped_only_where_a_save_just_said_it_is_empty(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    reads: list[int] = []

    class CountingInbox:
        async def read_from(self, turn_id: str, offset: int) -> list[InboxItem]:
            reads.append(offset)
            return await engine.inbox.read_from(turn_id, offset)

    # Saved batches (the boundary after each is told the inbox is empty), then batches skipped
    # as a loop (no save: the boundary after each reads it).
    sc = scenario(rounds=20, tools_per_round=1, faults=[{"at_call": 2, "kind": "loop"}])
    record = await engine.submit(*scripted_turn(sc), "stale")
    loop = await engine.build_loop(
        record, await engine.store.load_spec("stale"), settings=FAST, inbox=CountingInbox()
    )
    await engine.drive(loop)
    final = await engine.store.load("stale")
    assert final.counters.nudges == 3
    assert len(reads) == 1 + 3  # the start (nothing said yet), and after each skipped batch


async def test_min_interval_debounces_mid_turn_saves_only(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    slow = LoopSettings(strict=True, checkpoint_min_interval_s=3600)
    _, rec, _ = await run_with_recorder(engine, scenario(), "debounced", settings=slow)
    assert [r.reason for r in rec.saved] == ["tool_batch", "final"]
    assert rec.saved[-1].counters.outcome == "answered"


async def test_a_fenced_loop_stops_without_further_side_effects(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(tools=["counter_increment"], rounds=4, tools_per_round=1)
    record = await engine.submit(*scripted_turn(sc), "zombie")
    slow_model = ScriptedLLM(sc.model_copy(update={"llm_latency_ms": 100}), baseline=2)
    loop = await engine.build_loop(
        record, await engine.store.load_spec(record.turn_id), llm=slow_model
    )

    async def first_batch_saved() -> CheckpointRecord | None:
        r = await engine.store.load("zombie")
        return r if r.reason == "tool_batch" else None

    async def usurp() -> None:
        # a new owner claims the turn as soon as the first batch is checkpointed
        saved = await eventually(first_batch_saved, what="first checkpoint")
        await engine.store.save(claim_for_resume(saved, now_ms=1))

    thief = asyncio.ensure_future(usurp())
    outcome = await engine.drive(loop)
    await thief
    assert outcome.outcome == "fenced"
    effects = await engine.effects.counts("zombie")
    # batch 1 ran once; batch 2's dispatch was fenced (the claim landed), so it never ran
    assert len(effects) == 1 and set(effects.values()) == {1}
    stored = await engine.store.load("zombie")
    assert stored.epoch == 2 and stored.in_progress


async def test_an_in_progress_record_without_a_spec_is_quarantined_not_replanned(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    await engine.submit(*scripted_turn(scenario()), "nospec")
    await engine.submit(*scripted_turn(scenario()), "fine")
    await real_client.delete(keys.spec("nospec"))
    lost = await plan_resume(engine.store, engine.ledger, engine.inbox, "nospec")
    assert lost.what == "unusable" and "no spec" in lost.detail
    assert "nospec" in await engine.store.quarantined()
    # out of the in-progress index, so the next adopt does not plan it again
    assert await engine.store.list_in_progress() == ["fine"]
    ok = await plan_resume(engine.store, engine.ledger, engine.inbox, "fine")
    assert isinstance(ok, Resume) and ok.record.epoch == 2


async def test_only_resumes_without_progress_count_towards_isolation(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)

    async def plan(turn_id: str) -> str:
        return (await plan_resume(engine.store, engine.ledger, engine.inbox, turn_id)).what

    # claimed again and again before it saved anything: not aborted, but isolated
    await engine.submit(*scripted_turn(scenario()), "stuck")
    assert [await plan("stuck") for _ in range(ISOLATE_AFTER)] == ["resume"] * (
        ISOLATE_AFTER - 1
    ) + ["isolate"]
    stuck = await engine.store.load("stuck")
    assert stuck.in_progress and stuck.counters.stalled_resumes == ISOLATE_AFTER - 1

    # a turn that saves a checkpoint after every claim is resumed in place as often as it takes
    await engine.submit(*scripted_turn(scenario()), "busy")
    for n in range(1, 7):
        assert await plan("busy") == "resume"
        claimed = await engine.store.load("busy")
        assert claimed.counters.stalled_resumes == 1 and claimed.counters.resume_attempts == n
        progress = claimed.model_copy(
            update={"seq": claimed.seq + 1, "reason": SaveReason.TOOL_BATCH}
        )
        await engine.store.save(progress)
    assert (await engine.resume("busy")).outcome == "answered"


async def test_ledger_reuses_committed_and_reports_in_flight_non_idempotent_calls(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(tools=["counter_increment", "echo"], rounds=1, tools_per_round=3)
    record = await engine.submit(*scripted_turn(sc), "ledger")
    model = ScriptedLLM(sc, baseline=2)  # what the model will ask for first
    first = (await model.complete(LLMRequest("ledger", record.messages, True, 0))).message
    names = [c.name for c in first.tool_calls]
    assert names == ["counter_increment", "echo", "counter_increment"]
    k = [call_key("ledger", 0, c, i) for i, c in enumerate(first.tool_calls)]
    # as left by a host that died mid-batch: call 0 in flight, 1 in flight, 2 committed
    done = ToolResult(call_id="old", name=names[2], status="ok", output="count=1")
    await put_ledger(real_client, keys, "ledger", {
        k[0]: LedgerEntry(state="dispatched", name=names[0]),
        k[1]: LedgerEntry(state="dispatched", name=names[1]),
        k[2]: LedgerEntry(state="committed", name=names[2], result=done),
    })  # fmt: skip
    await engine.effects.increment("ledger", k[2])
    outcome = await engine.start(record, await engine.store.load_spec(record.turn_id))
    assert outcome.outcome == "answered"
    final = await engine.store.load("ledger")
    results = [m.tool_result for m in final.messages if m.tool_result]
    assert [r.status for r in results] == ["outcome_unknown", "ok", "ok"]
    assert results[2].output == "count=1"  # reused, not re-run
    assert results[1].output == first.tool_calls[1].args["text"]  # idempotent: re-run
    assert await engine.effects.counts("ledger") == {k[2]: 1}  # nothing ran twice
    states = {key: e.state for key, e in (await engine.ledger.entries("ledger")).items()}
    assert states == {k[0]: "outcome_unknown", k[1]: "committed", k[2]: "committed"}


async def test_injected_messages_enter_once_at_the_next_boundary(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(llm_latency_ms=20)
    record = await engine.submit(*scripted_turn(sc), "inbox")
    await engine.inbox.push("inbox", "before the first call", message_id="early")
    pushes: list[asyncio.Future[object]] = []

    def on_move(t: Transition) -> None:
        if t.dst is P.EXECUTING_TOOLS and not pushes:
            pushes.append(
                asyncio.ensure_future(engine.inbox.push("inbox", "mid", message_id="mid"))
            )

    engine.hooks = EngineHooks(on_transition=on_move)
    await engine.start(record, await engine.store.load_spec(record.turn_id))
    await asyncio.gather(*pushes)
    final = await engine.store.load("inbox")
    ids = [m.message_id for m in final.meta]
    assert ids.count("early") == 1 and ids.count("mid") == 1
    assert ids.index("early") == 2  # right after the baseline
    assert ids.index("mid") > ids.index("early") + 3  # after the first tool batch
    assert final.counters.inbox_offset == 2
    assert final.meta[ids.index("mid")].source == "inbox"


@pytest.mark.parametrize(
    ("decision", "status"), [(True, "ok"), (False, "denied"), (None, "denied")]
)
async def test_approvals_wait_in_a_transient_and_deny_after_the_cap(
    real_client: aioredis.Redis, keys: KeyLayout, decision: bool | None, status: str
) -> None:
    settings = LoopSettings(
        strict=True, checkpoint_min_interval_s=0, approval_timeout_s=0.3, approval_poll_s=0.01
    )
    engine = make_engine(real_client, keys, loop=settings)
    sc = scenario(rounds=1, tools_per_round=1, require_approval=["echo"])
    record = await engine.submit(*scripted_turn(sc), "gate")
    moves: list[Transition] = []
    engine.hooks = EngineHooks(on_transition=moves.append)
    task = asyncio.ensure_future(engine.start(record, await engine.store.load_spec(record.turn_id)))

    async def pending() -> str | None:
        return engine.pending_approval("gate")

    key = await eventually(pending, what="the approval request")
    (asked,) = (await engine.approvals.pending("gate")).items()
    assert asked[0] == key and asked[1].tool == "echo" and '"text"' in asked[1].args
    if decision is not None:
        assert await engine.approvals.decide("gate", key, decision, by="ops", reason="looked")
        assert not await engine.approvals.decide("gate", key, not decision)  # first wins
    await task
    final = await engine.store.load("gate")
    ((result, meta),) = [
        (m.tool_result, meta) for m, meta in zip(final.messages, final.meta, strict=True)
        if m.tool_result
    ]  # fmt: skip
    assert result.status == status
    # who decided, and why, stays with the result
    assert meta.approval is not None
    assert (meta.approval.by, meta.approval.reason) == (
        ("ops", "looked") if decision is not None else ("timeout", "no decision within 0.3 s")
    )
    if status == "denied":
        assert meta.approval.note() in result.output
    dsts = [m.dst for m in moves]
    i = dsts.index(P.AWAITING_APPROVAL)
    assert dsts[i + 1] is P.EXECUTING_TOOLS  # restored


async def test_hang_gets_soft_then_hard_idle_and_keeps_the_partial_transcript(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    statuses: list[Any] = []
    engine = make_engine(
        real_client, keys, watchdog=WatchdogSettings(tick_s=0.02, soft_idle_s=0.1, hard_idle_s=0.4)
    )
    engine.hooks = EngineHooks(on_status=statuses.append)
    sc = scenario(faults=[{"at_call": 2, "kind": "hang"}])
    stats = await engine.run_new(*scripted_turn(sc), ["hung"])
    assert stats.outcomes == {"aborted:hard_idle_timeout": 1}
    assert stats.idle_soft == 1 and stats.hard_cancels == 1
    assert statuses[0].turn_id == "hung" and "waiting for the model" in statuses[0].label
    final = await engine.store.load("hung")
    assert not final.in_progress and len(final.messages) == 2 + 3


async def test_a_turn_outgrowing_the_record_cap_ends_on_its_last_checkpoint(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """the turn ends aborted:record_too_large, its last checkpoint intact."""
    engine = make_engine(real_client, keys, max_record_bytes=6000)
    sc = scenario(rounds=10, tools_per_round=1, payload_bytes=700)
    _, rec, _ = await run_with_recorder(engine, sc, "big")
    final = await engine.store.load("big")
    assert final.counters.outcome == "aborted:record_too_large" and not final.in_progress
    last_mid_turn = rec.saved[-2]
    assert last_mid_turn.reason == "tool_batch" and last_mid_turn.in_progress
    assert final.messages == last_mid_turn.messages and final.meta == last_mid_turn.meta
    assert final.seq > last_mid_turn.seq


class WatchedLLM:
    """The scripted model, telling the test when a reply is handed back after ``killed``: the
    loop's next step is a Redis write, made before the test runs again."""

    def __init__(self, inner: ScriptedLLM) -> None:
        self.inner = inner
        self.killed = False
        self.replied_after_kill = asyncio.Event()

    async def complete(self, request: LLMRequest) -> LLMReply:
        reply = await self.inner.complete(request)
        if self.killed:
            self.replied_after_kill.set()
        return reply


@pytest.mark.parametrize(("retry_s", "expected"), [(10.0, "answered"), (0.0, "interrupted")])
async def test_a_redis_restart_mid_turn_is_ridden_out(
    tmp_path: Path, keys: KeyLayout, retry_s: float, expected: str
) -> None:
    """a restart of a few seconds no longer ends the turn at the first
    failed call; with retries off (``retry_s = 0``) it is interrupted as before."""
    with EmbeddedRedis(data_dir=tmp_path, appendfsync="always") as server:
        client = connect(server.url, retry_s=retry_s)
        engine = make_engine(client, keys, watchdog=None)
        sc = scenario(rounds=8, tools_per_round=1, llm_latency_ms=150)
        record = await engine.submit(*scripted_turn(sc), "bumpy")
        model = WatchedLLM(ScriptedLLM(sc, baseline=record.baseline))
        turn = asyncio.ensure_future(
            engine.drive(
                await engine.build_loop(
                    record, await engine.store.load_spec(record.turn_id), llm=model
                )
            )
        )

        async def second_batch_saved() -> bool:
            return (await engine.store.load("bumpy")).seq >= 2

        await eventually(second_batch_saved, what="two checkpoints")
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        model.killed = True
        await model.replied_after_kill.wait()  # the turn is now writing to the dead server
        await asyncio.to_thread(server.restart)
        outcome = await turn
        assert outcome.outcome == expected
        if expected == "answered":
            final = await engine.store.load("bumpy")
            assert not final.in_progress and len(final.messages) == 2 + 8 * 2 + 1
        await client.aclose()


async def test_a_cancel_ends_a_running_turn_now_and_frees_nothing_twice(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    sc = scenario(rounds=50, llm_latency_ms=30_000)  # every model call would take 30 s
    record = await engine.submit(*scripted_turn(sc), "cancelled")
    running = asyncio.ensure_future(
        engine.start(record, await engine.store.load_spec(record.turn_id))
    )

    async def in_the_model_call() -> bool:
        return "cancelled" in engine.running() and engine.phases()[0].dst is P.AWAITING_LLM

    await eventually(in_the_model_call, timeout=10, what="the turn's first model call")
    done = await request_cancel(engine.store, engine.inbox, "cancelled", "wrong task", by="ops")
    assert done is Cancelled.REQUESTED
    assert engine.cancel("cancelled")  # its host is told: the 30 s call ends now
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.outcome == Outcome.CANCELLED
    final = await engine.store.load("cancelled")
    assert not final.in_progress and final.counters.outcome == Outcome.CANCELLED
    assert final.counters.cancel_reason == "wrong task (by ops)"
    assert final.counters.inbox_offset == 1  # the request is consumed, once
    with pytest.raises(TurnNotRunning):  # a finished turn takes no more entries
        await request_cancel(engine.store, engine.inbox, "cancelled", "again")
    with pytest.raises(TurnNotRunning):
        await engine.inbox.push("cancelled", "late message")
    with pytest.raises(TurnNotRunning):
        await request_cancel(engine.store, engine.inbox, "no-such-turn", "")


async def test_a_told_cancel_keeps_its_reason_when_the_last_save_predates_its_request(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """The host is told of a cancel whose request landed after the turn's last save had
    answered the inbox's length: the boundary reads the inbox all the same, so the turn ends
    with the request's reason and consumes it (it used to end with none: a CI run of the Ray
    cancel test saw ``cancelled`` in place of ``enough (by ops)``)."""
    engine = make_engine(real_client, keys)
    request = InboxItem(message_id="c1", text="wrong task", at_ms=0, cancel=True, by="ops")
    landed = False

    class LateInbox:  # the saves answer the real inbox's length, which never counts it
        async def read_from(self, turn_id: str, offset: int) -> list[InboxItem]:
            return [request][offset:] if landed else []

    sc = scenario(rounds=5, tools_per_round=1, tool_latency_ms=300)
    record = await engine.submit(*scripted_turn(sc), "late-cancel")
    loop = await engine.build_loop(
        record, await engine.store.load_spec("late-cancel"), settings=FAST, inbox=LateInbox()
    )
    running = asyncio.ensure_future(engine.drive(loop))

    async def in_the_batch() -> bool:
        return loop.tracker.phase is P.EXECUTING_TOOLS

    await eventually(in_the_batch, timeout=10, what="the turn's first tool batch")
    landed = True
    loop.request_cancel()  # told while the batch runs; its save will say the inbox is empty
    outcome = await asyncio.wait_for(running, 10)
    assert outcome.outcome == Outcome.CANCELLED
    final = await engine.store.load("late-cancel")
    assert final.counters.cancel_reason == "wrong task (by ops)"
    assert final.counters.inbox_offset == 1 and final.counters.tool_batches == 1


async def test_a_cancel_requested_before_a_crash_is_honoured_by_the_resumed_turn(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    record = await engine.submit(*scripted_turn(scenario()), "cancel-crash")
    # the request lands while no incarnation runs the turn (its host died)
    assert await request_cancel(engine.store, engine.inbox, "cancel-crash", "stop") is (
        Cancelled.REQUESTED
    )
    outcome = await engine.resume("cancel-crash")
    assert outcome.outcome == Outcome.CANCELLED
    final = await engine.store.load("cancel-crash")
    assert final.counters.cancel_reason == "stop" and final.epoch == record.epoch + 1
    assert [m.role for m in final.messages] == [m.role for m in record.messages]  # no call made


async def test_cancelling_a_suspended_turn_ends_it(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    engine = make_engine(real_client, keys)
    record = await engine.submit(*scripted_turn(scenario()), "parked")
    parked = record.model_copy(
        update={
            "seq": 1, "in_progress": False, "reason": SaveReason.SUSPENDED,
            "counters": record.counters.model_copy(update={"outcome": Outcome.SUSPENDED_POISON}),
        }
    )  # fmt: skip
    await engine.store.save(parked)
    assert await request_cancel(engine.store, engine.inbox, "parked", "") is Cancelled.ENDED
    final = await engine.store.load("parked")
    assert final.counters.outcome == Outcome.CANCELLED and not final.in_progress


async def test_an_unreachable_redis_is_asked_about_once_at_the_end_of_a_run(
    real_client: aioredis.Redis, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ask retries for ``[redis] retry_s``: asking per turn made a run with Redis gone
    take minutes to exit."""
    engine = make_engine(real_client, keys)
    asked: list[str] = []

    async def gone(turn_id: str) -> CheckpointRecord:
        asked.append(turn_id)
        raise StoreUnavailable("Redis is gone")

    monkeypatch.setattr(engine.store, "load", gone)
    stopped = [TurnOutcome.stopped(f"t{i}", RunStop.INTERRUPTED, 1) for i in range(5)]
    left = await still_in_progress(engine.store, stopped, skip=set())
    assert left == [f"t{i}" for i in range(5)] and asked == ["t0"]


class WorkerLikeLLM:
    """A model client whose calls run elsewhere (:class:`~actors.turn.llm.RemoteCalls`, as a
    model worker's do): its first ask comes back held by the cluster's limiter after
    ``held_s`` there, one generation lost with its worker on the way; then the scripted
    model answers."""

    def __init__(self, inner: ScriptedLLM, held_s: float) -> None:
        self.inner = inner
        self.held_s = held_s
        self.asks = 0
        self._repaid = 0

    def end_call(self) -> None:
        pass

    def take_repaid(self) -> int:
        repaid, self._repaid = self._repaid, 0
        return repaid

    async def complete(self, request: LLMRequest) -> LLMReply:
        self.asks += 1
        if self.asks == 1:
            self._repaid += 1
            raise AwaitingAdmission("held", retry_after_s=0.01, held_s=self.held_s)
        return await self.inner.complete(request)


@pytest.mark.parametrize(
    ("held_s", "outcome", "calls"), [(0.05, "answered", 2), (0.3, "aborted:rate_limited", 0)]
)
async def test_a_call_held_by_the_limiter_is_no_model_call_and_its_hold_counts_to_the_cap(
    real_client: aioredis.Redis, keys: KeyLayout, held_s: float, outcome: str, calls: int
) -> None:
    """What the endpoint was asked is what ``model_calls`` counts (a call the limiter held back
    was never sent); a generation lost with its worker is counted repaid even when the ask
    that followed was held; the time a worker held the call counts against the rate-limit
    cap (0.2 s here) as if the loop had waited it."""
    engine = make_engine(real_client, keys, watchdog=None)
    sc = scenario(rounds=1, tools_per_round=1)
    record = await engine.submit(*scripted_turn(sc), f"held{held_s}")
    model = WorkerLikeLLM(ScriptedLLM(sc, baseline=record.baseline), held_s)
    settings = dataclasses.replace(FAST, rate_limit_max_wait_s=0.2)
    loop = await engine.build_loop(
        record, await engine.store.load_spec(record.turn_id), llm=model, settings=settings
    )
    result = await engine.drive(loop)
    final = await engine.store.load(record.turn_id)
    assert result.outcome == final.counters.outcome == outcome
    assert (final.counters.model_calls, model.asks) == (calls, calls + 1)
    assert final.counters.generations_repaid == 1
