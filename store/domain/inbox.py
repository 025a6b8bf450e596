"""Durable per-turn inboxes of injected user messages and cancel requests.

An inbox is an append-only Redis list. The loop never deletes from it: the checkpoint records
how many entries the transcript already holds (``Counters.inbox_offset``), so after a crash the
entries past that offset are appended again after the restored transcript, exactly once. A
cancel request is an entry too, so it is honoured by whichever incarnation reads it.

Only a turn in progress takes entries (``store/lua/inbox_push.lua`` checks its record and
appends in one step): an entry for a finished, suspended or unknown turn would never be read,
so it is refused with :class:`~bus.errors.TurnNotRunning`.
"""

from __future__ import annotations

import time
import uuid
from enum import IntEnum

from bus.errors import TurnNotRunning
from store.codec import pack_model, unpack_model
from store.keys import KeyLayout
from store.lua import lua_script
from store.records import InboxItem
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import answer
from store.redis.replies import raw as raw_bytes


class PushAnswer(IntEnum):
    """What ``inbox_push.lua`` answers."""

    NO_TURN = -1
    """There is no such turn (no record)."""
    NOT_RUNNING = 0
    """The turn is not in progress (finished or suspended): no incarnation would read it."""
    PUSHED = 1
    """Appended."""


class Inbox:
    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys
        self._push = client.register_script(lua_script("inbox_push.lua"))

    async def push(
        self,
        turn_id: str,
        text: str,
        *,
        message_id: str | None = None,
        cancel: bool = False,
        by: str = "",
    ) -> InboxItem:
        """Append a message (or, with ``cancel``, a cancel request whose ``text`` is its
        reason) to a turn in progress; :class:`TurnNotRunning` otherwise."""
        item = InboxItem(
            message_id=message_id or uuid.uuid4().hex,
            text=text,
            at_ms=int(time.time() * 1000),
            cancel=cancel,
            by=by,
        )
        keys = [self.keys.turn(turn_id), self.keys.inbox(turn_id)]
        with translated(f"inject into {turn_id}"):
            reply = await self._push(keys=keys, args=[pack_model(item)])
        pushed = answer(PushAnswer, reply, f"inject into {turn_id}")
        if pushed is PushAnswer.NO_TURN:
            raise TurnNotRunning(f"there is no turn {turn_id}", turn_id)
        if pushed is PushAnswer.NOT_RUNNING:
            raise TurnNotRunning(
                f"turn {turn_id} is not in progress (finished or suspended): nothing would read "
                "a message sent to it",
                turn_id,
            )
        return item

    async def read_from(self, turn_id: str, offset: int) -> list[InboxItem]:
        """Entries at ``offset`` and after, in arrival order."""
        key = self.keys.inbox(turn_id)
        with translated(f"read inbox {turn_id}"):
            raw = await self.client.lrange(key, offset, -1)
        return [
            unpack_model(InboxItem, raw_bytes(r), key=f"{key}[{offset + i}]")
            for i, r in enumerate(raw)
        ]
