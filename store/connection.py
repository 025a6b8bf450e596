"""Connecting to Redis and translating its errors at the boundary."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
import redis.asyncio as aioredis

from bus.errors import StoreError


def connect(url: str, *, max_connections: int = 64, wait_s: float = 30.0) -> aioredis.Redis:
    """An asyncio client on a bounded pool; bytes in, bytes out (records are binary).

    The pool blocks (up to ``wait_s``) when all connections are busy instead of failing, so
    thousands of turns can share a few dozen connections.
    """
    try:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=wait_s, health_check_interval=30
        )
        return aioredis.Redis(connection_pool=pool, decode_responses=False)
    except ValueError as exc:
        raise StoreError(f"invalid Redis URL {url!r}: {exc}") from exc


@contextmanager
def translated(action: str) -> Iterator[None]:
    """Re-raise ``redis.RedisError`` (and socket errors) as :class:`StoreError`."""
    try:
        yield
    except (redis.RedisError, OSError) as exc:
        raise StoreError(f"{action}: {type(exc).__name__}: {exc}") from exc


def text(value: bytes | str) -> str:
    """A Redis reply as str (redis-py types replies as ``bytes | str``)."""
    return value.decode() if isinstance(value, bytes) else value


def raw(value: bytes | str) -> bytes:
    """A Redis reply as bytes."""
    return value if isinstance(value, bytes) else value.encode()
