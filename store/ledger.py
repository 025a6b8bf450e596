"""The tool ledger: a journal of every tool call so a resumed turn never re-runs a finished one.

Each call is journaled under a stable key derived from (turn, batch, tool name, canonical args):
``prepared -> dispatched -> committed | failed | outcome_unknown``. ``prepared -> dispatched`` is
fenced on the owner's epoch and taken once: a batch's new calls are claimed in one script
(``ledger_claim.lua``: journal and fenced step together), a call already journaled by a
compare-and-set on the bytes read (``ledger_cas.lua``); only the winner runs the call. On resume a
``committed`` (or ``failed``) entry is reused as is; a ``dispatched`` entry means the call was in
flight when its host died, and is re-run only if the tool is idempotent, otherwise reported to
the model as ``outcome_unknown``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

from bus.errors import StaleOwner, StoreError
from bus.messages import ToolCall
from store.batcher import ScriptCalls
from store.codec import pack_model, unpack_model
from store.connection import StoreClient
from store.failures import reading, translated
from store.keys import KeyLayout
from store.lua import lua_script
from store.records import LedgerEntry
from store.replies import raw as raw_bytes
from store.replies import text


def call_key(turn_id: str, batch: int, call: ToolCall, index: int) -> str:
    """Stable idempotency key of one call; tools get it to deduplicate downstream effects.

    ``index`` (position in the batch) keeps two identical calls in one batch distinct.
    """
    name, canonical = call.name, call.arguments_json()
    digest = hashlib.sha256(f"{turn_id}\x1f{batch}\x1f{index}\x1f{name}\x1f{canonical}".encode())
    return f"{batch}.{index}.{digest.hexdigest()[:24]}"


@dataclass(frozen=True, slots=True)
class LedgerRead:
    """A ledger entry as read, with its stored bytes: the expected value of the next
    compare-and-set (:meth:`ToolLedger.transition`) on that call."""

    entry: LedgerEntry
    """The decoded entry."""
    raw: bytes
    """Exactly what Redis holds for it."""


@dataclass(frozen=True, slots=True)
class Claim:
    """One call of a batch as its owner claims it (:meth:`ToolLedger.claim`)."""

    call_key: str
    """The call's ledger key."""
    prepared: bytes
    """Its ``prepared`` entry: journaled even if the claim is fenced."""
    decided: bytes
    """The entry the owner decided for the call if the ledger does not hold it yet:
    ``dispatched`` to run it, or its settled result (an unknown tool, a denied call)."""


@dataclass(frozen=True, slots=True)
class Change:
    """One compare-and-set of a ledger entry: from the bytes read to a new entry."""

    expected: bytes
    """The entry's stored bytes when it was read (:attr:`LedgerRead.raw`)."""
    entry: LedgerEntry
    """What it becomes."""


class Ledger(Protocol):
    """What a tool batch needs of a ledger (:class:`ToolLedger`; ``store.memory`` has the
    Redis-free one the bench compares against)."""

    async def get_many(self, turn_id: str, call_keys: list[str]) -> dict[str, LedgerRead]: ...
    async def claim(
        self, turn_id: str, epoch: int, claims: list[Claim]
    ) -> dict[str, LedgerRead | None]: ...
    async def transition(
        self, turn_id: str, changes: dict[str, Change], *, epoch: int | None
    ) -> dict[str, bool]: ...


