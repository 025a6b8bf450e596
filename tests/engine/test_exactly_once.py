"""Exactly once against a model that never answers the same way twice (DESIGN §9).

The scripted model's ``random`` replies put fresh randomness in every reply and every call's
arguments, so a resume that asked the model again would get a different call under a different
key, and its non-idempotent tool would act twice. The side effects are counted from outside
(the effects hash the tool writes), never from the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from pathlib import Path

import redis.asyncio as aioredis

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.resume import LOST_REPLY_PREFIX, calls_since, lost_reply_note
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.harness.verdict import judge
from bus.messages import ToolResult
from bus.outcomes import Outcome, SaveReason
from store.codec import pack_model
from store.domain.effects import EffectCounters
from store.domain.ledger import ToolLedger, decode_reply
from store.keys import REPLY_FIELD, REPLY_REFUSED_FIELD, KeyLayout
from store.records import CheckpointRecord, LedgerEntry
from store.write.checkpoint import RedisCheckpointStore
from tests.engine.test_crash import spawn_run
from tests.support.polling import eventually
from tests.support.reference import FAST

TURNS = 20


def random_scenario(tmp: Path, tool_latency_ms: int) -> Path:
    """Two rounds of [echo, send] whose every reply is new: ``send`` acts at once, then waits
    ``tool_latency_ms`` for its acknowledgement (a kill then leaves its effect in flight)."""
    path = tmp / "random.toml"
    path.write_text(
        'name = "random"\nrounds = 2\ntools_per_round = 2\ntools = ["echo", "send"]\n'
        f"llm_latency_ms = 20\ntool_latency_ms = {tool_latency_ms}\npayload_bytes = 200\n"
        'replies = "random"\nseed = 7\n'
    )
    return path


async def test_sigkill_mid_batch_then_resume_runs_no_effect_twice_and_asks_no_reply_again(
    redis_url: str, real_client: aioredis.Redis, namespace: str, tmp_path: Path
) -> None:
    keys = KeyLayout(namespace, shards=16)  # the CLI's default shard count
    effects = EffectCounters(real_client, keys)
    ids = [f"once-t{i:06d}" for i in range(TURNS)]
    child = spawn_run(redis_url, namespace, random_scenario(tmp_path, 3000), TURNS, "once")
    try:

        async def every_send_in_flight() -> bool:
            assert child.poll() is None, "the run ended before the kill"
            return all([await effects.counts(t) for t in ids])

        await eventually(every_send_in_flight, timeout=60)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    store = RedisCheckpointStore(real_client, keys)
    assert sorted(await store.list_in_progress()) == ids
    ledger = ToolLedger(real_client, keys)
    before = {t: await effects.counts(t) for t in ids}
    for t in ids:  # each turn's reply is journaled, and its send's effect is real
        view = await ledger.read(t)
        assert view.reply is not None and list(before[t].values()) == [1]

    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    stats = await engine.resume_all()  # another process: the model would answer otherwise
    assert stats.resumed == TURNS and stats.outcomes == {"answered": TURNS}

    verdict = await judge(real_client, keys, ids, None)
    assert verdict.ok, verdict.as_dict()["examples"]
    assert not verdict.duplicate_effects and not verdict.orphaned_effects
    assert verdict.calls_repaid == 0  # no complete reply was asked for again
    for t in ids:
        final = await store.load(t)
        c = final.counters
        assert c.replies_adopted == 1 and c.resume_attempts == 1
        assert c.model_calls == 3  # two rounds and the answer, across both incarnations
        first_send = next(m.tool_result for m in final.messages if m.tool_result is not None
                          and m.tool_result.name == "send")  # fmt: skip
        assert first_send.status == "outcome_unknown"
        asked = next(m for m in final.messages if m.tool_calls)
        assert first_send.call_id == asked.tool_calls[1].id  # the id the model issued
        key = next(k for k in before[t])
        assert key in {m.call_key for m in final.meta}  # the effect is the one reported
        assert len(await effects.counts(t)) == 2  # the first send, and the second round's


def before_its_batches(done: CheckpointRecord) -> CheckpointRecord:
    """A finished turn's record taken back to before its first batch, in progress again (the
    next save of its owner): where a journaled reply of that batch would resume from."""
    return done.model_copy(
        update={
            "messages": done.messages[: done.baseline],
            "meta": done.meta[: done.baseline],
            "in_progress": True,
            "reason": SaveReason.SUBMITTED,
            "seq": done.seq + 1,
            "counters": done.counters.model_copy(update={"tool_batches": 0, "outcome": None}),
        }
    )


async def test_a_refused_journal_is_set_aside_and_its_calls_told_to_the_model(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """A journaled reply from an epoch after the record's (a zombie's, or a forgery) is never
    continued from: it is kept aside with why, and the model is told its calls' fates before
    it is asked again."""
    sc = parse_scenario({"name": "refused", "rounds": 1, "tools": ["send"], "replies": "random"})
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    await engine.run_new(*scripted_turn(sc), ["r1"])
    store, ledger = engine.store, ToolLedger(real_client, keys)
    done = await store.load("r1")
    # Back to the record before the batch, still in progress, with a journal from epoch 9.
    journal = (await ledger.read("r1")).reply
    assert journal is not None
    forged = decode_reply("r1", journal).model_copy(update={"epoch": 9})
    await store.save(before_its_batches(done))
    await real_client.hset(keys.tools("r1"), REPLY_FIELD, pack_model(forged))

    stats = await TurnEngine(real_client, keys, EngineSettings(loop=FAST)).resume_turns(["r1"])
    assert stats.outcomes == {"answered": 1}
    final = await store.load("r1")
    told = [m.text for m in final.messages if m.text.startswith(LOST_REPLY_PREFIX)]
    assert len(told) == 1 and "epoch 9" in told[0] and "send" in told[0]
    assert final.counters.replies_lost == 1 and final.counters.replies_adopted == 0
    kept = await real_client.hget(keys.tools("r1"), REPLY_REFUSED_FIELD)
    assert kept == pack_model(forged)
    assert await real_client.hget(keys.tools("r1"), REPLY_FIELD) is not None  # the new one


async def test_an_undecodable_journal_is_refused_not_continued(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    sc = parse_scenario({"name": "garbled", "rounds": 1, "tools": ["echo"]})
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    await engine.run_new(*scripted_turn(sc), ["g1"])
    done = await engine.store.load("g1")
    await engine.store.save(before_its_batches(done))
    await real_client.hset(keys.tools("g1"), REPLY_FIELD, b"\xc1 not msgpack")
    stats = await TurnEngine(real_client, keys, EngineSettings(loop=FAST)).resume_turns(["g1"])
    assert stats.outcomes == {"answered": 1}
    final = await engine.store.load("g1")
    told = [m.text for m in final.messages if m.text.startswith(LOST_REPLY_PREFIX)]
    assert len(told) == 1 and "does not decode" in told[0] and "echo" in told[0]


async def test_a_crash_while_awaiting_approval_keeps_the_question_and_its_decision(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """The reply is durable before its question is asked: the resumed turn asks nothing new,
    and a decision taken while no host ran the turn is the one its call runs under."""
    sc = parse_scenario(
        {"name": "ask", "rounds": 1, "tools": ["send"], "require_approval": ["send"],
         "replies": "random"}
    )  # fmt: skip
    first = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    task = asyncio.ensure_future(first.run_new(*scripted_turn(sc), ["q1"]))

    async def asked() -> bool:
        return bool(await first.approvals.pending("q1"))

    await eventually(asked, timeout=30, what="the approval question")
    ((key, _question),) = (await first.approvals.pending("q1")).items()
    assert (await ToolLedger(real_client, keys).read("q1")).reply is not None
    task.cancel()  # the host is gone while the question waits
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await first.approvals.decide("q1", key, True, by="operator", reason="fine")

    second = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    stats = await second.resume_turns(["q1"])
    assert stats.outcomes == {"answered": 1}
    final = await second.store.load("q1")
    assert final.counters.replies_adopted == 1
    assert list(await second.approvals.all("q1")) == [key]  # never asked again otherwise
    assert await second.effects.counts("q1") == {key: 1}
    result = next(m for m in final.meta if m.call_key == key)
    assert result.approval is not None and result.approval.by == "operator"


async def test_a_journal_spanning_debounced_batches_is_continued_from(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """With saves debounced (one a minute), the batches after the last save live only in the
    journal: a resume continues after all of them, and nothing acts twice or untold."""
    sc = parse_scenario(
        {"name": "debounced", "rounds": 5, "tools_per_round": 1, "tools": ["send"],
         "tool_latency_ms": 1000, "replies": "random"}
    )  # fmt: skip
    slow = dataclasses.replace(FAST, checkpoint_min_interval_s=60)
    first = TurnEngine(real_client, keys, EngineSettings(loop=slow))
    effects = EffectCounters(real_client, keys)

    async def fourth_send() -> bool:
        return len(await effects.counts("d1")) >= 4

    task = asyncio.ensure_future(first.run_new(*scripted_turn(sc), ["d1"]))
    await eventually(fourth_send, timeout=30, what="four sends")
    task.cancel()  # the host is gone: its saves after the first were debounced
    with contextlib.suppress(asyncio.CancelledError):
        await task
    record = await first.store.load("d1")
    sent = len(await effects.counts("d1"))
    assert record.in_progress and record.counters.tool_batches < sent - 1

    second = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    stats = await second.resume_turns(["d1"])
    assert stats.outcomes == {"answered": 1}
    final = await second.store.load("d1")
    assert final.counters.replies_adopted == 1 and final.counters.replies_lost == 0
    verdict = await judge(real_client, keys, ["d1"], None)
    assert verdict.ok, verdict.as_dict()["examples"]
    assert len(await effects.counts("d1")) == 5 and verdict.calls_repaid == 0


async def test_a_reply_too_large_to_journal_runs_none_of_its_calls(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """A reply that cannot be journaled (over the record cap: its checkpoint could not be
    stored either) ends the turn on its last checkpoint, with a clear outcome, before any of
    its calls runs; the host goes on."""
    sc = parse_scenario(
        {"name": "big", "rounds": 1, "tools": ["send"], "payload_bytes": 6000,
         "replies": "random"}
    )  # fmt: skip
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, max_record_bytes=9000))
    await engine.run_new(*scripted_turn(sc), ["big1"])
    final = await engine.store.load("big1")
    assert final.counters.outcome is Outcome.ABORTED_RECORD_TOO_LARGE and not final.in_progress
    assert await engine.effects.counts("big1") == {}  # its send never ran
    assert (await ToolLedger(real_client, keys).read("big1")).entries == {}


async def test_a_journal_after_a_compaction_is_continued_from(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """An agent that compacts as it goes, saves debounced: each compaction is saved at once,
    so the journal after it extends a stored transcript, and a crash mid-batch resumes from
    the reply as after any other."""
    sc = parse_scenario(
        {"name": "compacted", "rounds": 5, "tools_per_round": 1, "tools": ["send"],
         "tool_latency_ms": 1000, "payload_bytes": 300, "replies": "random"}
    )  # fmt: skip
    _agent, turn_input = scripted_turn(sc)
    compacting = "tests.support.agents:compacting"  # compacts past 400 characters
    slow = dataclasses.replace(FAST, checkpoint_min_interval_s=60)
    first = TurnEngine(real_client, keys, EngineSettings(loop=slow))
    effects = EffectCounters(real_client, keys)

    async def third_send() -> bool:
        return len(await effects.counts("c1")) >= 3

    task = asyncio.ensure_future(first.run_new(compacting, turn_input, ["c1"]))
    await eventually(third_send, timeout=30, what="three sends")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    stored = await first.store.load("c1")
    assert stored.in_progress and stored.reason is SaveReason.COMPACTION

    second = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    stats = await second.resume_turns(["c1"])
    assert stats.outcomes == {"answered": 1}
    final = await second.store.load("c1")
    assert final.counters.replies_adopted == 1
    verdict = await judge(real_client, keys, ["c1"], None)
    assert verdict.ok, verdict.as_dict()["examples"]
    assert len(await effects.counts("c1")) == 5 and verdict.calls_repaid == 0


def test_a_refused_journals_note_names_each_call_since_the_record_in_order() -> None:
    """And a field of the ledger that is no call key (a hand-made one) does not break it."""
    said = ToolResult(call_id="c", name="echo", status="ok", output="hi")
    ok = LedgerEntry(state="committed", name="echo", result=said)
    entries = {
        "1.1.bbbbbbbbbbbbbbbbbbbbbbbb": LedgerEntry(state="dispatched", name="send"),
        "0.0.aaaaaaaaaaaaaaaaaaaaaaaa": ok,
        "1.0.cccccccccccccccccccccccc": ok,
        "junk": ok,
    }
    calls = calls_since(entries, 1)
    assert [k for k, _ in calls] == ["1.0.cccccccccccccccccccccccc", "1.1.bbbbbbbbbbbbbbbbbbbbbbbb"]
    note = lost_reply_note("why", calls)
    assert note.startswith(LOST_REPLY_PREFIX) and "finished, ok: hi" in note
    assert "send (call key 1.1.bbbbbbbbbbbbbbbbbbbbbbbb): outcome_unknown" in note
