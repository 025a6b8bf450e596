"""The operator's verbs against a real Redis, with turns running in this process: turns,
approvals, approve and deny, cancel, inject; bad input exits 2 with a message."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner

from actors.cli import main
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.outcomes import Outcome, SaveReason
from bus.phase import TurnPhase
from store.keys import KeyLayout
from store.records import TurnInput
from tests.support.polling import eventually


@pytest.fixture
def keys(namespace: str) -> KeyLayout:
    """The CLI's layout (16 shards, the default), so both find the same keys."""
    return KeyLayout(namespace)


FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, approval_poll_s=0.01)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


async def cli(*args: str) -> tuple[int, str]:
    """The CLI runs its own event loop: off this one, in a thread."""
    return await asyncio.to_thread(invoke, *args)


def at(redis_url: str, keys: KeyLayout) -> list[str]:
    return ["--redis-url", redis_url, "--namespace", keys.namespace]


def scenario(**kw: Any) -> Any:
    return scripted_turn(parse_scenario({"name": "op", "rounds": 2, "tools_per_round": 1, **kw}))


async def test_turns_lists_them_from_the_index_with_filters(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str
) -> None:
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    await engine.run_new(*scenario(), ["a1", "a2"])
    await engine.run_new(*scenario(), ["a3"])
    code, text = await cli("turns", *at(redis_url, keys), "--json")
    assert code == 0, text
    rows = [json.loads(line) for line in text.splitlines()]
    assert {r["turn_id"] for r in rows} == {"a1", "a2", "a3"} and rows[0]["turn_id"] == "a3"
    assert {r["outcome"] for r in rows} == {"answered"}
    assert all(r["agent"] == "actors.engine.models.scripted:agent" for r in rows)
    code, text = await cli("turns", *at(redis_url, keys), "--outcome", "aborted", "--json")
    assert code == 0 and text.strip() == ""
    code, text = await cli("turns", *at(redis_url, keys), "--limit", "1")
    assert code == 0 and "answered" in text


async def test_an_approval_is_listed_then_decided_from_the_cli(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str
) -> None:
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    agent, turn_input = scenario(rounds=1, require_approval=["echo"])
    record = (await engine.submit_many(agent, turn_input, ["gate"]))[0][1]
    spec = await engine.store.load_spec("gate")
    task = asyncio.ensure_future(engine.start(record, spec))

    async def asked() -> str | None:
        return engine.pending_approval("gate")

    key = await eventually(asked, timeout=10, what="the approval request")
    code, text = await cli("approvals", *at(redis_url, keys), "--json")
    (row,) = [json.loads(line) for line in text.splitlines()]
    assert (row["turn_id"], row["call"], row["tool"]) == ("gate", key, "echo") and row["args"]
    code, text = await cli("approve", *at(redis_url, keys), "gate", "zz-no-such-call")
    assert code == 2 and "no call is waiting as" in text
    digest = key.split(".", 2)[2]  # what a person copies from the table, without "0.0."
    code, text = await cli("deny", *at(redis_url, keys), "gate", digest[:8], "--reason", "not now")
    assert code == 0 and "denied" in text, text
    await asyncio.wait_for(task, 30)
    final = await engine.store.load("gate")
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.status == "denied" and "not now" in result.output and "@" in result.output
    code, text = await cli("approve", *at(redis_url, keys), "gate", key)
    assert code == 2  # nothing waits any more


