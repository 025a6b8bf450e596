"""The lean path to one server (``store.redis.lane``), against the real server and a silent one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

from store.redis.connection import connect
from store.redis.lane import Lane, lane_of


@pytest.fixture
async def lane(redis_url: str) -> AsyncIterator[Lane]:
    client = connect(redis_url)
    found = lane_of(client)
    assert found is not None  # a plain TCP URL of one server gets one
    yield found
    await client.aclose()


async def test_replies_and_error_replies_come_back_in_order_as_redis_py_reads_them(
    lane: Lane, namespace: str
) -> None:
    key = f"{namespace}:k"
    replies = await lane.calls(
        [("SET", key, b"v\x00"), ("GET", key), ("NOSUCHCOMMAND",), ("EVALSHA", "0" * 40, 0)]
    )
    assert replies[:2] == [b"OK", b"v\x00"]
    assert type(replies[2]) is redis.ResponseError and "unknown command" in str(replies[2])
    assert isinstance(replies[3], redis.exceptions.NoScriptError)
    with pytest.raises(redis.exceptions.NoScriptError):
        await lane.call("EVALSHA", "0" * 40, 0)
    assert await lane.call("INCRBY", f"{namespace}:n", 5) == 5


async def test_concurrent_callers_share_writes_and_each_gets_its_own_reply(
    lane: Lane, namespace: str
) -> None:
    await lane.call("PING")
    before = lane.round_trips
    got = await asyncio.gather(*(lane.call("ECHO", f"{namespace}-{i}") for i in range(200)))
    assert got == [f"{namespace}-{i}".encode() for i in range(200)]
    assert lane.round_trips - before == 1  # one write carried all 200


async def test_a_caller_that_gives_up_leaves_the_others_in_step(lane: Lane) -> None:
    await lane.call("PING")
    proto = lane._proto
    assert proto is not None
    gone = asyncio.ensure_future(lane.call("ECHO", "never read"))
    await asyncio.sleep(0)  # one step of the task: it queues its command and waits
    assert len(proto.waiting) == 1  # sent, not answered yet
    gone.cancel()
    assert await lane.call("ECHO", "mine") == b"mine"
    assert gone.cancelled()


async def test_a_killed_connection_is_opened_again_and_the_command_sent_again(
    lane: Lane, redis_url: str
) -> None:
    first = await lane.call("CLIENT", "ID")
    admin = aioredis.Redis.from_url(redis_url)
    try:
        assert await admin.execute_command("CLIENT", "KILL", "ID", first) == 1
    finally:
        await admin.aclose()
    again = await lane.call("CLIENT", "ID")  # the dead socket, found, then a new one
    assert again != first


async def test_a_server_that_never_answers_is_a_timeout_not_a_hang() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)  # takes the command, answers nothing
        await asyncio.Event().wait()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    lane = Lane(host="127.0.0.1", port=port, retry_s=0.3, reply_timeout_s=0.2)
    try:
        with pytest.raises(redis.TimeoutError, match="did not answer"):
            await lane.call("PING")
    finally:
        await lane.aclose()
        server.close()


async def test_a_wrong_password_is_redis_pys_authentication_error(redis_url: str) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    assert lane is not None and lane.password
    wrong = Lane(host=lane.host, port=lane.port, password="wrong", retry_s=0.2)
    try:
        with pytest.raises(redis.AuthenticationError):
            await wrong.call("PING")
    finally:
        await wrong.aclose()
        await client.aclose()


def test_only_a_plain_tcp_url_of_one_server_gets_a_lane(redis_url: str) -> None:
    assert lane_of(connect(redis_url)) is not None
    assert lane_of(connect("rediss://127.0.0.1:6380/0")) is None
    assert lane_of(connect("unix:///tmp/redis.sock")) is None
    assert lane_of(connect("redis://127.0.0.1:7000", cluster=True)) is None


async def test_a_durability_wait_is_sent_once_a_write_and_answers_every_caller(
    lane: Lane, namespace: str
) -> None:
    """500 callers each asking for their write and a ``WAITAOF``: one wait, after all of them
    (a wait blocks the connection until the next fsync: once per caller was 500 in a row)."""
    commands = [(("SET", f"{namespace}:{i}", i), ("WAITAOF", 0, 0, 1000)) for i in range(500)]
    await lane.call("PING")
    before = lane.round_trips
    proto = lane._proto
    assert proto is not None
    calls = [asyncio.ensure_future(lane.calls(c)) for c in commands]
    await asyncio.sleep(0)  # one step of each: all queued for the same write
    assert len(proto.waiting) == 500  # the writes; the wait is queued apart, once
    got = await asyncio.gather(*calls)
    assert all(g[0] == b"OK" and g[1] == got[0][1] for g in got)
    assert lane.round_trips - before == 1
