"""Approval decisions for tool calls flagged ``requires_approval``, decided through Redis.

One hash per turn (``KeyLayout.approval``): call key -> a msgpack
:class:`~store.records.Approval` (tool, arguments, when asked; once decided, the decision, who
and why). A decision replaces only a pending entry (or nothing), so the first decision wins and
a late one cannot flip it. Entries written before approvals carried their call (the plain words
``pending``, ``approve``, ``deny``) are still read.
"""

from __future__ import annotations

import time
from typing import Literal

import redis

from bus.errors import NotAwaitingApproval
from store.codec import pack_model, unpack_model
from store.keys import KeyLayout
from store.records import Approval
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import raw as raw_bytes
from store.redis.replies import text

__all__ = ["ARGS_LIMIT", "Approvals"]

#: Characters of a call's arguments kept with its approval request.
ARGS_LIMIT = 2000
_WORDS: dict[bytes, Literal["pending", "approve", "deny"]] = {
    b"pending": "pending",
    b"approve": "approve",
    b"deny": "deny",
}


def _read(key: str, value: bytes | str) -> Approval:
    raw = raw_bytes(value)
    if raw in _WORDS:
        return Approval(state=_WORDS[raw])
    return unpack_model(Approval, raw, key=key)


class Approvals:
    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys

    async def request(self, turn_id: str, call_key: str, *, tool: str = "", args: str = "") -> None:
        """Mark a call as waiting for a decision (kept if already decided)."""
        asked = Approval(state="pending", tool=tool, args=args[:ARGS_LIMIT], asked_at_ms=_now_ms())
        with translated(f"request approval {turn_id}"):
            await self.client.hsetnx(self.keys.approval(turn_id), call_key, pack_model(asked))

    async def decide(
        self, turn_id: str, call_key: str, approve: bool, *, by: str = "", reason: str = ""
    ) -> bool:
        """Record a decision on a call that asked for one; returns False when it was already
        decided, raises :class:`NotAwaitingApproval` when no question was asked for it (a
        decision taken ahead would approve a call nobody saw)."""
        key = self.keys.approval(turn_id)
        with translated(f"decide approval {turn_id}"):
            async with self.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.hget(key, call_key)
                        if raw is None:
                            raise NotAwaitingApproval(
                                f"turn {turn_id}: call {call_key} is not waiting for a decision"
                            )
                        current = _read(f"{key}#{call_key}", raw)
                        if current.state != "pending":
                            return False
                        decided = current.model_copy(
                            update={
                                "state": "approve" if approve else "deny",
                                "decided_at_ms": _now_ms(),
                                "by": by,
                                "reason": reason,
                            }
                        )
                        pipe.multi()  # type: ignore[no-untyped-call]
                        pipe.hset(key, call_key, pack_model(decided))
                        await pipe.execute()
                        return True
                    except redis.WatchError:
                        continue

    async def decision(self, turn_id: str, call_key: str) -> Approval | None:
        """The decision on a call (None while undecided)."""
        key = self.keys.approval(turn_id)
        with translated(f"read approval {turn_id}"):
            raw = await self.client.hget(key, call_key)
        if raw is None:
            return None
        found = _read(f"{key}#{call_key}", raw)
        return None if found.state == "pending" else found

    async def pending(self, turn_id: str) -> dict[str, Approval]:
        """Calls of the turn still waiting for a decision, by call key."""
        return {k: a for k, a in (await self.all(turn_id)).items() if a.state == "pending"}

    async def all(self, turn_id: str) -> dict[str, Approval]:
        """Every call of the turn that asked for approval, waiting or decided, by call key."""
        key = self.keys.approval(turn_id)
        with translated(f"read approvals {turn_id}"):
            raw = await self.client.hgetall(key)
        return dict(sorted((text(k), _read(f"{key}#{text(k)}", v)) for k, v in raw.items()))


def _now_ms() -> int:
    return int(time.time() * 1000)
