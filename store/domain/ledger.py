"""The tool ledger: a journal of every tool call so a resumed turn never re-runs a finished one.

Each call is journaled under a stable key derived from (turn, batch, tool name, canonical args):
``prepared -> dispatched -> committed | failed | outcome_unknown``. ``prepared -> dispatched`` is
fenced on the owner's epoch and taken once: a batch's new calls are claimed in one script
(``ledger_claim.lua``: journal and fenced step together), a call already journaled by a
compare-and-set on the bytes read (``ledger_cas.lua``); only the winner runs the call. On resume a
``committed`` (or ``failed``) entry is reused as is; a ``dispatched`` entry means the call was in
flight when its host died, and is re-run only if the tool is idempotent, otherwise reported to
the model as ``outcome_unknown``.

The claim also journals the model reply that asked for the batch (:class:`ReplyJournal`, in
the ledger hash under :data:`~store.keys.REPLY_FIELD`), in the same fenced step: no call of a
reply runs unless the reply is durable, so a resume continues from it instead of asking a model
that would answer differently (and call differently) the second time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from bus.errors import StaleOwner, StoreError
from bus.messages import ToolCall
from store.codec import pack_model, unpack_model
from store.keys import REPLY_FIELD, REPLY_REFUSED_FIELD, REPLY_REFUSED_WHY_FIELD, KeyLayout
from store.lua import lua_script
from store.records import LedgerEntry, ReplyJournal
from store.redis.batcher import ScriptCalls
from store.redis.connection import StoreClient
from store.redis.failures import reading, translated
from store.redis.replies import answer, text
from store.redis.replies import raw as raw_bytes


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


@dataclass(frozen=True, slots=True)
class LedgerView:
    """Everything a turn's ledger holds, read in one round trip (a resume plan's read)."""

    entries: dict[str, LedgerEntry]
    """Every journaled call, by call key."""
    reply: bytes | None
    """The journaled reply's stored bytes (None: none), decoded by :func:`decode_reply`."""


def decode_reply(turn_id: str, raw: bytes) -> ReplyJournal:
    """A journaled reply read back (:class:`~bus.errors.RecordError` if it does not decode)."""
    return unpack_model(ReplyJournal, raw, key=f"reply of {turn_id}")


class Ledger(Protocol):
    """What a tool batch needs of a ledger (:class:`ToolLedger`; ``store.write.memory`` has the
    Redis-free one the bench compares against)."""

    async def get_many(self, turn_id: str, call_keys: list[str]) -> dict[str, LedgerRead]: ...
    async def claim(
        self, turn_id: str, epoch: int, claims: list[Claim], *, reply: bytes = b""
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
        return (await self.read(turn_id)).entries

    async def read(self, turn_id: str) -> LedgerView:
        """Every journaled call of a turn and its journaled reply, in one read (a bad entry
        raises RecordError; the reply is left for the caller to decode and judge)."""
        key = self.keys.tools(turn_id)
        with reading(key, f"read ledger {turn_id}"):
            raw = await self.client.hgetall(key)
        entries: dict[str, LedgerEntry] = {}
        reply = None
        for k, v in raw.items():
            field = text(k)
            if field == REPLY_FIELD:
                reply = raw_bytes(v)
            elif not field.startswith(REPLY_FIELD):
                entries[field] = self._decode(key, field, raw_bytes(v))
        return LedgerView(entries, reply)

    async def refuse_reply(self, turn_id: str, raw: bytes, why: str) -> None:
        """Move a journaled reply a resume refused aside (kept, with why, in the same hash), so
        it is reported once and never continued from."""
        key = self.keys.tools(turn_id)
        with translated(f"set aside the reply of {turn_id}"):
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={REPLY_REFUSED_FIELD: raw, REPLY_REFUSED_WHY_FIELD: why})
                pipe.hdel(key, REPLY_FIELD)
                await pipe.execute()

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
        self, turn_id: str, epoch: int, claims: list[Claim], *, reply: bytes = b""
    ) -> dict[str, LedgerRead | None]:
        """Claim a batch in one round trip (``store/lua/ledger_claim.lua``): ``reply`` (a
        packed :class:`ReplyJournal`, or empty) is journaled first; each call the ledger does
        not hold gets its decided entry (None in the answer: the caller won it); each call it
        holds comes back as read, for the caller to decide from (:meth:`transition`).
        :class:`StaleOwner` unless the record's stored epoch is ``epoch``; then only
        ``prepared`` entries were journaled."""
        if not claims and not reply:
            return {}
        args: list[bytes | str | int] = [epoch, REPLY_FIELD, reply]
        for c in claims:
            args += (c.call_key, c.prepared, c.decided)
        key = self.keys.tools(turn_id)
        keys = [self.keys.turn(turn_id), key, self.keys.usage_of(turn_id)]
        with reading(key, f"claim a batch of {turn_id}"):
            answer = await self.scripts.call(self._claim, keys, args)
        per_call = _answered("claim", turn_id, epoch, answer, len(claims))
        return {
            c.call_key: None if won == 1 else self._read(key, c.call_key, raw_bytes(won))
            for c, won in zip(claims, per_call, strict=True)
        }

    @classmethod
    def _read(cls, key: str, field: str, raw: bytes) -> LedgerRead:
        return LedgerRead(cls._decode(key, field, raw), raw)

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
                self._cas,
                [self.keys.turn(turn_id), self.keys.tools(turn_id), self.keys.usage_of(turn_id)],
                args,
            )
        per_call = _answered("write", turn_id, epoch, reply, len(changes))
        return {k: int(won) == 1 for k, won in zip(changes, per_call, strict=True)}


class LedgerAnswer(StrEnum):
    """The first word of the answer of ``ledger_claim.lua`` and ``ledger_cas.lua``."""

    OK = "ok"
    """Applied: the rest of the answer says, per call, what became of it."""
    FENCED = "fenced"
    """Refused as a whole: the record's stored epoch (the answer's second element) is not
    the caller's (counted in the shard's usage hash: ``store.domain.usage``)."""


def _answered(what: str, turn_id: str, epoch: int | None, reply: object, calls: int) -> list[Any]:
    """The per-call part of a ledger script's answer: :class:`StaleOwner` for a fenced one,
    :class:`StoreError` for anything but ``calls`` answers after :attr:`LedgerAnswer.OK`."""
    word = answer(LedgerAnswer, reply, f"ledger {what} of {turn_id}")
    if word is LedgerAnswer.FENCED:
        assert isinstance(reply, list)
        stored = text(reply[1]) if len(reply) > 1 else ""
        raise StaleOwner(
            f"turn {turn_id}: epoch {epoch} may not dispatch, the record's epoch is "
            f"{stored or 'gone'}"
        )
    if not isinstance(reply, list) or len(reply) != calls + 1:
        raise StoreError(f"ledger {what} of {turn_id}: unexpected reply {reply!r:.80}")
    return reply[1:]
