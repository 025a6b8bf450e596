"""A finished turn's ledger holds every result its transcript does, whatever the store did in
between: outcomes whose own writes failed (Redis away) ride on the next save that lands, the
final one at the latest. Seen on Ray after a 15 s outage: 48 of 120 finished turns exported a
ledger entry still ``dispatched`` while their transcript had the result."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import redis.asyncio as aioredis

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.tools.toolrun import BatchExecutor
from actors.engine.turn_checkpoints import TurnCheckpoints
from actors.engine.turn_engine import TurnEngine
from actors.turn.deps import Checkpointer
from bus.errors import StoreUnavailable
from store.domain.ledger import Change, ToolLedger
from store.keys import KeyLayout
from store.records import CheckpointRecord, SaveAck, Settle
from tests.support.reference import FAST


class OutcomesAway(ToolLedger):
    """The ledger with its first ``n`` outcome writes (unfenced compare-and-sets) failing, as
    during an outage that ends while the turn goes on."""

    def __init__(self, *args: object, n: int) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.failing = n

    async def transition(
        self, turn_id: str, changes: dict[str, Change], *, epoch: int | None
    ) -> dict[str, bool]:
        if epoch is None and self.failing > 0:
            self.failing -= 1
            raise StoreUnavailable("Redis went away")
        return await super().transition(turn_id, changes, epoch=epoch)


class FirstSaveFails:
    def __init__(self, inner: Checkpointer) -> None:
        self.inner = inner
        self.failed = False

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        if not self.failed:
            self.failed = True
            raise StoreUnavailable("Redis went away")
        return await self.inner.save(record, settles)


async def test_outcomes_whose_writes_failed_are_settled_by_a_later_save(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    sc = parse_scenario(
        {"name": "outage", "rounds": 2, "tools_per_round": 3,
         "tools": ["counter_increment", "send", "echo"], "tool_latency_ms": 20}
    )  # fmt: skip
    engine = TurnEngine(real_client, keys, EngineSettings(loop=FAST))
    agent, turn_input = scripted_turn(sc)
    (_tid, record), *_ = await engine.submit_many(agent, turn_input, ["o1"])
    spec = await engine.store.load_spec("o1")
    loop = await engine.build_loop(record, spec)
    ledger = OutcomesAway(real_client, keys, n=3)  # the early outcomes and their retry
    tools = loop.deps.tools
    assert isinstance(tools, BatchExecutor)
    loop.deps = dataclasses.replace(
        loop.deps,
        tools=BatchExecutor(tools.registry, tools.runner, ledger, tools.effects),
        checkpoints=TurnCheckpoints(FirstSaveFails(engine.checkpoints), ledger),
    )
    outcome = await engine.drive(loop)
    assert outcome.outcome == "answered" and ledger.failing == 0
    final = await engine.store.load("o1")
    told = {
        meta.call_key: msg.tool_result
        for msg, meta in zip(final.messages, final.meta, strict=True)
        if meta.call_key
    }
    entries = await engine.ledger.entries("o1")
    assert len(entries) == len(told) == 6
    for key, result in told.items():
        assert entries[key].state == "committed", (key, entries[key])
        assert entries[key].result == result
