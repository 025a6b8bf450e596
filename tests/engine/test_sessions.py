"""Sessions: the next turn starts from the previous turn's final transcript; one turn in
progress per session (a second open is refused, also when two race)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from actors.engine.agents import AgentChange
from actors.engine.resume import reopen
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.submission import session_turn
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.errors import ConfigError, RecordError, SessionBusy, TurnExists
from bus.outcomes import Outcome
from store.keys import KeyLayout, check_session_id, check_turn_id
from store.records import CheckpointRecord, TurnInput, TurnSpec

AGENT = "tests.support.agents:recall"
FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0)


def engine(client: aioredis.Redis, keys: KeyLayout) -> TurnEngine:
    return TurnEngine(client, keys, EngineSettings(loop=FAST, watchdog=None))


def test_a_session_turn_id_lives_in_its_session_shard() -> None:
    keys = KeyLayout("pl", shards=16)
    assert {keys.shard_of(f"support-42/{n}") for n in range(1, 50)} == {keys.shard_of("support-42")}
    assert keys.session("support-42").startswith(f"pl:{{s{keys.shard_of('support-42')}}}:")
    assert check_turn_id("support-42/7") == "support-42/7"
    for bad in ("s/x", "a/b/1", "s/", "/1", "t\n", "s/1\n", "{s1}x"):
        with pytest.raises(ConfigError):
            check_turn_id(bad)
    with pytest.raises(ConfigError):
        check_session_id("s/1")


async def test_the_next_turn_starts_from_the_final_transcript(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(any_client, keys)
    first = await eng.run_in_session(AGENT, TurnInput(message="my name is Ada"), "chat")
    assert (first.turn_id, first.outcome) == ("chat/1", Outcome.ANSWERED)
    one = await eng.store.load("chat/1")
    assert one.answer == "heard: my name is Ada"

    second = await eng.run_in_session(AGENT, TurnInput(message="what is my name?"), "chat")
    assert second.turn_id == "chat/2"
    two = await eng.store.load("chat/2")
    # What was saved wins; the new message comes after it, and the meta stays aligned.
    assert two.messages[: len(one.messages)] == one.messages
    assert two.meta[: len(one.meta)] == one.meta
    assert two.baseline == len(one.messages) + 1
    assert two.messages[two.baseline - 1].text == "what is my name?"
    assert two.meta[two.baseline - 1].message_id == "chat/2:user"
    assert len(two.meta) == len(two.messages)
    assert two.answer == "heard: my name is Ada | what is my name?"
    assert two.session_id == "chat" and (await eng.store.load_spec("chat/2")).session_id == "chat"
    assert await eng.sessions.latest("chat") == "chat/2"


async def test_a_session_has_one_turn_in_progress(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(any_client, keys)
    spec, record = await eng.open_in_session(AGENT, TurnInput(message="one"), "busy")
    with pytest.raises(SessionBusy) as refused:
        await eng.open_in_session(AGENT, TurnInput(message="two"), "busy")
    assert refused.value.turn_id == "busy/1"
    assert not await any_client.exists(keys.turn("busy/2"), keys.spec("busy/2"))
    await eng.start(record, spec)  # once it is final, the session goes on
    spec2, _ = await eng.open_in_session(AGENT, TurnInput(message="two"), "busy")
    assert spec2.turn_id == "busy/2"


async def test_two_racing_opens_get_one_turn(any_client: aioredis.Redis, keys: KeyLayout) -> None:
    """Every loser hears the session is busy, whenever it lost: a rival that committed between
    its read of the session and its check of the next turn's name once made it report that
    turn as planted (``TurnExists``; one race in about 14 on Redis Cluster). Eight races."""
    eng = engine(any_client, keys)
    for race in (f"race{r}" for r in range(8)):
        await eng.run_in_session(AGENT, TurnInput(message="hello"), race)
        results = await asyncio.gather(
            *(eng.open_in_session(AGENT, TurnInput(message=f"m{i}"), race) for i in range(6)),
            return_exceptions=True,
        )
        opened = [r for r in results if not isinstance(r, BaseException)]
        assert len(opened) == 1 and opened[0][0].turn_id == f"{race}/2"
        lost = [r for r in results if r not in opened]
        assert all(isinstance(r, SessionBusy) for r in lost), lost
        assert not await any_client.exists(keys.turn(f"{race}/3"))


async def test_a_suspended_turn_holds_its_session(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(any_client, keys)
    await eng.run_in_session(AGENT, TurnInput(message="hello"), "held")
    final = await eng.store.load("held/1")
    counters = final.counters.model_copy(update={"outcome": Outcome.SUSPENDED_POISON})
    await eng.store.save(final.model_copy(update={"seq": final.seq + 1, "counters": counters}))
    with pytest.raises(SessionBusy, match="suspended"):
        await eng.open_in_session(AGENT, TurnInput(message="again"), "held")


async def test_bad_session_input_is_refused_before_anything_is_written(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(any_client, keys)
    with pytest.raises(ConfigError, match="invalid session id"):
        await eng.open_in_session(AGENT, TurnInput(message="x"), "bad/id")
    with pytest.raises(ConfigError):
        await eng.open_in_session("tests.nope:agent", TurnInput(message="x"), "fine")
    assert not await any_client.exists(keys.session("fine"))
    for fields in ({"turns": "many"}, {"turns": "1", "latest": ""}, {"latest": "other/1"}):
        await any_client.delete(keys.session("broken"))
        await any_client.hset(keys.session("broken"), mapping=fields)
        with pytest.raises(RecordError):
            await eng.open_in_session(AGENT, TurnInput(message="x"), "broken")


async def test_a_turn_planted_under_a_sessions_name_is_refused_and_moves_nothing(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng = engine(any_client, keys)
    with pytest.raises(ConfigError, match="a session's own"):  # a plain turn may not take it
        await eng.submit_many(AGENT, TurnInput(message="hi"), ["sy/1"])
    # planted anyway (by a writer that skips the check): the open is refused, nothing moves
    (spec, record) = new_session_turn("sy/1")
    await eng.store.submit(spec, record)
    with pytest.raises(TurnExists):
        await eng.run_in_session(AGENT, TurnInput(message="hello"), "sy")
    assert await eng.sessions.latest("sy") is None
    assert await any_client.hget(keys.session("sy"), "turns") is None


def new_session_turn(turn_id: str) -> tuple[TurnSpec, CheckpointRecord]:
    build = session_turn(AGENT, TurnInput(message="planted"), turn_id.split("/")[0])
    return build(None, turn_id)


@pytest.mark.parametrize("policy", list(AgentChange))
async def test_a_turn_resumed_under_a_changed_agent_goes_on_noted_or_is_suspended(
    real_client: aioredis.Redis, keys: KeyLayout, policy: AgentChange
) -> None:
    eng = TurnEngine(
        real_client, keys, EngineSettings(loop=FAST, watchdog=None, on_agent_change=policy)
    )
    spec, record = (await eng.submit_many(AGENT, TurnInput(message="hi"), ["up"]))[0]
    # as if it had started on an older version of the agent, then lost its host
    before = record.counters.model_copy(update={"agent_fingerprint": "0123456789abcdef"})
    await eng.store.save(record.model_copy(update={"seq": 1, "counters": before}))
    done = await eng.start(await eng.store.load("up"), spec)
    final = await eng.store.load("up")
    if policy is AgentChange.CONTINUE:
        assert done.outcome == Outcome.ANSWERED
        (change,) = final.counters.agent_changes
        assert change.startswith("0123456789abcdef -> ") and "epoch 1" in change
        assert final.counters.agent_fingerprint not in ("", "0123456789abcdef")
        return
    assert done.outcome == Outcome.SUSPENDED_AGENT_CHANGED and not final.in_progress
    assert final.counters.last_error is not None and "changed" in final.counters.last_error.message
    reopened = await reopen(eng.store, "up")  # the operator accepts the agent as it is now
    assert (await eng.start(reopened, spec)).outcome == Outcome.ANSWERED
