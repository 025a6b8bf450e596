"""How long a finished turn's data lives, and purging it sooner.

A turn's keys (``store.keys``: record, bodies, spec, ledger, effects, inbox, approvals) never
expired before: 34-50 KB per finished turn, for ever. With ``[retention] finished_ttl_s`` set,
the save that ends a turn (``store/lua/checkpoint_save.lua``) sets that time to live on all of
them and on its session's hash, in the same atomic step as the final record, and trims the
shard's turns index of turns submitted longer ago: nothing of the turn outlives the rest. Its
live stream (what a watcher saw: text, tool arguments and results) gets the same time to live,
and an event published after the final save (the buffered publisher may send the last ones
later) never gives it longer than its record has left (``store/lua/events_publish.lua``). A
suspended turn is not finished and keeps its keys; the shard-wide streams keep their length
caps. A session's hash is made persistent again when its next turn opens
(``store.domain.sessions``), so a running session never expires under its turn.

``phaseline purge`` removes finished turns now (``purge_turn.lua``: only a record that is not
in progress, with every key of the turn and its index entry, in one step).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from store.codec import EncodedRecord
from store.keys import KeyLayout
from store.lua import lua_script
from store.records import CheckpointRecord
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import answer

__all__ = ["Retention", "TurnPurger"]


@dataclass(frozen=True, slots=True)
class Retention:
    """What a store keeps of finished turns."""

    finished_ttl_s: float = 0.0
    """Seconds every key of a finished turn lives after its final save; 0: for ever."""

    def ttl_ms_of(self, record: CheckpointRecord | EncodedRecord) -> int:
        """The time to live the save of ``record`` sets (0: none): only a save that ends the
        turn, and not a suspension."""
        if self.finished_ttl_s <= 0 or record.in_progress:
            return 0
        counters = record.counters if isinstance(record, CheckpointRecord) else record.counters()
        if counters.outcome is not None and counters.outcome.suspended:
            return 0
        return max(1, int(self.finished_ttl_s * 1000))


class PurgeAnswer(IntEnum):
    """What ``purge_turn.lua`` answers."""

    KEPT = 0
    """Nothing deleted: the turn is in progress (running or resumable) or not there."""
    PURGED = 1
    """Every key of the turn and its index entry deleted."""


class TurnPurger:
    """Removes finished turns now (``phaseline purge``)."""

    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys
        self._purge = client.register_script(lua_script("purge_turn.lua"))

    async def purge(self, turn_id: str) -> bool:
        """Delete every key of a turn that is not in progress, and its index entry; False
        (nothing deleted) if it is in progress or gone."""
        k = self.keys
        keys = [
            k.turn(turn_id),
            k.bodies(turn_id),
            k.spec(turn_id),
            k.tools(turn_id),
            k.effects(turn_id),
            k.inbox(turn_id),
            k.approval(turn_id),
            k.live(turn_id),
            k.response(turn_id),
            k.turns_of(turn_id),
        ]
        with translated(f"purge turn {turn_id}"):
            reply = await self._purge(keys=keys, args=[turn_id])
        return answer(PurgeAnswer, reply, f"purge turn {turn_id}") is PurgeAnswer.PURGED
