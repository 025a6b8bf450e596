"""Durable per-turn inboxes of injected user messages.

An inbox is an append-only Redis list. The loop never deletes from it: the checkpoint records
how many entries the transcript already holds (``Counters.inbox_offset``), so after a crash the
entries past that offset are appended again after the restored transcript, exactly once.
"""

from __future__ import annotations

import time
import uuid

from store.codec import pack_model, unpack_model
from store.connection import StoreClient, translated
from store.connection import raw as raw_bytes
from store.keys import KeyLayout
from store.records import InboxItem


class Inbox:
    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys

    async def push(self, turn_id: str, text: str, *, message_id: str | None = None) -> InboxItem:
        item = InboxItem(
            message_id=message_id or uuid.uuid4().hex,
            text=text,
            at_ms=int(time.time() * 1000),
        )
        with translated(f"inject into {turn_id}"):
            await self.client.rpush(self.keys.inbox(turn_id), pack_model(item))
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
