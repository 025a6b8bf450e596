"""Fenced tool dispatch: the ledger's compare-and-set, on fakeredis and a real server alike."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from actors.engine.tools.builtin_tools import BUILTIN_TOOLS
from actors.engine.tools.local_tools import LocalToolRunner
from actors.engine.tools.toolrun import BatchExecutor, ToolJob
from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec
from bus.errors import StaleOwner
from bus.messages import ToolCall, ToolResult
from store.codec import pack_model
from store.domain.effects import EffectCounters
from store.domain.ledger import Change, Claim, LedgerRead, ToolLedger, call_key
from store.domain.usage import FencedWrite, fenced_writes
from store.keys import KeyLayout
from store.records import LedgerEntry
from store.redis.lane import lane_of
from store.write.checkpoint import RedisCheckpointStore
from tests.support.records import record


@pytest.fixture
async def owned(any_client: aioredis.Redis, keys: KeyLayout) -> ToolLedger:
    """A ledger whose turn ``t1`` is owned by epoch 2."""
    await RedisCheckpointStore(any_client, keys).save(record("t1", epoch=2, seq=3))
    return ToolLedger(any_client, keys)


def executor(client: aioredis.Redis, keys: KeyLayout, registry: ToolRegistry) -> BatchExecutor:
    ledger = ToolLedger(client, keys)
    return BatchExecutor(registry, LocalToolRunner(), ledger, EffectCounters(client, keys))


CALLS = [ToolCall(id=f"c{i}", name="counter_increment", args={"delay_ms": 30}) for i in range(3)]


async def test_a_fenced_epoch_dispatches_nothing_and_is_counted(
    owned: ToolLedger, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    entry = LedgerEntry(state="dispatched", name="echo", epoch=1)
    prepared = pack_model(LedgerEntry(state="prepared", name="echo"))
    with pytest.raises(StaleOwner, match="epoch 1 may not dispatch"):
        await owned.claim("t1", 1, [Claim("k", prepared, pack_model(entry))])
    assert (await owned.entries("t1"))["k"].state == "prepared"
    (read,) = (await owned.get_many("t1", ["k"])).values()
    with pytest.raises(StaleOwner, match="epoch 1 may not dispatch"):
        await owned.transition("t1", {"k": Change(read.raw, entry)}, epoch=1)
    assert (await owned.entries("t1"))["k"].state == "prepared"
    fenced = {FencedWrite.SAVE: 0, FencedWrite.CLAIM: 1, FencedWrite.CAS: 1}
    assert await fenced_writes(any_client, keys) == fenced
    # The owner's epoch wins, and replaying its own write is still a win.
    entry = LedgerEntry(state="dispatched", name="echo", epoch=2)
    assert await owned.transition("t1", {"k": Change(read.raw, entry)}, epoch=2) == {"k": True}
    assert await owned.transition("t1", {"k": Change(read.raw, entry)}, epoch=2) == {"k": True}
    # A second dispatcher that read the same prepared entry loses the compare-and-set.
    other = LedgerEntry(state="dispatched", name="echo", epoch=2, updated_at=7)
    assert await owned.transition("t1", {"k": Change(read.raw, other)}, epoch=2) == {"k": False}


async def test_an_incarnation_fenced_before_its_batch_runs_no_tool(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    store = RedisCheckpointStore(any_client, keys)
    await store.save(record("t1", epoch=3, seq=5))  # the successor's claim landed first
    zombie = executor(any_client, keys, BUILTIN_TOOLS)
    with pytest.raises(StaleOwner):
        await zombie.run_batch("t1", 2, 0, CALLS)
    assert await EffectCounters(any_client, keys).counts("t1") == {}
    states = {e.state for e in (await ToolLedger(any_client, keys).entries("t1")).values()}
    assert states == {"prepared"}


async def test_a_claim_takes_new_calls_and_hands_back_what_the_ledger_holds(
    owned: ToolLedger,
) -> None:
    def claim(key: str, state: str) -> Claim:
        prepared = pack_model(LedgerEntry(state="prepared", name="echo"))
        return Claim(key, prepared, pack_model(LedgerEntry(state=state, name="echo", epoch=2)))

    assert await owned.claim("t1", 2, [claim("a", "dispatched"), claim("b", "failed")]) == {
        "a": None,
        "b": None,
    }
    again = await owned.claim("t1", 2, [claim("a", "committed"), claim("c", "dispatched")])
    held = again["a"]
    assert held is not None and held.entry.state == "dispatched"  # left as it was
    assert again["c"] is None
    states = {k: e.state for k, e in (await owned.entries("t1")).items()}
    assert states == {"a": "dispatched", "b": "failed", "c": "dispatched"}


async def test_a_claim_journals_its_reply_only_if_the_fence_passes(owned: ToolLedger) -> None:
    """The reply rides on the claim: journaled with the calls, never by a fenced owner, kept
    out of the calls' entries, set aside with why when a resume refuses it."""
    prepared = pack_model(LedgerEntry(state="prepared", name="echo"))
    decided = pack_model(LedgerEntry(state="dispatched", name="echo", epoch=2))
    with pytest.raises(StaleOwner):
        await owned.claim("t1", 1, [Claim("0.0.z", prepared, decided)], reply=b"zombie's")
    assert (await owned.read("t1")).reply is None
    assert await owned.claim("t1", 2, [Claim("0.0.a", prepared, decided)], reply=b"mine") == {
        "0.0.a": None
    }
    view = await owned.read("t1")
    assert view.reply == b"mine" and sorted(view.entries) == ["0.0.a", "0.0.z"]
    assert sorted(await owned.entries("t1")) == ["0.0.a", "0.0.z"]
    await owned.claim("t1", 2, [], reply=b"alone")  # before an approval question
    assert (await owned.read("t1")).reply == b"alone"
    await owned.refuse_reply("t1", b"alone", "it does not decode")
    assert (await owned.read("t1")).reply is None
    assert sorted(await owned.entries("t1")) == ["0.0.a", "0.0.z"]


