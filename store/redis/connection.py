"""Connecting to Redis: the client every store class talks through, its connections and its
retries."""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.connection import HiredisRespSerializer

from bus.errors import StoreError
from store.redis.lane import Lane, LaneRedis
from store.redis.urls import redact_url, seed_urls

StoreClient: TypeAlias = aioredis.Redis | aioredis.RedisCluster
"""What every store class talks through: one server's client, or a Redis Cluster's
(``[redis] cluster = true``). Both speak the same commands; where they differ (a raw
connection, a read across slots) :mod:`store.redis.connection` hides it."""


class _HiredisConnection(aioredis.Connection):
    """A TCP connection that packs commands with hiredis' C packer.

    redis-py's sync client does this when hiredis is installed; its asyncio client packs in
    Python, which ``phaseline bench`` profiled at a fifth of a save's CPU (a record is a
    13-field HSET). Replies are parsed by hiredis either way.
    """

    _serializer = HiredisRespSerializer()  # type: ignore[no-untyped-call,unused-ignore]

    def pack_command(self, *args: Any) -> list[bytes]:
        packed: list[bytes] = self._serializer.pack(*args)
        return packed


#: Seconds a command keeps retrying through connection errors by default (``[redis] retry_s``).
DEFAULT_RETRY_S = 5.0


def retry_policy(retry_s: float) -> Retry:
    """redis-py's own retry, sized to ride out a Redis restart of about ``retry_s`` seconds:
    backoff 0.1, 0.2, 0.4, 0.8 s, then 1 s per attempt. Only connection errors and timeouts are
    retried. Every write phaseline sends is safe to repeat: saves and ledger writes recognise
    their own replay, effect counters and inbox entries carry ids that make a repeat a no-op."""
    retries, waited = 0, 0.0
    while waited < retry_s:
        retries += 1
        waited += min(1.0, 0.05 * 2**retries)
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)


#: A cluster client's connections per node, as a multiple of ``max_connections``: redis-py's
#: cluster client cannot queue for a free connection (past its cap a command fails with
#: MaxConnectionsError), so the cap is set where the server, not the client, pushes back.
CLUSTER_CONNECTION_FACTOR = 16


def connect(
    url: str,
    *,
    cluster: bool = False,
    max_connections: int = 64,
    retry_s: float = DEFAULT_RETRY_S,
) -> StoreClient:
    """An asyncio client on a bounded pool; bytes in, bytes out (records are binary).

    When every connection is busy a caller waits for one (backpressure: thousands of turns
    share a few dozen connections, and a busy Redis only slows them down). A Redis that is
    gone is retried for about ``retry_s`` seconds (:func:`retry_policy`), then fails.
    ``cluster``: ``url`` names one or more nodes of a Redis Cluster (:func:`seed_urls`); the
    client learns the others and routes each command by its key's slot.
    """
    seeds = seed_urls(url)
    if cluster:
        try:
            more = [urlsplit(seed) for seed in seeds[1:]]
            return aioredis.RedisCluster.from_url(
                seeds[0],
                startup_nodes=[
                    aioredis.cluster.ClusterNode(p.hostname or "", p.port or 6379) for p in more
                ],
                max_connections=max_connections * CLUSTER_CONNECTION_FACTOR,
                socket_connect_timeout=5,
                socket_timeout=30,
                retry=retry_policy(retry_s),
                decode_responses=False,
            )
        except ValueError as exc:
            raise StoreError(f"invalid Redis URL {redact_url(url)}: {exc}") from None
    if len(seeds) > 1:
        shown = redact_url(url)
        raise StoreError(f"{shown} names several nodes: that needs [redis] cluster = true")
    # Only plain TCP gets the hiredis packer: unix:// and rediss:// keep redis-py's own classes
    # (redis-py 8.2 no longer swaps a given class out for them).
    plain_tcp = urlsplit(url).scheme == "redis"
    own: dict[str, Any] = {"connection_class": _HiredisConnection} if plain_tcp else {}
    try:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            **own,
            max_connections=max_connections,
            timeout=None,
            socket_connect_timeout=5,
            socket_timeout=30,
            health_check_interval=30,
            retry=retry_policy(retry_s),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError, ConnectionError],
        )
        if not plain_tcp:  # a lane is plain TCP only
            return aioredis.Redis(connection_pool=pool, decode_responses=False)
        kw = pool.connection_kwargs
        lane = Lane(
            host=kw.get("host", "localhost"),
            port=int(kw.get("port", 6379)),
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db", 0)),
            retry_s=retry_s,
            connect_timeout_s=5,
            reply_timeout_s=30,
        )
        return LaneRedis(connection_pool=pool, decode_responses=False, lane=lane)
    except ValueError as exc:
        raise StoreError(f"invalid Redis URL {redact_url(url)}: {exc}") from None
