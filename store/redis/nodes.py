"""Talking to one node of a Redis Cluster (or the one server): a raw connection to the node
holding a key, a round trip of several commands on it, the redirects a node may answer and
the slot a key lives in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
import redis.asyncio as aioredis

from bus.errors import StoreUnavailable
from store.redis.connection import StoreClient
from store.redis.failures import translated


@asynccontextmanager
async def node_connection(client: StoreClient, key: str) -> AsyncIterator[Any]:
    """A raw connection to the server holding ``key`` (on a cluster: its slot's primary), for
    commands that must share one connection: ``WATCH`` … ``EXEC``, or writes followed by the
    ``WAIT`` that covers them. On any exception the connection is dropped, not pooled: replies
    may be unread."""
    if not isinstance(client, aioredis.RedisCluster):
        pool = client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            yield conn
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        return
    with translated(f"find the node of {key}"):
        if client._initialize_due():  # no topology yet, or a refresh was asked for
            await client.initialize()
        node = client.get_node_from_key(key)
    if node is None:
        raise StoreUnavailable(f"no node serves the slot of {key}")
    conn = node.acquire_connection()
    try:
        yield conn
    except BaseException as exc:
        await conn.disconnect()
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError):
            await refresh_topology(client)  # the node may be dead: learn who serves it now
        raise
    finally:
        node.release(conn)


async def roundtrip(conn: Any, commands: list[tuple[Any, ...]]) -> list[object]:
    """Send ``commands`` on a raw connection in one write and read every reply; an error reply
    is returned as its exception so the connection stays in step."""
    await conn.send_packed_command(conn.pack_commands(commands))
    out: list[object] = []
    for _ in commands:
        try:
            out.append(await conn.read_response())
        except redis.ResponseError as exc:
            out.append(exc)
    return out


#: Error replies of a cluster whose slot map changed under the client (a failover, a
#: resharding): the command did not run; ask again after the client refreshes its map.
_REDIRECTS = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


#: The classes redis-py parses those replies into: their text loses the code (a MovedError
#: reads "4494 127.0.0.1:30319"), so the class is what tells.
_REDIRECT_ERRORS = (
    redis.exceptions.AskError,  # MovedError is a subclass
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


def is_redirect(reply: object) -> bool:
    """Whether a reply says the command ran nowhere because the slot is elsewhere now."""
    if isinstance(reply, _REDIRECT_ERRORS):
        return True
    return isinstance(reply, redis.ResponseError) and str(reply).startswith(_REDIRECTS)


async def refresh_topology(client: StoreClient) -> None:
    """After a redirect or a lost node: make a cluster client read the slot map again."""
    if isinstance(client, aioredis.RedisCluster):
        with translated("refresh the cluster's slot map"):
            await client.nodes_manager.initialize()


def slot_of(client: StoreClient, key: str) -> int:
    """The cluster slot of ``key`` (0 for a single server: one slot holds everything)."""
    return client.keyslot(key) if isinstance(client, aioredis.RedisCluster) else 0
