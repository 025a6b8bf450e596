"""The fenced save's contract on the Python side (``store/lua/checkpoint_save.lua``): one save
as a typed value (:class:`SaveCall`: its keys by what each holds, :class:`SaveKeys`, and its
arguments by concern), the KEYS and ARGV built from it in one place, the statuses it answers
with (:class:`SaveStatus`), and the one place a status becomes an ack or a typed refusal.

The ``multi_exec`` path (:mod:`store.write.transaction`) answers in the same shape, with the same
statuses, so every save, however made, is read back here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass
from enum import StrEnum

from bus.errors import AlreadySaved, RecordError, StaleOwner, StoreError, TurnExists
from store.codec import EncodedRecord
from store.domain.retention import Retention
from store.domain.usage import Tally
from store.keys import KeyLayout
from store.lua import lua_script
from store.records import SaveAck
from store.redis.replies import text

__all__ = [
    "REPLAYED",
    "SAVE_LUA",
    "SaveCall",
    "SaveKeys",
    "SaveStatus",
    "fence",
    "save_answer",
]

SAVE_LUA = lua_script("checkpoint_save.lua")

#: ``SaveAck.event_id`` of a save that had already landed (its event id is not re-read).
REPLAYED = "replayed"


class SaveStatus(StrEnum):
    """The first element of the save script's answer."""

    OK = "ok"
    """Saved; the answer's second element is the checkpoint event's id, its third the
    length of the turn's inbox."""
    EXISTS = "exists"
    """A submission whose record or spec is already there (:class:`TurnExists`)."""
    UNREADABLE = "unreadable"
    """The stored epoch or seq is no number (:class:`RecordError`: quarantine it)."""
    STALE_EPOCH = "stale_epoch"
    """A newer owner holds the turn (:class:`StaleOwner`)."""
    ALREADY = "already"
    """This very record is stored: a replay of a save that landed (:class:`AlreadySaved`)."""
    STALE_SEQ = "stale_seq"
    """The stored seq is not older, and the stored record is another
    (:class:`StaleOwner`)."""


def fence(
    stored: Sequence[bytes | None], epoch: int, seq: int, *, same: bool
) -> list[bytes | str] | None:
    """The save script's fence in Python (the ``multi_exec`` path and the in-memory store use
    it): None if a save at (epoch, seq) may land over the stored ``[epoch, seq]``, else the
    script's refusal (``[status, epoch, seq]``). ``same``: the stored record is this save's,
    field for field (only then is an equal (epoch, seq) a replay; otherwise it is a rival's
    record and the save is stale)."""
    e_raw, s_raw = stored
    if e_raw is None and s_raw is None:
        return None
    shown: list[bytes | str] = [e_raw or b"", s_raw or b""]
    try:
        e, s = int(e_raw or b""), int(s_raw or b"")
    except ValueError:
        return [SaveStatus.UNREADABLE, *shown]
    if e > epoch:
        return [SaveStatus.STALE_EPOCH, *shown]
    if e == epoch and s == seq and same:
        return [SaveStatus.ALREADY, *shown]
    if seq <= s:
        return [SaveStatus.STALE_SEQ, *shown]
    return None


@dataclass(frozen=True, slots=True)
class SaveKeys:
    """The keys one save touches, by what each holds, in the script's KEYS order. Every one
    shares the turn's hash tag (one Redis Cluster slot)."""

    record: str
    """The turn's record hash."""
    bodies: str
    """Its message bodies, by digest."""
    events: str
    """The shard's events stream (one entry per save)."""
    in_progress: str
    """The shard's set of turns in progress."""
    usage: str
    """The shard's counters (tokens per agent, outcomes, fenced writes: ``store.domain.usage``)."""
    spec: str
    """The turn's spec (written by a submission)."""
    ledger: str
    """The turn's tool ledger (the save's settles land there)."""
    effects: str
    """The built-in tools' side-effect counters of the turn."""
    inbox: str
    """The turn's inbox (its length comes back with the ack)."""
    approvals: str
    """The turn's approval decisions."""
    session: str
    """Its session's hash (the record's key again for a turn of no session, so the count of
    KEYS stays fixed)."""
    live: str
    """Its live stream (what watchers read)."""
    response: str
    """The provider's id of its model call in flight (``store.domain.responses``)."""
    turns: str
    """The shard's index of turns by update time."""
    phases: str
    """The shard's in-progress turns per phase."""

    @classmethod
    def of(cls, keys: KeyLayout, turn_id: str) -> SaveKeys:
        session = turn_id.partition("/")[0] if "/" in turn_id else None
        return cls(
            record=keys.turn(turn_id),
            bodies=keys.bodies(turn_id),
            events=keys.events_of(turn_id),
            in_progress=keys.in_progress_of(turn_id),
            usage=keys.usage_of(turn_id),
            spec=keys.spec(turn_id),
            ledger=keys.tools(turn_id),
            effects=keys.effects(turn_id),
            inbox=keys.inbox(turn_id),
            approvals=keys.approval(turn_id),
            session=keys.session(session) if session is not None else keys.turn(turn_id),
            live=keys.live(turn_id),
            response=keys.response(turn_id),
            turns=keys.turns_of(turn_id),
            phases=keys.phases_of(turn_id),
        )

    def ordered(self) -> list[str]:
        """The script's KEYS."""
        return list(astuple(self))

    def kept(self) -> tuple[str, ...]:
        """What a finished turn leaves, each given the retention's time to live by its final
        save (``store.domain.retention``)."""
        return (
            self.record,
            self.bodies,
            self.spec,
            self.ledger,
            self.effects,
            self.inbox,
            self.approvals,
            self.session,
            self.live,
            self.response,
        )


