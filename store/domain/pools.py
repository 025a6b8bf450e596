"""The current size of every tool worker pool (``KeyLayout.pools``): the Supervisor resizes
pools (``actors.turn.autoscale``) and hosts route and admit calls by what is stored here, read
at most once per ``ttl_s`` (so a host follows a resize within about a second)."""

from __future__ import annotations

import time

from bus.errors import RecordError
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text


class PoolSizes:
    """Read (cached) and write pool sizes."""

    def __init__(self, client: StoreClient, keys: KeyLayout, *, ttl_s: float = 1.0) -> None:
        self.client = client
        self.key = keys.pools()
        self.ttl_s = ttl_s
        self._cache: dict[str, int] = {}
        self._read_at = float("-inf")

    async def all(self, *, fresh: bool = False) -> dict[str, int]:
        """Pool -> size; a value that is not a positive count is a :class:`RecordError`."""
        if fresh or time.monotonic() - self._read_at >= self.ttl_s:
            with translated("read tool pool sizes"):
                raw = await self.client.hgetall(self.key)
            sizes = {}
            for k, v in raw.items():
                value = text(v)
                if not value.isdigit() or int(value) < 1:
                    raise RecordError(self.key, f"pool {text(k)} size {value!r} is not a count")
                sizes[text(k)] = int(value)
            self._cache, self._read_at = sizes, time.monotonic()
        return self._cache

    async def get(self, pool: str, default: int) -> int:
        return (await self.all()).get(pool, default)

    async def set(self, pool: str, size: int) -> None:
        with translated("write a tool pool size"):
            await self.client.hset(self.key, pool, size)
        self._cache[pool] = size