async def test_claims_of_concurrent_turns_share_a_round_trip_and_each_gets_its_answer(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    store = RedisCheckpointStore(any_client, keys)
    for turn in ("a", "b", "c"):
        await store.save(record(turn, epoch=2, seq=3))
    ledger = ToolLedger(any_client, keys)
    prepared = pack_model(LedgerEntry(state="prepared", name="echo"))
    decided = pack_model(LedgerEntry(state="dispatched", name="echo", epoch=2))
    await any_client.script_flush()  # the first batch meets NOSCRIPT and loads the script

    async def claim(turn: str, epoch: int) -> dict[str, LedgerRead | None]:
        return await ledger.claim(turn, epoch, [Claim(f"{turn}-k", prepared, decided)])

    lane = lane_of(any_client)  # a real server's client has one: its writes are counted
    before = lane.round_trips if lane is not None else 0
    got = await asyncio.gather(
        claim("a", 2), claim("b", 2), claim("c", 1), claim("b", 2), return_exceptions=True
    )
    assert got[0] == {"a-k": None}
    assert isinstance(got[2], StaleOwner)  # fenced: its own answer, the others unharmed
    # Two claims of one call: one wins it, the other gets the winner's entry back.
    both = [got[1], got[3]]
    assert all(isinstance(b, dict) for b in both)
    assert sorted(b["b-k"] is None for b in both if isinstance(b, dict)) == [False, True]
    assert (await ledger.entries("c"))["c-k"].state == "prepared"
    # the four in fewer round trips (three: the claims, the script's loads, the claims again)
    if lane is not None:
        assert 0 < lane.round_trips - before < 4
    elif not isinstance(any_client, aioredis.RedisCluster):
        assert 0 < ledger.scripts.batches < 4


class GatedLedger(ToolLedger):
    """A ledger whose ``claim`` returns only once both racers have claimed, so the loser
    decides from the winner's entries while the winner's calls run."""

    arrived = 0
    both = asyncio.Event()

    async def claim(
        self, turn_id: str, epoch: int, claims: list[Claim], *, reply: bytes = b""
    ) -> dict[str, LedgerRead | None]:
        reads = await super().claim(turn_id, epoch, claims, reply=reply)
        GatedLedger.arrived += 1
        if GatedLedger.arrived == 2:
            GatedLedger.both.set()
        await GatedLedger.both.wait()
        return reads


async def test_two_owners_racing_on_one_batch_run_each_call_once(
    owned: ToolLedger, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    GatedLedger.arrived, GatedLedger.both = 0, asyncio.Event()
    effects = EffectCounters(any_client, keys)
    a, b = (
        BatchExecutor(BUILTIN_TOOLS, LocalToolRunner(), GatedLedger(any_client, keys), effects)
        for _ in range(2)
    )
    ra, rb = await asyncio.gather(a.run_batch("t1", 2, 0, CALLS), b.run_batch("t1", 2, 0, CALLS))
    counts = await effects.counts("t1")
    assert sorted(counts) == sorted(call_key("t1", 0, c, i) for i, c in enumerate(CALLS))
    assert set(counts.values()) == {1}  # nobody ran a call twice
    # Each call: one racer ran it, the other lost the dispatch and reports it in flight.
    for x, y in zip(ra.results, rb.results, strict=True):
        assert sorted([x.status, y.status]) == ["ok", "outcome_unknown"]


async def test_a_late_outcome_never_overwrites_what_a_successor_settled(
    owned: ToolLedger, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(args: Mapping[str, Any], ctx: ToolContext) -> str:
        started.set()
        await release.wait()
        return "late"

    registry = ToolRegistry([ToolSpec("slow", slow, idempotent=False)])
    calls = [ToolCall(id="c0", name="slow")]
    zombie = asyncio.ensure_future(
        executor(any_client, keys, registry).run_batch("t1", 2, 0, calls)
    )
    await started.wait()
    await RedisCheckpointStore(any_client, keys).save(record("t1", epoch=3, seq=4))
    (res,) = (await executor(any_client, keys, registry).run_batch("t1", 3, 0, calls)).results
    assert res.status == "outcome_unknown"  # in flight under the zombie: never re-run
    release.set()
    assert (await zombie).results[0].output == "late"
    (entry,) = (await owned.entries("t1")).values()
    assert (entry.state, entry.epoch) == ("outcome_unknown", 3)


async def test_a_batchs_idempotent_calls_reach_the_runner_as_one_group(
    owned: ToolLedger, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    """Calls of idempotent tools go to the runner together (one message on a cluster), the
    others each alone; every outcome is journaled either way, a deferred group's with the
    save that follows."""
    sent: list[tuple[str, ...]] = []

    class Recording(LocalToolRunner):
        async def run(self, spec: ToolSpec, call: ToolCall, ctx: ToolContext) -> ToolResult:
            sent.append(("alone", call.id))
            return await super().run(spec, call, ctx)

        async def run_group(self, jobs: Sequence[ToolJob]) -> list[ToolResult]:
            sent.append(("group", *(j.call.id for j in jobs)))
            return [await LocalToolRunner.run(self, j.spec, j.call, j.ctx) for j in jobs]

    effects = EffectCounters(any_client, keys)
    ex = BatchExecutor(BUILTIN_TOOLS, Recording(), owned, effects)
    calls = [
        ToolCall(id="e1", name="echo", args={"text": "a"}),
        ToolCall(id="n1", name="counter_increment", args={}),
        ToolCall(id="e2", name="echo", args={"text": "b"}),
    ]
    run = await ex.run_batch("t1", 2, 0, calls)
    assert [(r.call_id, r.status) for r in run.results] == [
        ("e1", "ok"), ("n1", "ok"), ("e2", "ok")
    ]  # fmt: skip
    assert run.settles == ()  # each journaled as it ended
    assert sorted(sent) == [("alone", "n1"), ("group", "e1", "e2")]
    states = {e.state for e in (await owned.entries("t1")).values()}
    assert states == {"committed"}
    # Deferred: the group that ends the batch leaves both its outcomes to the save.
    sent.clear()
    deferred = await ex.run_batch("t1", 2, 1, [calls[0], calls[2]], defer=True)
    assert sent == [("group", "e1", "e2")] and len(deferred.settles) == 2
    # A lone idempotent call is not a group.
    sent.clear()
    await ex.run_batch("t1", 2, 2, [calls[0]])
    assert sent == [("alone", "e1")]