class ToolLedger:
    """Ledger entries of all turns, one Redis hash per turn.

    Every state change after ``prepared`` is a compare-and-set on the bytes read
    (``store/lua/ledger_cas.lua``); the ones a turn's owner decides (``dispatched``, and settling
    a call it will not run) are also fenced on the owner's epoch, so a fenced incarnation can
    dispatch nothing and two racing owners can never both dispatch one call.
    """

    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys
        self._cas = client.register_script(lua_script("ledger_cas.lua"))
        self._claim = client.register_script(lua_script("ledger_claim.lua"))
        self.scripts = ScriptCalls(client)
        """Where the claims and compare-and-sets of this process's concurrent turns share
        pipelines."""

    async def entries(self, turn_id: str) -> dict[str, LedgerEntry]:
        """Every journaled call of a turn (a bad entry raises RecordError: never guess)."""
        key = self.keys.tools(turn_id)
        with reading(key, f"read ledger {turn_id}"):
            raw = await self.client.hgetall(key)
        return {text(k): self._decode(key, text(k), raw_bytes(v)) for k, v in raw.items()}

    async def get_many(self, turn_id: str, call_keys: list[str]) -> dict[str, LedgerRead]:
        """Entries of the given calls that exist, with their stored bytes."""
        if not call_keys:
            return {}
        key = self.keys.tools(turn_id)
        with reading(key, f"read ledger {turn_id}"):
            raw = await self.client.hmget(key, call_keys)
        return {
            k: self._read(key, k, raw_bytes(v))
            for k, v in zip(call_keys, raw, strict=True)
            if v is not None
        }

    async def claim(
        self, turn_id: str, epoch: int, claims: list[Claim]
    ) -> dict[str, LedgerRead | None]:
        """Claim a batch in one round trip (``store/lua/ledger_claim.lua``): each call the
        ledger does not hold gets its decided entry (None in the answer: the caller won it);
        each call it holds comes back as read, for the caller to decide from
        (:meth:`transition`). :class:`StaleOwner` unless the record's stored epoch is
        ``epoch``; then only ``prepared`` entries were journaled."""
        if not claims:
            return {}
        args: list[bytes | str | int] = [epoch]
        for c in claims:
            args += (c.call_key, c.prepared, c.decided)
        key = self.keys.tools(turn_id)
        keys = [self.keys.turn(turn_id), key]
        with reading(key, f"claim a batch of {turn_id}"):
            reply = await self.scripts.call(self._claim, keys, args)
        status = text(reply[0]) if isinstance(reply, list) and reply else ""
        if status == "fenced":
            raise self._fenced(turn_id, epoch, reply)
        if status != "ok" or len(reply) != len(claims) + 1:
            raise StoreError(f"ledger claim of {turn_id}: unexpected reply {reply!r:.80}")
        return {
            c.call_key: None if won == 1 else self._read(key, c.call_key, raw_bytes(won))
            for c, won in zip(claims, reply[1:], strict=True)
        }

    @classmethod
    def _read(cls, key: str, field: str, raw: bytes) -> LedgerRead:
        return LedgerRead(cls._decode(key, field, raw), raw)

    @staticmethod
    def _fenced(turn_id: str, epoch: int | None, reply: list[Any]) -> StaleOwner:
        stored = text(reply[1]) if len(reply) > 1 else ""
        return StaleOwner(
            f"turn {turn_id}: epoch {epoch} may not dispatch, the record's epoch is "
            f"{stored or 'gone'}"
        )

    @staticmethod
    def _decode(key: str, field: str, raw: bytes) -> LedgerEntry:
        return unpack_model(LedgerEntry, raw, key=f"{key}#{field}")

    async def transition(
        self, turn_id: str, changes: dict[str, Change], *, epoch: int | None
    ) -> dict[str, bool]:
        """Apply compare-and-sets in one script; True for each call whose entry now is the new
        one, False where another writer changed it first (re-read it to see what won).

        With ``epoch`` the whole step is fenced: :class:`StaleOwner` unless the record's stored
        epoch is ``epoch``, and then nothing is written. ``None`` is for the outcome of a call
        this process dispatched, which is true whoever owns the turn now.
        """
        if not changes:
            return {}
        args: list[bytes | str | int] = ["" if epoch is None else epoch]
        for call_key_, change in changes.items():
            args += (call_key_, change.expected, pack_model(change.entry))
        with translated(f"write ledger {turn_id}"):
            reply = await self.scripts.call(
                self._cas, [self.keys.turn(turn_id), self.keys.tools(turn_id)], args
            )
        status = text(reply[0]) if isinstance(reply, list) and reply else ""
        if status == "fenced":
            raise self._fenced(turn_id, epoch, reply)
        if status != "ok" or len(reply) != len(changes) + 1:
            raise StoreError(f"ledger write of {turn_id}: unexpected reply {reply!r:.80}")
        return {k: int(won) == 1 for k, won in zip(changes, reply[1:], strict=True)}
