"""Following one turn live: its live stream (``store.views.streams``), ended by its final record.

A watcher reads the turn's capped live stream with ``XREAD BLOCK``. Events are advisory, so
the end of a turn is decided by the checkpoint record: when the stream is quiet and the record
is final, a :class:`~bus.events.Finished` is made from the record (it may have been trimmed,
expired, or dropped while Redis was away). A host crash shows up as a
:class:`~bus.events.Restarted` from the new owner; the text the dead owner streamed after its
last checkpoint was never saved and is not repeated.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from bus.events import BadBusEntry, Finished, WatchEvent, decode_event
from store.keys import KeyLayout, check_turn_id
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text
from store.redis.stream_reads import read_streams
from store.write.checkpoint import RedisCheckpointStore

log = logging.getLogger(__name__)


async def watch_turn(
    client: StoreClient,
    keys: KeyLayout,
    turn_id: str,
    *,
    from_start: bool = True,
    block_ms: int = 1000,
) -> AsyncIterator[WatchEvent]:
    """Yield the turn's events until it is final; :class:`Finished` is the last one.

    ``from_start`` replays what the stream still holds first (a reattaching watcher sees the
    turn so far); otherwise only what comes from now on. A turn that does not exist raises
    :class:`~bus.errors.RecordNotFound`. Malformed entries are logged and skipped."""
    after = "0-0" if from_start else None
    async for _entry_id, event in watch_entries(client, keys, turn_id, after, block_ms=block_ms):
        yield event


async def watch_entries(
    client: StoreClient,
    keys: KeyLayout,
    turn_id: str,
    after: str | None,
    *,
    block_ms: int = 1000,
) -> AsyncIterator[tuple[str, WatchEvent]]:
    """:func:`watch_turn` from just after the live stream's entry ``after`` (None: from its
    end now), each event with its entry id (where a reconnecting watcher goes on from; the
    :class:`Finished` made from the record when the stream has none carries the last id)."""
    store = RedisCheckpointStore(client, keys)
    key = keys.live(check_turn_id(turn_id))
    await store.load(turn_id)  # RecordNotFound for an unknown turn
    cursor = after or "0-0"
    if after is None:
        with translated(f"read the end of {key}"):
            last = await client.xrevrange(key, count=1)
        cursor = text(last[0][0] or "0-0") if last else "0-0"
    while True:
        quiet = True
        for _stream, entries in await read_streams(
            client, {key: cursor}, count=500, block_ms=block_ms
        ):
            for entry_id, fields in entries:
                cursor = entry_id
                quiet = False
                try:
                    event = decode_event(fields)
                except BadBusEntry as exc:
                    log.warning("watch %s: skipping entry %s: %s", turn_id, entry_id, exc)
                    continue
                yield cursor, event
                if isinstance(event, Finished):
                    return
        if quiet:
            record = await store.load(turn_id)
            if not record.in_progress:
                yield cursor, record.finished_event()
                return
