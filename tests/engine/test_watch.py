"""Live events: what ``Runtime.watch`` / ``phaseline watch`` show of a turn, read back from the
turn's live stream on a real server (the in-process engine publishing as a TurnActor does)."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis
from rich.console import Console

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineHooks, EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.harness.live import LiveView
from actors.turn.settings import LoopSettings
from bus.errors import RecordNotFound
from bus.events import (
    Finished,
    Recovering,
    Restarted,
    Status,
    StatusEvent,
    TextDelta,
    ToolCalled,
    ToolReturned,
    WatchEvent,
)
from bus.phase import Transition, TurnPhase
from store.keys import KeyLayout
from store.records import TurnInput
from store.views.streams import BufferedPublisher, LiveStreams, MemoryBus, RedisBus
from store.views.watch import watch_turn
from tests.support.agents import TEST_KEY_ENV

FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0, backoff_scale=0.01)
SCENARIO = parse_scenario({"name": "w", "rounds": 3, "tools_per_round": 2, "llm_latency_ms": 0})


def publishing_engine(
    client: aioredis.Redis, keys: KeyLayout
) -> tuple[TurnEngine, BufferedPublisher]:
    publisher = BufferedPublisher(RedisBus(client, keys), interval_s=0.005)
    eng = TurnEngine(
        client,
        keys,
        EngineSettings(loop=FAST, watchdog=None),
        EngineHooks(on_transition=publisher.add, on_event=publisher.add),
    )
    return eng, publisher


async def watched(client: aioredis.Redis, keys: KeyLayout, turn_id: str) -> list[WatchEvent]:
    return [e async for e in watch_turn(client, keys, turn_id, block_ms=200)]


async def test_a_watcher_sees_the_whole_turn_and_ends_at_its_answer(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng, publisher = publishing_engine(real_client, keys)
    await eng.run_new(*scripted_turn(SCENARIO), ["w1"])
    await publisher.flush()
    events = await watched(real_client, keys, "w1")
    record = await eng.store.load("w1")
    assert isinstance(events[-1], Finished)
    assert (events[-1].outcome, events[-1].answer) == ("answered", record.answer)
    moves = [e.dst for e in events if isinstance(e, Transition)]
    assert moves[0] is TurnPhase.SETUP and moves[-1] is TurnPhase.DONE
    assert moves.count(TurnPhase.EXECUTING_TOOLS) == 3
    calls = [e for e in events if isinstance(e, ToolCalled)]
    results = [e for e in events if isinstance(e, ToolReturned)]
    assert len(calls) == len(results) == 6
    assert [c.call_id for c in calls] == [r.call_id for r in results]
    assert {r.status for r in results} == {"ok"}
    said = [e.text for e in events if isinstance(e, TextDelta)]
    assert said == [m.text for m in record.messages[record.baseline :] if m.role == "assistant"]
    assert not any(isinstance(e, Restarted) for e in events)


async def test_streamed_text_arrives_in_pieces_that_join_into_the_reply(
    real_client: aioredis.Redis,
    keys: KeyLayout,
    openai_server: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", openai_server)
    monkeypatch.setenv(TEST_KEY_ENV, "sk-watch")
    pieces: list[TextDelta] = []
    eng = TurnEngine(
        real_client,
        keys,
        EngineSettings(loop=FAST, watchdog=None),
        EngineHooks(on_event=lambda e: pieces.append(e) if isinstance(e, TextDelta) else None),
    )
    script = {"rounds": 1, "tool": "add"}
    turn = TurnInput(message=f"#script {json.dumps(script)}\nAdd, please.")
    await eng.run_new("tests.support.agents:http_stream", turn, ["s1"])
    record = await eng.store.load("s1")
    assert len(pieces) > 2  # the server streams each reply in two content pieces
    assert "".join(p.text for p in pieces) == "".join(
        m.text for m in record.messages if m.role == "assistant"
    )


async def test_a_resumed_turn_says_so_and_goes_on(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng, publisher = publishing_engine(real_client, keys)
    await eng.submit_many(*scripted_turn(SCENARIO), ["r1"])  # a host took it and died
    await eng.resume("r1")
    await publisher.flush()
    events = await watched(real_client, keys, "r1")
    restarts = [e for e in events if isinstance(e, Restarted)]
    assert len(restarts) == 1 and restarts[0].epoch == 2
    assert (restarts[0].resumed_from, restarts[0].messages) == ("submitted", 2)
    assert events.index(restarts[0]) == 0 and isinstance(events[-1], Finished)


async def test_the_record_ends_a_watch_when_the_stream_is_gone(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    eng, publisher = publishing_engine(real_client, keys)
    await eng.run_new(*scripted_turn(SCENARIO), ["g1"])
    await publisher.flush()
    await real_client.delete(keys.live("g1"))  # expired, trimmed, or dropped with Redis away
    await real_client.xadd(keys.live("g1"), {"kind": "nonsense"})  # a bad entry is skipped
    events = await watched(real_client, keys, "g1")
    assert len(events) == 1 and isinstance(events[0], Finished)
    assert events[0].answer == (await eng.store.load("g1")).answer
    with pytest.raises(RecordNotFound):
        await watched(real_client, keys, "nosuch")


async def test_live_events_stay_off_the_shard_bus(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    bus = RedisBus(real_client, keys, live=LiveStreams(maxlen=50, ttl_s=60))
    await bus.ensure_group("g")
    events: list[WatchEvent] = [
        TextDelta("b1", 1, "hi", 1),
        StatusEvent("b1", 1, Status.IDLE_SOFT, "quiet", 2),
        Transition("b1", 1, 1, TurnPhase.INIT, TurnPhase.SETUP, 3),
    ]
    await bus.publish(events)
    got = await bus.read("g", "c", block_ms=100)
    assert [type(d.event) for d in got] == [StatusEvent, Transition]
    assert await real_client.xlen(keys.live("b1")) == 3
    assert 0 < await real_client.ttl(keys.live("b1")) <= 60
    for i in range(500):
        await bus.publish([TextDelta("b1", 1, str(i), i)])
    assert await real_client.xlen(keys.live("b1")) < 200  # capped (approximately)


async def test_deltas_of_one_flush_period_are_joined() -> None:
    bus = MemoryBus()
    publisher = BufferedPublisher(bus, interval_s=3600)
    for piece in ("Hel", "lo", " world"):
        publisher.add(TextDelta("j1", 1, piece, 1))
    publisher.add(TextDelta("j2", 1, "other", 1))
    publisher.add(ToolCalled("j1", 1, "c1", "echo", "{}", 2))
    publisher.add(TextDelta("j1", 1, "after", 3))
    publisher.add(TextDelta("j1", 2, " new epoch", 4))
    await publisher.flush()
    assert [(type(e).__name__, getattr(e, "text", "")) for e in bus.live["j1"]] == [
        ("TextDelta", "Hello world"),
        ("ToolCalled", ""),
        ("TextDelta", "after"),
        ("TextDelta", " new epoch"),
    ]
    assert [e.text for e in bus.live["j2"]] == ["other"]  # type: ignore[union-attr]


async def test_a_watcher_sees_skipped_calls_nudges_and_why_a_turn_ended(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """A loop: each skipped call is a ``skipped`` result with its reason, each nudge and the
    stop a :class:`Recovering` event; a turn that aborts ends with its error."""
    eng, publisher = publishing_engine(real_client, keys)
    looping = parse_scenario(
        {"name": "l", "rounds": 9, "tools_per_round": 1, "faults": [{"at_call": 2, "kind": "loop"}]}
    )
    await eng.run_new(*scripted_turn(looping), ["loopy"])
    failing = parse_scenario(
        {"name": "f", "rounds": 2, "faults": [{"at_call": 1, "kind": "fatal"}]}
    )
    await eng.run_new(*scripted_turn(failing), ["fails"])
    await publisher.flush()
    events = await watched(real_client, keys, "loopy")
    skipped = [e for e in events if isinstance(e, ToolReturned) and e.status == "skipped"]
    assert len(skipped) == 4 and "same result 3 times in a row" in skipped[0].output
    acts = [(e.problem, e.action) for e in events if isinstance(e, Recovering)]
    assert acts == [("loop", "nudge")] * 3 + [("loop", "force_stop")]
    nudge = next(e for e in events if isinstance(e, Recovering))
    assert "told the model: [nudge]" in nudge.detail
    assert isinstance(events[-1], Finished) and events[-1].outcome == "force_stopped"
    ended = (await watched(real_client, keys, "fails"))[-1]
    assert isinstance(ended, Finished) and ended.outcome == "aborted:fatal"
    assert ended.error == "model fatal: scripted fatal error at call 1"


def test_the_live_view_prints_recovery_and_the_reason_a_turn_ended() -> None:
    console = Console(record=True, width=200)
    view = LiveView(console)
    view.show(Recovering("t", 1, "retryable", "retry", "retry 1 of 3 in 1.0 s: HTTP 500", 5))
    view.show(ToolReturned("t", 1, "c1", "poll", "skipped", "not run: poll({}) returned ...", 6))
    view.show(Finished("t", 1, "aborted:retryable", "", 7, "model retryable HTTP 503: down"))
    shown = console.export_text()
    assert "! retryable: retry: retry 1 of 3 in 1.0 s: HTTP 500" in shown
    assert "↳ skipped: not run: poll({}) returned" in shown
    assert "turn ended aborted:retryable: model retryable HTTP 503: down" in shown
