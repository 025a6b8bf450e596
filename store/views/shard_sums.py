"""Counters kept in one hash per key shard (token totals, outcome and phase counts), summed over
the shards: what the views read instead of the turns themselves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text

__all__ = ["summed"]


async def summed(
    client: StoreClient, keys: KeyLayout, key_of: Callable[[int], str], what: str
) -> Counter[str]:
    """Each field's integer value summed over every shard's hash ``key_of(shard)``, in one
    pipelined read (a field whose value is not an integer is left out)."""
    with translated(f"read {what}"):
        async with client.pipeline(transaction=False) as pipe:
            for shard in keys.all_shards():
                pipe.hgetall(key_of(shard))
            shards = await pipe.execute()
    total: Counter[str] = Counter()
    for fields in shards:
        for raw_field, raw_value in fields.items():
            value = text(raw_value)
            if value.lstrip("-").isdigit():
                total[text(raw_field)] += int(value)
    return total
