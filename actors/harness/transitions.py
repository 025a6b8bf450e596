"""Reading phase transitions back from the bus, for reports (chaos recovery, bench recovery).

The bus streams are capped (``RedisBus`` maxlen), so this sees the recent past only; the
reports that use it read right after the runs they measure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from bus.events import BadBusEntry, decode_event
from bus.phase import Transition
from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.stream_reads import read_range

log = logging.getLogger(__name__)


async def read_moves(client: StoreClient, keys: KeyLayout) -> list[Transition]:
    """Every phase transition still in the bus streams, in time order (bad entries skipped)."""
    moves: list[Transition] = []
    for shard in keys.all_shards():
        for entry_id, fields in await read_range(client, keys.bus(shard)):
            try:
                event = decode_event(fields)
            except BadBusEntry as exc:
                log.warning("skipping bus entry %s: %s", entry_id, exc)
                continue
            if isinstance(event, Transition):
                moves.append(event)
    moves.sort(key=lambda t: t.at_ms)
    return moves


def first_moves_after(
    moves: Iterable[Transition], affected: Mapping[str, int], after_ms: float
) -> dict[str, Transition]:
    """For each affected turn (id -> epoch it had), its first move at or after ``after_ms``
    under a newer epoch: the moment a successor took it over. Turns without one are absent."""
    first: dict[str, Transition] = {}
    for t in moves:
        epoch = affected.get(t.turn_id)
        if epoch is None or t.turn_id in first or t.epoch <= epoch or t.at_ms < after_ms:
            continue
        first[t.turn_id] = t
    return first
