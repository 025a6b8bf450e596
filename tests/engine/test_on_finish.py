"""The ``on_finish`` hook: called once with each turn that ends, after its final save, with
what ``phaseline export`` writes for it; in process and on Ray hosts, which load it by path."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.cluster.runtime import Runtime
from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineHooks, EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.turn.settings import LoopSettings
from bus.errors import ConfigError
from bus.outcomes import Outcome
from store.keys import KeyLayout
from store.views.archive import FinishedTurn
from tests.support.agents import archived
from tests.support.polling import eventually

SCENARIO = parse_scenario(
    {"name": "fin", "rounds": 2, "tools_per_round": 2, "tools": ["echo", "counter_increment"],
     "payload_bytes": 40}
)  # fmt: skip
FAST = LoopSettings(strict=True, checkpoint_min_interval_s=0)


def engine_with(
    client: aioredis.Redis, keys: KeyLayout, hook: Callable[[FinishedTurn], Any]
) -> TurnEngine:
    return TurnEngine(client, keys, EngineSettings(loop=FAST), EngineHooks(on_finish=hook))


async def test_the_hook_gets_each_finished_turn_once_with_its_export_line(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    got: list[FinishedTurn] = []
    engine = engine_with(real_client, keys, got.append)
    await engine.run_new(*scripted_turn(SCENARIO), ["f1", "f2"])
    assert sorted(t.turn_id for t in got) == ["f1", "f2"]
    for turn in got:
        stored = await engine.store.load(turn.turn_id)
        assert turn.record == stored and not stored.in_progress  # called after the final save
        assert turn.record.counters.outcome == Outcome.ANSWERED
        assert turn.ledger == await engine.ledger.entries(turn.turn_id)
        assert {e.state for e in turn.ledger.values()} == {"committed"} and len(turn.ledger) == 4
        line = json.loads(turn.json_line())
        assert line["record"]["turn_id"] == turn.turn_id and len(line["ledger"]) == 4


async def test_a_failing_hook_is_counted_and_the_turn_still_ends(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    async def down(turn: FinishedTurn) -> None:
        raise RuntimeError("the archive is down")

    engine = engine_with(real_client, keys, down)
    stats = await engine.run_new(*scripted_turn(SCENARIO), ["g1"])
    assert stats.outcomes[Outcome.ANSWERED] == 1 and stats.on_finish_failures == 1
    assert not (await engine.store.load("g1")).in_progress


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("tests.support.agents:nowhere", "has no 'nowhere'"),
        ("tests.support.agents:not_a_hook", "is a str, not a function"),
        ("no.such.module:archive", "cannot import no.such.module"),
    ],
)
def test_a_hook_that_does_not_load_is_a_config_error(
    real_client: aioredis.Redis, keys: KeyLayout, path: str, error: str
) -> None:
    settings = Settings.model_validate({"retention": {"on_finish": path}})
    with pytest.raises(ConfigError, match=error):
        TurnEngine.from_settings(real_client, settings)


def test_a_malformed_hook_path_is_refused_with_the_config() -> None:
    with pytest.raises(ValueError, match="on_finish"):
        Settings.model_validate({"retention": {"on_finish": "archive everything"}})


@pytest.mark.usefixtures("ray_cluster")
async def test_ray_hosts_load_the_hook_by_path_and_call_it_once_per_turn(
    redis_url: str, namespace: str
) -> None:
    settings = Settings.model_validate(
        {"redis": {"namespace": namespace}, "checkpoint": {"min_interval_s": 0},
         "retention": {"on_finish": "tests.support.agents:archive_or_fail"}}
    )  # fmt: skip
    run = uuid.uuid4().hex[:8]
    ids = [f"ok-{run}-{i}" for i in range(3)] + [f"bad-{run}"]
    rt = await Runtime.start(settings, redis_url=redis_url, hosts=2)
    try:
        await rt.submit(*scripted_turn(SCENARIO), ids)
        finals = await rt.wait(ids, timeout=120)
        # read while the hosts live: the hook runs after the final save a wait sees, and a
        # host stopped in between never calls it (at most once, by design)
        archives = {tid: await read_when_written(tid) for tid in ids[:3]}
    finally:
        await rt.shutdown()
    assert {f.counters.outcome for f in finals.values()} == {Outcome.ANSWERED}
    for tid, lines in archives.items():
        assert len(lines) == 1  # once
        assert lines[0]["record"]["turn_id"] == tid and len(lines[0]["ledger"]) == 4
    assert not archived(ids[3]).exists()  # its hook failed; the turn answered all the same


async def read_when_written(turn_id: str) -> list[dict[str, Any]]:
    path = archived(turn_id)

    async def written() -> bool:  # a whole line: the hook creates the file, then writes it
        return path.exists() and path.read_text(encoding="utf-8").endswith("\n")

    await eventually(written, timeout=30, what=f"the archive of {turn_id}")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
