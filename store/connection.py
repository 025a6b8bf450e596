"""Connecting to Redis and translating its errors at the boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.connection import HiredisRespSerializer

from bus.errors import RecordError, StoreError, StoreUnavailable


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


def redact_url(url: str) -> str:
    """``url`` with its password (and a lone username-as-password) replaced by ``***``: what
    every message, log line and report prints instead of the URL itself."""
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
    error names the problem, never the password."""
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


def connect(
    url: str, *, max_connections: int = 64, retry_s: float = DEFAULT_RETRY_S
) -> aioredis.Redis:
    """An asyncio client on a bounded pool; bytes in, bytes out (records are binary).

    When every connection is busy a caller waits for one (backpressure: thousands of turns
    share a few dozen connections, and a busy Redis only slows them down). A Redis that is
    gone is retried for about ``retry_s`` seconds (:func:`retry_policy`), then fails.
    """
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


@contextmanager
def translated(action: str) -> Iterator[None]:
    """Re-raise ``redis.RedisError`` (and socket errors) as :class:`StoreError`:
    :class:`StoreUnavailable` for what passes (see :func:`is_transient`)."""
    try:
        yield
    except (redis.RedisError, OSError) as exc:
        kind = StoreUnavailable if is_transient(exc) else StoreError
        raise kind(f"{action}: {type(exc).__name__}: {exc}") from exc


#: Reply prefixes of a server that will answer again: loading, out of memory, a failover.
_TRANSIENT_REPLIES = ("LOADING", "OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "READONLY", "BUSY")


def is_transient(exc: BaseException) -> bool:
    """Whether waiting can fix it: a lost or refused connection, a timeout, a server that is
    loading, full, failing over or running a long script."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)


@contextmanager
def reading(key: str, action: str) -> Iterator[None]:
    """Like :func:`translated`, for reading one key: a key of the wrong type (a string where a
    hash belongs) is that key's :class:`RecordError`, so the caller quarantines it and the
    other turns go on, instead of a StoreError that stops every reader."""
    try:
        yield
    except redis.ResponseError as exc:
        if str(exc).startswith("WRONGTYPE"):
            raise RecordError(key, f"wrong Redis type: {exc}") from exc
        raise StoreError(f"{action}: {type(exc).__name__}: {exc}") from exc
    except (redis.RedisError, OSError) as exc:
        raise StoreError(f"{action}: {type(exc).__name__}: {exc}") from exc


StreamEntries = list[tuple[str, list[tuple[str, dict[bytes, bytes]]]]]
"""XREAD/XREADGROUP reply: (stream, [(entry id, fields)]) with ids and names as str."""


async def read_streams(
    client: aioredis.Redis,
    cursors: dict[str, str],
    *,
    count: int,
    block_ms: int,
    group: tuple[str, str] | None = None,
) -> StreamEntries:
    """XREAD (or XREADGROUP for ``group = (group, consumer)``), typed and translated."""
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


async def read_range(client: aioredis.Redis, stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
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
