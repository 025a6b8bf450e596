"""Connecting to Redis and translating its errors at the boundary."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.connection import HiredisRespSerializer

from bus.errors import RecordError, StoreError, StoreRefused, StoreUnavailable

StoreClient: TypeAlias = aioredis.Redis | aioredis.RedisCluster
"""What every store class talks through: one server's client, or a Redis Cluster's
(``[redis] cluster = true``). Both speak the same commands; where they differ (a raw
connection, a read across slots) :mod:`store.connection` hides it."""


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


_SCHEMES = ("redis", "rediss", "unix")


def seed_urls(url: str) -> list[str]:
    """The nodes a URL names. A Redis Cluster URL may name several seeds, as in
    ``redis://:pw@h1:7000,h2:7001``: a client starting while one of them is down (a failed
    primary) reaches the cluster through another. Each seed gets the shared user, password,
    path and query; a URL of one host is returned as it is."""
    scheme, sep, rest = url.partition("://")
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    end = min(ends, default=len(rest))
    user, at, hosts = rest[:end].rpartition("@")
    if not sep or "," not in hosts:
        return [url]
    return [f"{scheme}://{user}{at}{host}{rest[end:]}" for host in hosts.split(",")]


def _join_seeds(urls: list[str]) -> str:
    """The inverse of :func:`seed_urls` for URLs that differ only in host and port."""
    first = urlsplit(urls[0])
    hosts = [urlsplit(u).netloc.rpartition("@")[2] for u in urls]
    user = first.netloc.rpartition("@")[0]
    netloc = ",".join(hosts) if not user else f"{user}@{','.join(hosts)}"
    return urlunsplit(first._replace(netloc=netloc))


def redact_url(url: str) -> str:
    """``url`` with its password (and a lone username-as-password) replaced by ``***``: what
    every message, log line and report prints instead of the URL itself."""
    seeds = seed_urls(url)
    if len(seeds) > 1:
        return _join_seeds([redact_url(seed) for seed in seeds])
    try:
        parts = urlsplit(url)
        if parts.password is None and not (parts.username and parts.scheme in _SCHEMES):
            return url
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = (parts.username or "") if parts.password is not None else ""
        netloc = f"{user}:***@{host}"
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparseable Redis URL>"


def check_redis_url(url: str) -> str:
    """Refuse a URL redis-py would misread (``redis://h/abc`` silently meant db 0); the
    error names the problem, never the password. Every seed of a cluster URL is checked."""
    seeds = seed_urls(url)
    if len(seeds) > 1:
        for seed in seeds:
            check_redis_url(seed)
        return url
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {shown}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"invalid Redis URL {shown}: scheme must be one of {list(_SCHEMES)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"invalid Redis URL {shown}: unix:// needs a socket path")
        return url
    if not parts.hostname:
        raise ValueError(f"invalid Redis URL {shown}: no host")
    if port == 0:
        raise ValueError(f"invalid Redis URL {shown}: port 0")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"invalid Redis URL {shown}: database {db!r} is not a number")
    return url


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
    own: dict[str, Any] = {}
    if urlsplit(url).scheme == "redis":
        own["connection_class"] = _HiredisConnection
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
        return aioredis.Redis(connection_pool=pool, decode_responses=False)
    except ValueError as exc:
        raise StoreError(f"invalid Redis URL {redact_url(url)}: {exc}") from None


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


@contextmanager
def translated(action: str) -> Iterator[None]:
    """Re-raise ``redis.RedisError`` (and socket errors) as :class:`StoreError`:
    :class:`StoreRefused` for a command the server answered it did not run,
    :class:`StoreUnavailable` for what else passes (see :func:`is_transient`)."""
    try:
        yield
    except (redis.RedisError, OSError) as exc:
        raise _store_error(exc, action) from exc


def _store_error(exc: BaseException, action: str) -> StoreError:
    kind = (
        StoreRefused if is_refusal(exc) else StoreUnavailable if is_transient(exc) else StoreError
    )
    return kind(f"{action}: {type(exc).__name__}: {exc}")


#: Codes of the error replies by which a server refuses to run a command it will take later:
#: loading its data, out of memory, writes stopped by a failing disk (MISCONF), a read-only
#: replica, too few replicas, a failover, a slot moving, a long script running. redis-py gives
#: some their own classes and keeps the code in ``status_code`` or at the head of the message.
_REFUSALS = frozenset(
    {"LOADING", "OOM", "MISCONF", "READONLY", "NOREPLICAS", "MASTERDOWN", "TRYAGAIN",
     "CLUSTERDOWN", "BUSY"}
)  # fmt: skip
_REFUSAL_CLASSES = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


def is_refusal(exc: BaseException) -> bool:
    """Whether Redis answered that it did not run the command (so nothing was written)."""
    if isinstance(exc, _REFUSAL_CLASSES):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code in _REFUSALS


def is_transient(exc: BaseException) -> bool:
    """Whether waiting can fix it: a lost or refused connection, a timeout, a server that
    refused the command for now (:func:`is_refusal`)."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return True
    return is_refusal(exc)


@contextmanager
def reading(key: str, action: str) -> Iterator[None]:
    """Like :func:`translated`, for reading one key: a key of the wrong type (a string where a
    hash belongs) is that key's :class:`RecordError`, so the caller quarantines it and the
    other turns go on, instead of a StoreError that stops every reader."""
    try:
        yield
    except redis.ResponseError as exc:
        if str(exc).startswith("WRONGTYPE") or getattr(exc, "status_code", None) == "WRONGTYPE":
            raise RecordError(key, f"wrong Redis type: {exc}") from exc
        raise _store_error(exc, action) from exc
    except (redis.RedisError, OSError) as exc:
        raise _store_error(exc, action) from exc


StreamEntries = list[tuple[str, list[tuple[str, dict[bytes, bytes]]]]]
"""XREAD/XREADGROUP reply: (stream, [(entry id, fields)]) with ids and names as str."""


async def read_streams(
    client: StoreClient,
    cursors: dict[str, str],
    *,
    count: int,
    block_ms: int,
    group: tuple[str, str] | None = None,
) -> StreamEntries:
    """XREAD (or XREADGROUP for ``group = (group, consumer)``), typed and translated.

    On a cluster one XREAD may only name streams of one slot, so there is one read per slot,
    all at once: first without blocking, and only if none had entries, blocking. A blocking
    pass returns when every slot's read has (an entry that lands in one slot while the
    others still block waits up to ``block_ms``: the latency of a reader woken from idle)."""
    if not isinstance(client, aioredis.RedisCluster):
        return await _xread(client, cursors, count=count, block_ms=block_ms, group=group)
    by_slot: dict[int, dict[str, str]] = {}
    for stream, cursor in cursors.items():
        by_slot.setdefault(client.keyslot(stream), {})[stream] = cursor
    if len(by_slot) == 1:
        return await _xread(client, cursors, count=count, block_ms=block_ms, group=group)
    for block in (None, block_ms):
        parts = await asyncio.gather(
            *(_xread(client, p, count=count, block_ms=block, group=group) for p in by_slot.values())
        )
        found = [entry for part in parts for entry in part]
        if found:
            return found
    return []


async def _xread(
    client: StoreClient,
    cursors: dict[str, str],
    *,
    count: int,
    block_ms: int | None,
    group: tuple[str, str] | None,
) -> StreamEntries:
    streams: dict[Any, Any] = dict(cursors)
    with translated("read streams"):
        if group is None:
            reply: Any = await client.xread(streams, count=count, block=block_ms)
        else:
            reply = await client.xreadgroup(
                group[0], group[1], streams, count=count, block=block_ms
            )
    return [
        (text(stream), [(text(eid), fields) for eid, fields in entries])
        for stream, entries in (reply or [])
    ]


async def read_range(client: StoreClient, stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """Every entry of a stream (XRANGE - +), typed and translated."""
    with translated(f"read stream {stream}"):
        reply: Any = await client.xrange(stream)
    return [(text(eid), fields) for eid, fields in reply or [] if fields is not None]


def text(value: bytes | str) -> str:
    """A Redis reply as str (redis-py types replies as ``bytes | str``)."""
    return value.decode() if isinstance(value, bytes) else value


def raw(value: bytes | str) -> bytes:
    """A Redis reply as bytes."""
    return value if isinstance(value, bytes) else value.encode()
