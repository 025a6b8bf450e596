"""Side-effect counters: the observable effect of the non-idempotent ``counter_increment`` tool.

One counter per call key, so anyone can check from outside that a non-idempotent call ran at
most once (a value above 1 is a duplicated side effect).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from store.connection import text, translated
from store.keys import KeyLayout


class EffectCounters:
    def __init__(self, client: aioredis.Redis, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys

    async def increment(self, turn_id: str, call_key: str) -> int:
        """Perform the side effect; returns how many times this call key has now run."""
        with translated(f"increment effect {turn_id}"):
            return int(await self.client.hincrby(self.keys.effects(turn_id), call_key, 1))

    async def counts(self, turn_id: str) -> dict[str, int]:
        with translated(f"read effects {turn_id}"):
            raw = await self.client.hgetall(self.keys.effects(turn_id))
        return {text(k): int(v) for k, v in raw.items()}
