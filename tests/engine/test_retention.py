"""Retention covers every copy of a finished turn's content: each key that names the turn
(record, transcript, spec, ledger, effects, inbox, approvals, live stream, its session's hash,
the provider's id of its model call) expires at most ``finished_ttl_s`` after its final save,
also when the live stream's last events are published after that save, on fakeredis, one real
server and a real Redis Cluster."""

from __future__ import annotations

import redis.asyncio as aioredis

from actors.engine.settings.config import RedisSettings, RetentionSettings, Settings
from actors.engine.turn_engine import TurnEngine
from bus.outcomes import Outcome
from store.keys import KeyLayout
from store.records import TurnInput
from tests.support.polling import eventually

AGENT = "tests.support.agents:calculator"
TTL_S = 3


async def test_a_finished_turn_leaves_no_key_once_its_retention_is_over(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    settings = Settings(
        redis=RedisSettings(namespace=keys.namespace, shards=keys.shards, durability="ack"),
        retention=RetentionSettings(finished_ttl_s=TTL_S),
    )
    engine = TurnEngine.from_settings(any_client, settings, watchdog=False)
    spec, record = await engine.open_in_session(AGENT, TurnInput(message="add"), "kept")
    turn = record.turn_id
    await engine.inbox.push(turn, "and then?")  # an inbox and an approval hash to expire too
    await engine.approvals.request(turn, "0.0.abc", tool="add", args="{}")
    await engine.model_services.responses.note(turn, "gen", "resp_1")  # a kept generation's id
    assert (await engine.start(record, spec)).outcome == Outcome.ANSWERED
    await engine.aclose()  # the live stream's last events land after the final save

    async def turn_keys() -> dict[str, int]:
        named = [
            k.decode() async for k in any_client.scan_iter(f"{keys.namespace}:*")
            if turn.encode() in k or k.endswith(b":session:kept")
        ]  # fmt: skip
        return {k: await any_client.pttl(k) for k in named}

    left = await turn_keys()
    kinds = {k.split(":")[2] for k in left}
    assert kinds == {
        "turn", "bodies", "spec", "tools", "inbox", "approval", "live", "session", "response"
    }, left  # fmt: skip
    assert all(0 < ttl <= TTL_S * 1000 for ttl in left.values()), left

    async def expired() -> bool:
        return not await turn_keys()

    await eventually(expired, timeout=TTL_S + 5, what="the turn's keys to expire")
