"""Approval decisions for tool calls flagged ``requires_approval``, decided through Redis.

One hash per turn: call key -> ``pending`` | ``approve`` | ``deny``. A decision replaces only
``pending`` (or nothing), so the first decision wins and a late one cannot flip it.
"""

from __future__ import annotations

import redis

from store.connection import StoreClient, text, translated
from store.keys import KeyLayout

PENDING = b"pending"
APPROVE = b"approve"
DENY = b"deny"


class Approvals:
    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys

    async def request(self, turn_id: str, call_key: str) -> None:
        """Mark a call as waiting for a decision (kept if already decided)."""
        with translated(f"request approval {turn_id}"):
            await self.client.hsetnx(self.keys.approval(turn_id), call_key, PENDING)

    async def decide(self, turn_id: str, call_key: str, approve: bool) -> bool:
        """Record a decision; returns False when the call was already decided."""
        key = self.keys.approval(turn_id)
        with translated(f"decide approval {turn_id}"):
            async with self.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        current = await pipe.hget(key, call_key)
                        if current not in (None, PENDING):
                            return False
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.hset(key, call_key, APPROVE if approve else DENY)
                        await pipe.execute()
                        return True
                    except redis.WatchError:
                        continue

    async def decision(self, turn_id: str, call_key: str) -> bool | None:
        """True approved, False denied, None undecided."""
        with translated(f"read approval {turn_id}"):
            raw = await self.client.hget(self.keys.approval(turn_id), call_key)
        return None if raw in (None, PENDING) else raw == APPROVE

    async def pending(self, turn_id: str) -> list[str]:
        """Call keys still waiting for a decision."""
        with translated(f"read approvals {turn_id}"):
            raw = await self.client.hgetall(self.keys.approval(turn_id))
        return sorted(text(k) for k, v in raw.items() if v == PENDING)
