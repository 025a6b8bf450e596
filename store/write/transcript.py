"""Content-addressed transcripts (record schema 2): every entry is stored once, under its digest.

Schema 1 wrote the whole transcript into the record at every save, so a turn of N messages
wrote O(N) bytes per save and O(N^2) over its life. Schema 2 keeps DESIGN's rule (every save
rebuilds the record from the loop's canonical list, never a diff) and makes the rebuilt record
small: it names the entries by digest, and a save writes only the bodies the store lacks.

Layout of one turn (keys in :mod:`store.keys`)::

    record hash  turn:<id>    chunks  digests of the full chunks, concatenated (16 bytes each)
                              tail    digests of the entries after them (fewer than CHUNK)
                              length  number of entries
    bodies hash  bodies:<id>  <entry digest> -> msgpack [message, meta]
                              <chunk digest> -> CHUNK entry digests, concatenated

An *entry* is one message with its meta: both are fixed when the message enters the transcript,
so they are stored together and the record carries neither. The digest list itself would grow
by 16 bytes per message and save, so runs of CHUNK digests become bodies too: the record holds
at most ``N / CHUNK + CHUNK`` digests, and a full chunk is written once, when it fills.

**Reclaim.** A body is dropped by the save whose record stops referencing it, in the same
fenced step (the save script): entries a compaction cut, chunks whose run changed. Which bodies
to drop the writer knows from :class:`KnownBodies`: the digests of its last acknowledged save.
Why nothing needed is ever lost:

* a save drops only digests its own record does not reference, so the record it leaves behind
  is whole, whatever the writer believed;
* the fence runs before any body is written or dropped, so a refused save (a zombie's late
  write, a replay) changes nothing;
* a save in delta mode (new bodies only) is sent only by the writer whose acknowledged save is
  the stored record: a save that fails its fence writes nothing, one whose outcome is unknown,
  a new epoch (a resume's claim), or a writer with no memory of the turn send every body and
  replace the bodies hash, which also sweeps anything a crashed writer left behind.

So after every save that lands, the bodies hash holds exactly the record's references: a turn
keeps one copy of its transcript, never one per checkpoint.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
from pydantic import TypeAdapter

from bus.messages import Message
from store.msgpack_wire import pack, unpack
from store.records import MessageMeta

__all__ = [
    "CHUNK",
    "DIGEST_BYTES",
    "MESSAGES",
    "METAS",
    "Body",
    "KnownBodies",
    "Plan",
    "Transcript",
    "digest",
    "split_digests",
    "unpack_entries",
]

#: Bytes of one digest (BLAKE2b-128): collisions within one turn's bodies are not a concern.
DIGEST_BYTES = 16
#: Entry digests per chunk body: a 500-message record names 15 chunks and 20 entries.
CHUNK = 32

# Whole lists in one pydantic-core call each: per-message model calls were a third of a save's
# CPU in ``phaseline bench``.
MESSAGES = TypeAdapter(tuple[Message, ...])
METAS = TypeAdapter(tuple[MessageMeta, ...])
_HEADERS = msgpack.Packer()


def digest(data: bytes) -> bytes:
    """The address of a body."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def split_digests(blob: bytes) -> list[bytes]:
    """Concatenated digests back to a list; ``ValueError`` when the length is not a multiple."""
    if len(blob) % DIGEST_BYTES:
        raise ValueError(f"{len(blob)} bytes is not a whole number of {DIGEST_BYTES}-byte digests")
    return [blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES)]


@dataclass(frozen=True, slots=True)
class Body:
    """One stored body and its address."""

    digest: bytes
    """BLAKE2b-128 of :attr:`data`."""
    data: bytes
    """What the bodies hash holds under the digest."""


@dataclass(frozen=True, slots=True)
class Transcript:
    """A transcript in its schema-2 form: what the record names and every body it names."""

    chunks: bytes
    """Digests of the full chunks, concatenated (the record's ``chunks`` field)."""
    tail: bytes
    """Digests of the entries after the last full chunk (the record's ``tail`` field)."""
    length: int
    """Number of entries."""
    bodies: dict[bytes, bytes]
    """Every body the record references (entries and chunks), by digest."""

    @property
    def nbytes(self) -> int:
        """Bytes of the bodies: what the transcript weighs in Redis, stored once."""
        return sum(len(b) for b in self.bodies.values())

    @classmethod
    def of(cls, messages: Sequence[Message], meta: Sequence[MessageMeta]) -> Transcript:
        entries = _ENTRIES.bodies(messages, meta)
        bodies = {b.digest: b.data for b in entries}
        digests = [b.digest for b in entries]
        full = len(digests) - len(digests) % CHUNK
        chunks = []
        for start in range(0, full, CHUNK):
            data = b"".join(digests[start : start + CHUNK])
            address = digest(data)
            bodies[address] = data
            chunks.append(address)
        return cls(b"".join(chunks), b"".join(digests[full:]), len(digests), bodies)


