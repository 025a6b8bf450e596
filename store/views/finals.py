"""Waiting for turns to end: their final records, found from the shard event streams (every
save publishes one) and confirmed from the records, since streams are trimmed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from bus.errors import PhaselineError, RecordError, RecordNotFound, StoreError, StoreUnavailable
from store.records import CheckpointRecord
from store.redis.connection import StoreClient
from store.redis.replies import text
from store.redis.stream_reads import read_streams
from store.write.checkpoint import RedisCheckpointStore

__all__ = ["wait_final"]

log = logging.getLogger(__name__)

#: Seconds between confirmations from the records (events may have been trimmed).
SCAN_EVERY_S = 5.0


async def wait_final(
    client: StoreClient,
    store: RedisCheckpointStore,
    turn_ids: Iterable[str],
    *,
    timeout: float = 600.0,
    on_done: Callable[[str], None] | None = None,
    on_unusable: Callable[[str, StoreError], None] | None = None,
) -> dict[str, CheckpointRecord]:
    """Block until every turn's final record is stored; returns them. A turn whose record is
    unreadable (quarantined) or gone is not waited for: it is left out of the answer and
    reported to ``on_unusable`` (logged if there is none). Only a Redis that is away
    (:class:`StoreUnavailable`) is waited through; past ``timeout`` a
    :class:`PhaselineError` says how many turns still run."""
    waiting = set(turn_ids)
    done: dict[str, CheckpointRecord] = {}
    keys = store.keys
    cursors = {keys.events(s): "0-0" for s in keys.all_shards()}
    deadline = time.monotonic() + timeout
    last_scan = 0.0
    while waiting:
        now = time.monotonic()
        if now > deadline:
            raise PhaselineError(f"{len(waiting)} turns still running after {timeout:g} s")
        scan = now - last_scan > SCAN_EVERY_S
        if scan:
            last_scan = now
        try:
            finished = await _finished(client, store, waiting, cursors, scan=scan)
            for tid in finished:
                record = await _final(store, tid, waiting, on_unusable)
                if record is not None:
                    done[tid] = record
                    if on_done is not None:
                        on_done(tid)
        except StoreUnavailable as exc:  # Redis restarting: keep waiting
            log.warning("waiting through a Redis error: %s", exc)
            await asyncio.sleep(0.5)  # a pause before asking a restarting server again
    return done


async def _finished(
    client: StoreClient,
    store: RedisCheckpointStore,
    waiting: set[str],
    cursors: dict[str, str],
    *,
    scan: bool,
) -> set[str]:
    """Turns of ``waiting`` whose final save was published since ``cursors`` (moved on), and
    with ``scan`` those no longer in progress."""
    finished: set[str] = set()
    for stream, entries in await read_streams(client, cursors, count=5000, block_ms=500):
        for entry_id, fields in entries:
            cursors[stream] = entry_id
            tid = text(fields[b"turn_id"])
            if tid in waiting and fields[b"in_progress"] == b"0":
                finished.add(tid)
    if scan:
        finished |= waiting - set(await store.list_in_progress())
    return finished & waiting


async def _final(
    store: RedisCheckpointStore,
    tid: str,
    waiting: set[str],
    on_unusable: Callable[[str, StoreError], None] | None,
) -> CheckpointRecord | None:
    """The turn's final record (taken off ``waiting``), or None: still in progress, or
    unusable (taken off and reported)."""
    try:
        record = await store.load(tid)
    except (RecordError, RecordNotFound) as exc:
        waiting.discard(tid)
        log.error("turn %s cannot be waited for: %s", tid, exc)
        if on_unusable is not None:
            on_unusable(tid, exc)
        return None
    if record.in_progress:
        return None
    waiting.discard(tid)
    return record