@dataclass(frozen=True, slots=True)
class SaveCall:
    """One fenced save, as the script takes it and the ``multi_exec`` path replays it."""

    keys: SaveKeys
    """The keys it touches."""
    record: EncodedRecord
    """The record, encoded: its fields, the bodies to put and drop, the settles it carries."""
    spec: bytes
    """The turn's spec for a submission (the save then refuses a turn that exists), else
    empty."""
    events_maxlen: int
    """The events stream's approximate cap."""
    tally: Tally
    """What a save that ends the turn adds to the shard's counters."""
    ttl_ms: int
    """The time to live a save that ends the turn gives its keys (0: none)."""

    @classmethod
    def of(
        cls,
        keys: KeyLayout,
        record: EncodedRecord,
        spec: tuple[str, bytes] | None,
        *,
        events_maxlen: int,
        retention: Retention,
    ) -> SaveCall:
        return cls(
            keys=SaveKeys.of(keys, record.turn_id),
            record=record,
            spec=b"" if spec is None else spec[1],
            events_maxlen=events_maxlen,
            tally=Tally.of(record),
            ttl_ms=retention.ttl_ms_of(record),
        )

    def argv(self) -> list[bytes | str | int]:
        """The script's ARGV (its contract is on top of the script)."""
        r = self.record
        args: list[bytes | str | int] = [
            r.epoch,
            r.seq,
            r.turn_id,
            r.phase,
            r.reason,
            int(r.in_progress),
            self.events_maxlen,
            self.spec,
            int(r.replace),
            len(r.puts),
            len(r.drops),
            *self.tally.argv(),
            self.ttl_ms,
            len(r.settles),
        ]
        for settle in r.settles:
            args += (settle.call_key, settle.dispatched, settle.settled)
        for address, body in r.puts.items():
            args += (address, body)
        args += r.drops
        for name, value in r.fields.items():
            args += (name, value)
        return args

    def script_args(self) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and ARGV, as ``EVAL``/``EVALSHA`` take them."""
        return self.keys.ordered(), self.argv()


def save_answer(record: EncodedRecord, turn_key: str, reply: object) -> SaveAck | StoreError:
    """One save's answer (the script's, or the ``multi_exec`` path's in its shape) as an ack
    or the typed refusal; ``turn_key`` names the record in a :class:`RecordError`."""
    turn = record.turn_id
    if isinstance(reply, Exception):
        return StoreError(f"save of {turn} failed in Redis: {reply}")
    if not isinstance(reply, list) or not reply:
        return StoreError(f"save of {turn}: unexpected reply {reply!r:.80}")
    word, *rest = (text(v) if isinstance(v, bytes | str) else str(v) for v in reply)
    try:
        status = SaveStatus(word)
    except ValueError:
        return StoreError(f"save of {turn}: unknown script answer {word!r}")
    if status is SaveStatus.OK:
        inbox = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else None
        return SaveAck(turn, record.epoch, record.seq, rest[0], inbox)
    if status is SaveStatus.EXISTS:
        return TurnExists(f"turn {turn} already exists")
    stored = f"stored epoch {rest[0]!r} seq {rest[1]!r}" if len(rest) == 2 else "?"
    if status is SaveStatus.UNREADABLE:
        return RecordError(turn_key, f"stored epoch/seq unreadable: {stored}")
    if status is SaveStatus.ALREADY:
        return AlreadySaved(f"turn {turn}: seq {record.seq} already stored, {stored}")
    if status is SaveStatus.STALE_EPOCH:
        return StaleOwner(f"turn {turn}: epoch {record.epoch} is stale, {stored}")
    return StaleOwner(f"turn {turn}: seq {record.seq} is not newer, {stored}")