async def test_cancel_and_inject_from_the_cli(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str
) -> None:
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    agent, turn_input = scenario(rounds=40, llm_latency_ms=100)
    record = (await engine.submit_many(agent, turn_input, ["long"]))[0][1]
    task = asyncio.ensure_future(engine.start(record, await engine.store.load_spec("long")))

    async def under_way() -> bool:
        return bool(engine.phases()) and engine.phases()[0].dst is TurnPhase.AWAITING_LLM

    await eventually(under_way, timeout=10, what="the turn under way")
    code, text = await cli("inject", *at(redis_url, keys), "long", "also this")
    assert code == 0 and text.strip(), text
    code, text = await cli("cancel", *at(redis_url, keys), "long", "--reason", "enough")
    assert code == 0 and "cancel requested" in text, text
    outcome = await asyncio.wait_for(task, 30)  # honoured at the next boundary
    assert outcome.outcome == Outcome.CANCELLED
    final = await engine.store.load("long")
    assert final.counters.cancel_reason is not None
    assert final.counters.cancel_reason.startswith("enough (by ")
    # a finished turn takes nothing more: exit 2 with a message
    code, text = await cli("inject", *at(redis_url, keys), "long", "too late")
    assert code == 2 and "not in progress" in text
    code, text = await cli("cancel", *at(redis_url, keys), "long")
    assert code == 2 and "ended (cancelled), so there is nothing to cancel" in text, text
    assert "nothing would read" not in text  # the inject's words, not a cancel's
    code, text = await cli("cancel", *at(redis_url, keys), "no-such")
    assert code == 2 and "no turn no-such" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cancel"], "Missing argument"),
        (["cancel", "bad id"], "invalid turn id"),
        (["inject", "t1", "  "], "the message is empty"),
        (["turns", "--limit", "0"], "Invalid value for '--limit'"),
        (["approve", "bad id", "k"], "invalid turn id"),
    ],
)
def test_bad_operator_input_exits_2(
    redis_url: str, keys: KeyLayout, args: list[str], message: str
) -> None:
    code, text = invoke(*args, *at(redis_url, keys))
    assert code == 2 and message in text, text


RECALL = "tests.support.agents:recall"


async def test_a_busy_session_queues_or_interrupts_and_the_next_turn_opens_in_order(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str
) -> None:
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    first = asyncio.ensure_future(engine.run_in_session(RECALL, TurnInput(message="#sleep 1"), "q"))

    async def running() -> bool:
        return "q/1" in engine.running()

    await eventually(running, timeout=10, what="the session's first turn")
    send = ["submit", *at(redis_url, keys), "--agent", RECALL, "--session", "q"]
    code, text = await cli(*send, "--input", "refused")
    assert code != 0 and "in progress" in text  # the default: reject
    code, text = await cli(*send, "--input", "second", "--if-busy", "queue")
    assert code == 0 and "behind turn q/1 (place 1)" in text, text
    code, text = await cli(*send, "--input", "third", "--if-busy", "queue")
    assert code == 0 and "(place 2)" in text, text
    assert (await first).outcome == Outcome.ANSWERED
    stats = await engine.resume_all()  # what a deployment's hosts do when the session is free
    assert stats.outcomes[Outcome.ANSWERED] == 2
    third = await engine.store.load("q/3")
    assert third.answer == "heard: #sleep 1 | second | third"  # in order, each on the last
    # interrupt: the running turn is cancelled at its boundary, then the message goes on
    long = asyncio.ensure_future(engine.run_in_session(RECALL, TurnInput(message="#sleep 60"), "q"))

    async def long_running() -> bool:
        return "q/4" in engine.running()

    await eventually(long_running, timeout=10, what="the long turn")
    code, text = await cli(*send, "--input", "instead", "--if-busy", "interrupt")
    assert code == 0 and "behind turn q/4" in text, text
    assert engine.cancel("q/4")  # what the deployment's host does at once
    assert (await asyncio.wait_for(long, 10)).outcome == Outcome.CANCELLED
    await engine.resume_all()
    fifth = await engine.store.load("q/5")
    assert fifth.counters.outcome == Outcome.ANSWERED and fifth.answer.endswith("| instead")
    assert await real_client.llen(keys.session_queue("q")) == 0
    assert not await real_client.sismember(keys.queued_sessions(), "q")


