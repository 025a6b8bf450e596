"""A write Redis refused (out of memory) did not happen: a tool call whose dispatch or effect was
refused is known not to have run, is tried again, and is never reported ``outcome_unknown``.

Only a real server refuses: each test makes it run out of memory (``maxmemory`` 1 byte) around
exactly one write and restores it after, so the refusal is Redis' own reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.tools import call_ends
from actors.engine.tools.builtin_tools import BUILTIN_TOOLS
from actors.engine.tools.local_tools import LocalToolRunner
from actors.engine.tools.toolrun import BatchExecutor
from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec
from bus.errors import StoreRefused, StoreUnavailable
from bus.messages import ToolCall
from store.domain.effects import EffectCounters
from store.domain.ledger import Claim, LedgerRead, ToolLedger, call_key
from store.keys import KeyLayout
from store.redis.failures import translated
from store.write.checkpoint import RedisCheckpointStore
from tests.support.records import record


@asynccontextmanager
async def out_of_memory(client: aioredis.Redis) -> AsyncIterator[None]:
    """The server refuses every write that could grow its memory while this is open."""
    before = (await client.config_get("maxmemory"))["maxmemory"]
    await client.config_set("maxmemory", 1)
    try:
        yield
    finally:
        await client.config_set("maxmemory", before)


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tries again come at once (the back-off's length is not what is tested)."""
    monkeypatch.setattr(call_ends, "REFUSED_BACKOFF_S", (0.0, 0.0, 0.0))


@pytest.fixture
async def owned(real_client: aioredis.Redis, keys: KeyLayout) -> None:
    """Turn ``t1`` is owned by epoch 2."""
    await RedisCheckpointStore(real_client, keys).save(record("t1", epoch=2, seq=3))


def refusing_counter(client: aioredis.Redis, refusals: int) -> ToolRegistry:
    """``counter_increment`` (not idempotent) whose first ``refusals`` effect writes meet a
    server out of memory."""
    left = [refusals]

    async def increment(args: Mapping[str, Any], ctx: ToolContext) -> str:
        assert ctx.effects is not None
        if left[0] > 0:
            left[0] -= 1
            async with out_of_memory(client):
                return str(await ctx.effects.increment(ctx.turn_id, ctx.call_key))
        return str(await ctx.effects.increment(ctx.turn_id, ctx.call_key))

    return ToolRegistry([ToolSpec("counter_increment", increment, idempotent=False)])


async def test_a_refusal_is_told_apart_from_a_lost_connection(real_client: aioredis.Redis) -> None:
    with pytest.raises(StoreRefused, match="maxmemory"):
        async with out_of_memory(real_client):
            with translated("write"):
                await real_client.set("refused-key", "x")
    assert await real_client.exists("refused-key") == 0
    gone = aioredis.Redis(port=1, socket_connect_timeout=0.2, retry_on_error=[])
    with pytest.raises(StoreUnavailable) as lost, translated("write"):
        await gone.set("k", "x")
    assert not isinstance(lost.value, StoreRefused)  # sent or not, nobody knows: not refused


async def test_a_refused_effect_did_not_happen_and_is_tried_again(
    real_client: aioredis.Redis, keys: KeyLayout, owned: None
) -> None:
    effects = EffectCounters(real_client, keys)
    executor = BatchExecutor(
        refusing_counter(real_client, 1), LocalToolRunner(), ToolLedger(real_client, keys), effects
    )
    call = ToolCall(id="c0", name="counter_increment", args={})
    (res,) = (await executor.run_batch("t1", 2, 0, [call])).results
    assert res.status == "ok" and res.output == "1"  # not outcome_unknown: it had not run
    key = call_key("t1", 0, call, 0)
    assert await effects.counts("t1") == {key: 1}  # and ran once when tried again
    assert (await ToolLedger(real_client, keys).entries("t1"))[key].state == "committed"


async def test_an_effect_refused_every_time_is_reported_not_run(
    real_client: aioredis.Redis, keys: KeyLayout, owned: None
) -> None:
    effects = EffectCounters(real_client, keys)
    tries = len(call_ends.REFUSED_BACKOFF_S) + 1
    executor = BatchExecutor(
        refusing_counter(real_client, tries), LocalToolRunner(), ToolLedger(real_client, keys),
        effects,
    )  # fmt: skip
    (res,) = (
        await executor.run_batch("t1", 2, 0, [ToolCall(id="c0", name="counter_increment")])
    ).results
    assert res.status == "error"
    assert "was not run" in res.output and "maxmemory" in res.output and "no effect" in res.output
    assert await effects.counts("t1") == {}


class RefusedDispatch(ToolLedger):
    """The real ledger, run out of memory for its first fenced write (the batch's claim)."""

    refused = 0

    async def claim(
        self, turn_id: str, epoch: int, claims: list[Claim], *, reply: bytes = b""
    ) -> dict[str, LedgerRead | None]:
        if not self.refused:
            self.refused += 1
            async with out_of_memory(self.client):  # type: ignore[arg-type]
                return await super().claim(turn_id, epoch, claims, reply=reply)
        return await super().claim(turn_id, epoch, claims, reply=reply)


async def test_a_refused_dispatch_runs_nothing_then_runs_each_call_once(
    real_client: aioredis.Redis, keys: KeyLayout, owned: None
) -> None:
    ledger = RefusedDispatch(real_client, keys)
    effects = EffectCounters(real_client, keys)
    calls = [ToolCall(id=t, name="counter_increment", args={"text": t}) for t in "abc"]
    executor = BatchExecutor(BUILTIN_TOOLS, LocalToolRunner(), ledger, effects)
    results = (await executor.run_batch("t1", 2, 0, calls)).results
    assert ledger.refused == 1
    assert [r.status for r in results] == ["ok"] * 3
    assert sorted((await effects.counts("t1")).values()) == [1, 1, 1]
    states = {e.state for e in (await ToolLedger(real_client, keys).entries("t1")).values()}
    assert states == {"committed"}