def unpack_entries(
    chunks: bytes, tail: bytes, length: int, found: dict[bytes, bytes]
) -> tuple[tuple[Message, ...], tuple[MessageMeta, ...]]:
    """Messages and meta from a record's digest fields and the bodies read for it.

    Every body is checked against its digest, so a body that is missing, truncated or
    swapped is a ``ValueError`` (the caller quarantines the record), never a wrong transcript.
    """
    digests: list[bytes] = []
    for address in split_digests(chunks):
        digests += split_digests(_verified(address, found))
    digests += split_digests(tail)
    if len(digests) != length:
        raise ValueError(f"record names {len(digests)} entries, its length says {length}")
    pairs = [unpack(_verified(d, found)) for d in digests]
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError("an entry body is not a [message, meta] pair")
    return (
        MESSAGES.validate_python([p[0] for p in pairs]),
        METAS.validate_python([p[1] for p in pairs]),
    )


def _verified(address: bytes, found: dict[bytes, bytes]) -> bytes:
    data = found.get(address)
    if data is None:
        raise ValueError(f"body {address.hex()} is missing")
    if digest(data) != address:
        raise ValueError(f"body {address.hex()} does not match its digest")
    return data


class _EntryMemo:
    """Entry bodies remembered per live (message, meta) pair.

    Every save rebuilds the whole list, but between two saves of a turn only the new entries
    differ and entries are frozen, so each is packed and hashed once and reused while it lives.
    Keyed by identity with weak references (entries hold dicts, so they are not hashable, and
    equality would compare whole payloads); an entry leaves the memo when its message does.
    Packing every transcript again at each save was most of a host's CPU (``phaseline bench``).
    """

    def __init__(self) -> None:
        self._memo: dict[int, tuple[weakref.ref[Message], weakref.ref[MessageMeta], Body]] = {}

    def bodies(self, messages: Sequence[Message], meta: Sequence[MessageMeta]) -> list[Body]:
        out: list[Body | None] = []
        missing: list[int] = []
        for i, (message, m) in enumerate(zip(messages, meta, strict=True)):
            hit = self._memo.get(id(message))
            if hit is not None and hit[0]() is message and hit[1]() is m:
                out.append(hit[2])
            else:
                out.append(None)
                missing.append(i)
        if missing:
            dumped_messages = MESSAGES.dump_python(
                tuple(messages[i] for i in missing), mode="json", exclude_defaults=True
            )
            dumped_meta = METAS.dump_python(
                tuple(meta[i] for i in missing), mode="json", exclude_defaults=True
            )
            for i, dm, dmeta in zip(missing, dumped_messages, dumped_meta, strict=True):
                data = _HEADERS.pack_array_header(2) + pack(dm) + pack(dmeta)
                out[i] = self._remember(messages[i], meta[i], Body(digest(data), data))
        return [b for b in out if b is not None]

    def __len__(self) -> int:
        return len(self._memo)

    def _remember(self, message: Message, meta: MessageMeta, body: Body) -> Body:
        key = id(message)
        self._memo[key] = (
            weakref.ref(message, lambda _ref: self._memo.pop(key, None)),
            weakref.ref(meta),
            body,
        )
        return body


_ENTRIES = _EntryMemo()


class KnownBodies:
    """What one writer knows the store holds for each turn it saves, so a save sends only
    new bodies and drops only what its record stopped referencing (see the module docstring).

    A turn it has no entry for (never saved here, a new epoch, a save whose outcome is
    unknown) is saved in replace mode. Entries are capped (least recently saved go first):
    forgetting a turn costs one full save, never correctness.
    """

    def __init__(self, max_turns: int = 100_000) -> None:
        self.max_turns = max_turns
        # turn -> (epoch, seq, digests) of its last acknowledged save; the save in flight.
        self._turns: OrderedDict[str, tuple[int, int, frozenset[bytes]]] = OrderedDict()
        self._pending: dict[str, tuple[int, int, frozenset[bytes]]] = {}

    def plan(self, turn_id: str, epoch: int, seq: int, transcript: Transcript) -> Plan:
        """What a save of ``transcript`` at (epoch, seq) must write and drop."""
        refs = frozenset(transcript.bodies)
        self._pending[turn_id] = (epoch, seq, refs)
        known = self._turns.get(turn_id)
        if known is None or known[0] != epoch:
            return Plan(dict(transcript.bodies), (), replace=True)
        stored = known[2]
        puts = {d: b for d, b in transcript.bodies.items() if d not in stored}
        return Plan(puts, tuple(stored - refs), replace=False)

    def settle(self, turn_id: str, seq: int, *, landed: bool | None, in_progress: bool) -> None:
        """Record how the save of ``seq`` ended: landed (acked or already stored), refused
        (False), or unknown (None: sent, no answer)."""
        pending = self._pending.pop(turn_id, None)
        if pending is None or pending[1] != seq:
            self._turns.pop(turn_id, None)
            return
        if landed and in_progress:
            self._turns[turn_id] = pending
            self._turns.move_to_end(turn_id)
            while len(self._turns) > self.max_turns:
                self._turns.popitem(last=False)
        else:
            # Unknown: the next save replaces. Refused: the turn is fenced (or this was a
            # stale resend). Final: nothing follows.
            self._turns.pop(turn_id, None)

    def __len__(self) -> int:
        return len(self._turns)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one save does to the turn's bodies hash."""

    puts: dict[bytes, bytes]
    """Bodies to write (digest -> body); writing one the store has is a no-op."""
    drops: tuple[bytes, ...]
    """Digests the record no longer references."""
    replace: bool
    """The bodies hash is emptied first: the writer does not know what it holds."""
