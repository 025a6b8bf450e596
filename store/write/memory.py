"""The store and ledger without Redis: what ``phaseline bench`` prices durability against.

:class:`MemoryCheckpoints` and :class:`MemoryLedger` keep the rules of their Redis twins (the
save fence, the ledger's compare-and-set fenced on the record's epoch, entries packed as
msgpack) in this process's memory, so a loop driven by them does all the work a durable loop
does except talking to Redis. Nothing survives the process: never use them to run turns.
"""

from __future__ import annotations

from collections.abc import Sequence

from bus.errors import StaleOwner
from store.codec import pack_model, unpack_model
from store.domain.ledger import Change, Claim, LedgerRead
from store.records import CheckpointRecord, InboxItem, LedgerEntry, SaveAck, Settle
from store.write.save_script import REPLAYED, SaveStatus, fence

__all__ = ["MemoryCheckpoints", "MemoryInbox", "MemoryLedger"]


class MemoryCheckpoints:
    """Fenced saves into a dict (a :class:`~actors.turn.loop.Checkpointer`)."""

    def __init__(self) -> None:
        self.records: dict[str, CheckpointRecord] = {}
        self.ledger: MemoryLedger | None = None
        """The ledger a save journals its settles in (the one made over these checkpoints)."""
        self._events = 0

    async def save(self, record: CheckpointRecord, settles: Sequence[Settle] = ()) -> SaveAck:
        if settles and self.ledger is not None:  # before the fence, as the script does
            await self.ledger.transition(
                record.turn_id,
                {s.call_key: Change(s.dispatched, _entry(s.settled)) for s in settles},
                epoch=None,
            )
        stored = self.records.get(record.turn_id)
        if stored is not None:
            fences = [str(stored.epoch).encode(), str(stored.seq).encode()]
            refusal = fence(fences, record.epoch, record.seq, same=stored == record)
            if refusal is not None and refusal[0] is SaveStatus.ALREADY:
                return SaveAck(record.turn_id, record.epoch, record.seq, REPLAYED)
            if refusal is not None:
                raise StaleOwner(
                    f"turn {record.turn_id}: {refusal[0]!s} (stored epoch {stored.epoch} seq "
                    f"{stored.seq})"
                )
        self.records[record.turn_id] = record
        self._events += 1
        return SaveAck(record.turn_id, record.epoch, record.seq, f"{self._events}-0", 0)


class MemoryLedger:
    """Ledger entries in dicts, with :class:`~store.domain.ledger.ToolLedger`'s compare-and-set."""

    def __init__(self, checkpoints: MemoryCheckpoints) -> None:
        self.checkpoints = checkpoints
        checkpoints.ledger = self
        self._turns: dict[str, dict[str, bytes]] = {}
        self.replies: dict[str, bytes] = {}
        """Each turn's journaled reply (``ToolLedger``'s reply field)."""

    async def get_many(self, turn_id: str, call_keys: list[str]) -> dict[str, LedgerRead]:
        held = self._turns.get(turn_id, {})
        return {k: self._read(turn_id, k, held[k]) for k in call_keys if k in held}

    async def claim(
        self, turn_id: str, epoch: int, claims: list[Claim], *, reply: bytes = b""
    ) -> dict[str, LedgerRead | None]:
        held = self._turns.setdefault(turn_id, {})
        if not self._owns(turn_id, epoch):
            for c in claims:
                held.setdefault(c.call_key, c.prepared)
            raise StaleOwner(f"turn {turn_id}: epoch {epoch} may not dispatch")
        if reply:
            self.replies[turn_id] = reply
        out: dict[str, LedgerRead | None] = {}
        for c in claims:
            if c.call_key in held:
                out[c.call_key] = self._read(turn_id, c.call_key, held[c.call_key])
            else:
                held[c.call_key] = c.decided
                out[c.call_key] = None
        return out

    def _owns(self, turn_id: str, epoch: int) -> bool:
        record = self.checkpoints.records.get(turn_id)
        return record is not None and record.epoch == epoch

    async def transition(
        self, turn_id: str, changes: dict[str, Change], *, epoch: int | None
    ) -> dict[str, bool]:
        if epoch is not None and not self._owns(turn_id, epoch):
            raise StaleOwner(f"turn {turn_id}: epoch {epoch} may not dispatch")
        held = self._turns.setdefault(turn_id, {})
        won: dict[str, bool] = {}
        for key, change in changes.items():
            new = pack_model(change.entry)
            won[key] = held.get(key) in (change.expected, new)  # the new one: a replay
            if won[key]:
                held[key] = new
        return won

    @staticmethod
    def _read(turn_id: str, key: str, raw: bytes) -> LedgerRead:
        return LedgerRead(unpack_model(LedgerEntry, raw, key=f"memory:{turn_id}#{key}"), raw)


def _entry(raw: bytes) -> LedgerEntry:
    return unpack_model(LedgerEntry, raw, key="memory settle")


class MemoryInbox:
    """An inbox nobody writes to."""

    async def read_from(self, turn_id: str, offset: int) -> list[InboxItem]:
        return []
