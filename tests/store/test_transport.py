"""The one transport to Redis (``store.redis.transport``), held to one contract on fakeredis, a real
server (through its lean connection) and a real Redis Cluster: replies in order with error
replies as their exceptions, a lost script cache reloaded and only what did nothing sent
again, a moved slot followed, a durability wait on the same connection."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from bus.errors import StoreUnavailable
from store.keys import KeyLayout
from store.lua import lua_script
from store.redis.lane import lane_of
from store.redis.transport import REDIRECT_ATTEMPTS, Transport, transport_of

CAS = lua_script("ledger_cas.lua")


async def test_replies_come_back_in_order_with_errors_as_exceptions(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    key = keys.turn("tx1")
    sent = await transport_of(any_client).send(
        key, [("SET", key, b"v"), ("INCR", key), ("GET", key)]
    )
    assert sent.replies[0] in (True, b"OK", "OK")
    assert isinstance(sent.replies[1], redis.ResponseError)  # not an integer: its own answer
    assert sent.replies[2] == b"v"
    assert sent.waits == [None, None, None]


async def test_a_lost_script_cache_is_loaded_again_and_only_what_did_nothing_is_resent(
    any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    transport = transport_of(any_client)
    record, ledger = keys.turn("tx2"), keys.tools("tx2")
    sha = await any_client.script_load(CAS)
    await any_client.script_flush()  # a restart, a failover: the cache is gone
    before = transport.round_trips
    # An unfenced compare-and-set from nothing to "x": NOSCRIPT first, then run once.
    cas = ("EVALSHA", sha, 3, record, ledger, keys.usage_of("tx2"), "", "k", "", "x")
    counter = ("INCR", keys.usage_of("tx2"))
    sent = await transport.send(record, [cas, counter])
    assert sent.replies[0] == [b"ok", 0]  # the field held no "" (absent): left as it is
    assert sent.replies[1] == 1  # the command that ran is not sent again
    assert transport.round_trips == before + 2
    assert await any_client.get(keys.usage_of("tx2")) == b"1"


async def test_a_durability_wait_goes_last_on_the_same_connection(
    real_client: aioredis.Redis, keys: KeyLayout
) -> None:
    assert lane_of(real_client) is not None  # the real server's plain-TCP client: a lane
    key = keys.turn("tx3")
    sent = await transport_of(real_client).send(
        key, [("SET", key, b"a"), ("SET", key, b"b")], wait=("WAITAOF", 1, 0, 1000)
    )
    assert sent.waits[0] == sent.waits[1] == [1, 0]  # fsynced here, no replica asked
    assert await real_client.get(key) == b"b"


class _Moving(Transport):
    """A transport whose node answers ``MOVED`` the first ``n`` times (a slot mid-failover)."""

    def __init__(self, client: Any, n: int) -> None:
        super().__init__(client)
        self.moving = n
        self.refreshed = 0

    async def _roundtrip(self, key: str, batch: list[Any]) -> list[object]:
        if self.moving:
            self.moving -= 1
            return [redis.exceptions.MovedError("1234 127.0.0.1:1")] * len(batch)
        return await super()._roundtrip(key, batch)


async def test_a_moved_slot_is_followed_then_given_up_on(
    real_client: aioredis.Redis, keys: KeyLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    import store.redis.transport as transport_module

    moving = _Moving(real_client, 2)

    async def refreshed(_client: object) -> None:
        moving.refreshed += 1

    monkeypatch.setattr(transport_module, "refresh_topology", refreshed)
    key = keys.turn("tx4")
    sent = await moving.send(key, [("SET", key, b"there")])
    assert moving.refreshed == 2 and sent.replies[0] in (True, b"OK")
    stuck = _Moving(real_client, REDIRECT_ATTEMPTS)
    (reply,) = (await stuck.send(key, [("SET", key, b"never")])).replies
    assert isinstance(reply, StoreUnavailable) and "kept moving" in str(reply)
    assert await real_client.get(key) == b"there"
