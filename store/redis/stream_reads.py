"""Reading Redis Streams on one server or across a cluster's nodes."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text

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


async def read_range(
    client: StoreClient, stream: str, *, newest: int | None = None
) -> list[tuple[str, dict[bytes, bytes]]]:
    """Every entry of a stream (XRANGE - +), or its ``newest`` entries (in order), typed and
    translated."""
    with translated(f"read stream {stream}"):
        if newest is None:
            reply: Any = await client.xrange(stream)
        else:
            reply = list(reversed(await client.xrevrange(stream, count=newest) or []))
    return [(text(eid), fields) for eid, fields in reply or [] if fields is not None]
