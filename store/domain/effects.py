"""Side-effect counters: the observable effect of the non-idempotent ``counter_increment`` tool.

One counter per call key, so anyone can check from outside that a non-idempotent call ran at
most once (a value above 1 is a duplicated side effect). The scripted model's ``random`` replies
count there too, one counter per request it answered (``model:<digest of the transcript>``): a
value above 1 is a complete reply paid for again after a crash.
"""

from __future__ import annotations

import uuid

from store.keys import KeyLayout
from store.lua import lua_script
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text

#: Field prefix of the model's counters in a turn's effects hash (``<prefix><digest>``).
MODEL_REPLY_PREFIX = "model:"


class EffectCounters:
    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys
        self._increment = client.register_script(lua_script("effect_increment.lua"))

    async def increment(self, turn_id: str, call_key: str) -> int:
        """Perform the side effect once per call of this method, however often the client
        resends the command; returns how many times this call key has now run."""
        run = uuid.uuid4().hex
        with translated(f"increment effect {turn_id}"):
            reply = await self._increment(keys=[self.keys.effects(turn_id)], args=[call_key, run])
        return int(reply)

    async def counts(self, turn_id: str) -> dict[str, int]:
        """Runs per call key (the ``#`` run markers and the model's counters left out)."""
        return {
            k: n
            for k, n in (await self._all(turn_id)).items()
            if not k.startswith(MODEL_REPLY_PREFIX)
        }

    async def replies(self, turn_id: str) -> dict[str, int]:
        """Complete replies the scripted model gave per request of the turn (by the digest of
        the transcript it answered)."""
        n = len(MODEL_REPLY_PREFIX)
        return {
            k[n:]: v
            for k, v in (await self._all(turn_id)).items()
            if k.startswith(MODEL_REPLY_PREFIX)
        }

    async def _all(self, turn_id: str) -> dict[str, int]:
        with translated(f"read effects {turn_id}"):
            raw = await self.client.hgetall(self.keys.effects(turn_id))
        return {text(k): int(v) for k, v in raw.items() if not text(k).startswith("#")}
