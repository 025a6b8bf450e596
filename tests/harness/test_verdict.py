"""The chaos verdict must catch planted faults: a harness that cannot fail proves nothing."""

from __future__ import annotations

import redis.asyncio as aioredis

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.harness.verdict import VerdictMode, first_difference, judge, reference_transcript
from actors.harness.work import Work
from bus.messages import Message, ToolResult
from bus.outcomes import SaveReason
from store.domain.effects import EffectCounters
from store.keys import KeyLayout
from store.write.checkpoint import RedisCheckpointStore
from tests.support.records import put_record
from tests.support.reference import FAST

SC = parse_scenario(
    {"name": "v", "rounds": 3, "tools_per_round": 2, "tools": ["echo", "counter_increment"]}
)
IDS = [f"v{i}" for i in range(8)]


async def clean_run(client: aioredis.Redis, keys: KeyLayout) -> tuple[Message, ...]:
    await TurnEngine(client, keys, EngineSettings(loop=FAST)).run_new(*scripted_turn(SC), IDS)
    return await reference_transcript(client, Work.scripted(SC), f"{keys.namespace}-ref")


async def test_a_clean_run_is_ok(real_client: aioredis.Redis, keys: KeyLayout) -> None:
    expected = await clean_run(real_client, keys)
    v = await judge(real_client, keys, IDS, expected)
    assert v.ok and v.turns == len(IDS) and not v.differ


async def test_every_planted_fault_is_caught(real_client: aioredis.Redis, keys: KeyLayout) -> None:
    expected = await clean_run(real_client, keys)
    store = TurnEngine(real_client, keys).store
    # 1. a transcript altered in Redis
    r = await store.load("v0")
    altered = r.model_copy(
        update={"messages": (*r.messages[:-1], Message(role="assistant", text="forged"))}
    )
    await put_record(real_client, keys, altered)
    # 2. a duplicated side effect
    effects = EffectCounters(real_client, keys)
    (key, _), *_ = (await effects.counts("v1")).items()
    await effects.increment("v1", key)
    # 3. a turn deleted
    await real_client.delete(keys.turn("v2"))
    # 4. meta drift: the pre-turn user message's meta rewritten
    r = await store.load("v3")
    bad_meta = (r.meta[0], r.meta[1].model_copy(update={"message_id": "rewritten"}), *r.meta[2:])
    await put_record(real_client, keys, r.model_copy(update={"meta": bad_meta}))
    # 5. a stale write accepted: an older epoch's event after the final one
    await real_client.xadd(
        keys.events_of("v4"),
        {
            "turn_id": "v4",
            "epoch": 0,
            "seq": 1,
            "phase": "done",
            "reason": "final",
            "in_progress": 0,
        },
    )
    # 6. a turn left in progress
    r = await store.load("v5")
    await store.save(
        r.model_copy(
            update={"seq": r.seq + 1, "in_progress": True, "reason": SaveReason.TOOL_BATCH}
        )
    )

    # 7. a second, different call's effect in the place of one the transcript answered (a
    #    reply asked for again and answered otherwise): a duplicate, and an orphan
    (key, _), *_ = (await effects.counts("v6")).items()
    batch, index, _digest = key.split(".")
    await effects.increment("v6", f"{batch}.{index}.{'0' * 24}")
    # 8. an effect the model was never told of, in a place of its own
    await effects.increment("v7", "9.0.feedfacefeedfacefeedface")

    v = await judge(real_client, keys, IDS, expected)
    assert not v.ok
    assert [d.split(":")[0] for d in v.differ] == ["v0"]
    assert "forged" in v.differ[0]
    assert [d.split(":")[0] for d in v.duplicate_effects] == ["v1", "v6"]
    assert "ran 2 times" in v.duplicate_effects[0] and "2 calls ran at" in v.duplicate_effects[1]
    assert v.orphaned_effects == [
        f"v6: {batch}.{index}.{'0' * 24}",
        "v7: 9.0.feedfacefeedfacefeedface",
    ]
    assert v.lost == ["v2"]
    assert v.meta_drift == ["v3"]
    assert v.stale_accepted == ["v4"]
    assert v.in_progress == ["v5"]


async def test_outcome_unknown_in_place_of_a_result_is_accepted(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    expected = await clean_run(real_client, keys)
    store = TurnEngine(real_client, keys).store
    r = await store.load("v0")
    i = next(
        i
        for i, m in enumerate(r.messages)
        if m.tool_result and m.tool_result.name == "counter_increment"
    )
    res = r.messages[i].tool_result
    assert res is not None
    lost = ToolResult(call_id=res.call_id, name=res.name, status="outcome_unknown", output="?")
    unknown = Message(role="tool", tool_result=lost)
    msgs = (*r.messages[:i], unknown, *r.messages[i + 1 :])
    await put_record(real_client, keys, r.model_copy(update={"messages": msgs}))
    v = await judge(real_client, keys, IDS, expected)
    assert v.ok and v.outcome_unknown == 1


def _with_ids(messages: tuple[Message, ...], prefix: str) -> list[Message]:
    """The transcript as an endpoint with its own random ids would have written it."""
    out = []
    for m in messages:
        if m.tool_calls:
            calls = tuple(c.model_copy(update={"id": prefix + c.id}) for c in m.tool_calls)
            m = m.model_copy(update={"tool_calls": calls})
        elif m.tool_result is not None:
            r = m.tool_result.model_copy(update={"call_id": prefix + m.tool_result.call_id})
            m = m.model_copy(update={"tool_result": r})
        out.append(m)
    return out


async def test_transcripts_are_compared_modulo_the_endpoints_tool_call_ids(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    expected = await clean_run(real_client, keys)
    renamed = _with_ids(expected, "cmpl-9f2a-")
    assert renamed != list(expected)
    assert first_difference(renamed, expected) is None
    # a call answered by another call's result is still a difference
    swapped = list(renamed)
    i = next(k for k, m in enumerate(swapped) if m.tool_result is not None)
    other = next(m for m in swapped[i + 1 :] if m.tool_result is not None)
    swapped[i] = other
    assert first_difference(swapped, expected) is not None


async def test_the_promises_verdict_skips_transcript_equality_and_keeps_the_rest(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await clean_run(real_client, keys)
    record = await RedisCheckpointStore(real_client, keys).load("v0")
    changed = list(record.messages)
    changed[-1] = changed[-1].model_copy(update={"text": "another model's answer"})
    await put_record(real_client, keys, record.model_copy(update={"messages": tuple(changed)}))
    promised = await judge(real_client, keys, IDS, None)
    assert promised.ok and promised.mode is VerdictMode.PROMISES
    assert promised.as_dict()["verdict"] == "promises"
    # what the runtime promises is still checked: a call left without its result is caught
    j = next(k for k, m in enumerate(record.messages) if m.tool_result is not None)
    broken = record.model_copy(
        update={
            "messages": record.messages[:j] + record.messages[j + 1 :],
            "meta": record.meta[:j] + record.meta[j + 1 :],
        }
    )
    await put_record(real_client, keys, broken)
    v = await judge(real_client, keys, IDS, None)
    assert not v.ok and len(v.differ) == 1, v.differ
    assert v.differ[0].startswith("v0: message") and "unanswered" in v.differ[0], v.differ
