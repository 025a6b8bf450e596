"""The tool ledger: a journal of every tool call so a resumed turn never re-runs a finished one.

Each call is journaled under a stable key derived from (turn, batch, tool name, canonical args):
``prepared -> dispatched -> committed | failed``. On resume a ``committed`` (or ``failed``) entry
is reused as is; a ``dispatched`` entry means the call was in flight when its host died, and is
re-run only if the tool is idempotent, otherwise reported to the model as ``outcome_unknown``.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import redis.asyncio as aioredis

from store.codec import pack_model, unpack_model
from store.connection import raw as raw_bytes
from store.connection import text, translated
from store.keys import KeyLayout
from store.records import LedgerEntry, LedgerState, ToolResult


def call_key(turn_id: str, batch: int, name: str, args: dict[str, Any], index: int) -> str:
    """Stable idempotency key of one call; tools get it to deduplicate downstream effects.

    ``index`` (position in the batch) keeps two identical calls in one batch distinct.
    """
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(f"{turn_id}\x1f{batch}\x1f{index}\x1f{name}\x1f{canonical}".encode())
    return f"{batch}.{index}.{digest.hexdigest()[:24]}"


class ToolLedger:
    """Ledger entries of all turns, one Redis hash per turn."""

    def __init__(self, client: aioredis.Redis, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys

    async def entries(self, turn_id: str) -> dict[str, LedgerEntry]:
        """Every journaled call of a turn (a bad entry raises RecordError: never guess)."""
        key = self.keys.tools(turn_id)
        with translated(f"read ledger {turn_id}"):
            raw = await self.client.hgetall(key)
        return {text(k): self._decode(key, text(k), raw_bytes(v)) for k, v in raw.items()}

    async def get_many(self, turn_id: str, call_keys: list[str]) -> dict[str, LedgerEntry]:
        """Entries of the given calls that exist."""
        if not call_keys:
            return {}
        key = self.keys.tools(turn_id)
        with translated(f"read ledger {turn_id}"):
            raw = await self.client.hmget(key, call_keys)
        return {
            k: self._decode(key, k, raw_bytes(v))
            for k, v in zip(call_keys, raw, strict=True)
            if v is not None
        }

    async def prepare(self, turn_id: str, calls: list[tuple[str, str]]) -> dict[str, LedgerEntry]:
        """Journal ``prepared`` for each (call key, tool name) not yet in the ledger and return
        every call's entry (prior or just prepared), in one round trip (HSETNX + HMGET)."""
        if not calls:
            return {}
        key = self.keys.tools(turn_id)
        now = int(time.time() * 1000)
        with translated(f"prepare ledger {turn_id}"):
            async with self.client.pipeline(transaction=False) as pipe:
                for call_key_, name in calls:
                    entry = LedgerEntry(state="prepared", name=name, updated_at=now)
                    pipe.hsetnx(key, call_key_, pack_model(entry))
                pipe.hmget(key, [k for k, _ in calls])
                replies = await pipe.execute()
        return {
            k: self._decode(key, k, raw_bytes(v))
            for (k, _), v in zip(calls, replies[-1], strict=True)
        }

    @staticmethod
    def _decode(key: str, field: str, raw: bytes) -> LedgerEntry:
        return unpack_model(LedgerEntry, raw, key=f"{key}#{field}")

    async def mark(
        self,
        turn_id: str,
        states: dict[str, tuple[LedgerState, str, ToolResult | None]],
    ) -> None:
        """Write ``call key -> (state, tool name, result)`` for several calls in one round trip."""
        now = int(time.time() * 1000)
        mapping = {
            k: pack_model(LedgerEntry(state=state, name=name, result=result, updated_at=now))
            for k, (state, name, result) in states.items()
        }
        with translated(f"write ledger {turn_id}"):
            await self.client.hset(self.keys.tools(turn_id), mapping=mapping)  # type: ignore[arg-type]