async def test_export_then_purge_round_trips_every_finished_turn(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str, tmp_path: Path
) -> None:
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    ids = [f"ex{i:03d}" for i in range(600)]  # one run: all submitted in the same millisecond
    await engine.run_new(*scenario(rounds=1), ids)
    agent, turn_input = scenario(rounds=30, llm_latency_ms=1000)
    record = (await engine.submit_many(agent, turn_input, ["running"]))[0][1]
    task = asyncio.ensure_future(engine.start(record, await engine.store.load_spec("running")))
    archive = tmp_path / "turns.jsonl"
    code, text = await cli("export", *at(redis_url, keys), "--output", str(archive))
    assert code == 0, text
    lines = [json.loads(line) for line in archive.read_text().splitlines()]
    assert sorted(line["record"]["turn_id"] for line in lines) == ids  # each once, not running
    assert all(line["record"]["counters"]["outcome"] == "answered" for line in lines)
    assert all(len(line["ledger"]) == 1 for line in lines)  # its tool call, with its result
    code, text = await cli("purge", *at(redis_url, keys))
    assert code == 2 and "--all" in text
    code, text = await cli("purge", *at(redis_url, keys), "--all", "--dry-run")
    assert code == 0 and "600 finished turns would be removed" in text
    code, text = await cli("purge", *at(redis_url, keys), "--all")
    assert code == 0 and "removed 600" in text
    left = [k async for k in real_client.scan_iter(f"{keys.namespace}:*ex0*")]
    assert left == []
    assert (await engine.store.load("running")).in_progress  # never a running turn
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_purge_all_keeps_suspended_turns_unless_their_suspension_is_named(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str
) -> None:
    """A suspended turn is not finished: it waits for ``phaseline resume``. ``purge --all``
    (every finished turn) leaves it; only ``--outcome suspended:poison`` removes it."""
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST, watchdog=None))
    await engine.run_new(*scenario(rounds=1), ["done1", "parked1"])
    r = await engine.store.load("parked1")
    parked = r.model_copy(
        update={
            "seq": r.seq + 1,
            "reason": SaveReason.SUSPENDED,
            "counters": r.counters.model_copy(update={"outcome": Outcome.SUSPENDED_POISON}),
        }
    )
    await engine.store.save(parked)
    code, text = await cli("purge", *at(redis_url, keys), "--all")
    assert code == 0 and "removed 1 " in text
    assert (await engine.store.load("parked1")).counters.outcome is Outcome.SUSPENDED_POISON
    code, text = await cli("purge", *at(redis_url, keys), "--outcome", "suspended:poison")
    assert code == 0 and "removed 1 " in text
    assert await real_client.exists(keys.turn("parked1")) == 0


async def test_turns_shows_a_turn_waiting_for_an_approval_where_it_waits(
    real_client: aioredis.Redis, keys: KeyLayout, redis_url: str
) -> None:
    """A record's phase is its last checkpoint's (``init`` before the first); ``turns`` shows
    and filters by the phase the turn's last transition entered, as the console does."""
    settings = Settings.model_validate({
        "redis": {"namespace": keys.namespace}, "loop": {"strict": True},
        "checkpoint": {"min_interval_s": 0}, "approvals": {"poll_s": 0.01},
    })  # fmt: skip
    engine = TurnEngine.from_settings(real_client, settings, watchdog=False)
    agent, turn_input = scenario(rounds=1, require_approval=["echo"])
    task = asyncio.ensure_future(engine.run_new(agent, turn_input, ["ask1"]))
    try:

        async def asked() -> bool:
            return bool(await engine.approvals.pending("ask1"))

        await eventually(asked, timeout=30, what="the approval question")
        rows: list[dict[str, Any]] = []

        async def listed_waiting() -> bool:  # its transition is published a moment later
            code, text = await cli("turns", *at(redis_url, keys), "--phase",
                                   "awaiting_approval", "--json")  # fmt: skip
            assert code == 0, text
            rows[:] = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            return bool(rows)

        await eventually(listed_waiting, timeout=30, what="the turn listed as waiting")
        assert [r["turn_id"] for r in rows] == ["ask1"] and rows[0]["phase"] == "awaiting_approval"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
