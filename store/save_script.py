"""The fenced save's contract on the Python side (``store/lua/checkpoint_save.lua``): the
KEYS and ARGV a save sends, the statuses it answers with (:class:`SaveStatus`), and the one
place a status becomes an ack or a typed refusal.

The ``multi_exec`` path (:mod:`store.transaction`) answers in the same shape, with the same
statuses, so every save, however made, is read back here.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from bus.errors import AlreadySaved, RecordError, StaleOwner, StoreError, TurnExists
from store.codec import EncodedRecord
from store.keys import KeyLayout
from store.lua import lua_script
from store.records import SaveAck
from store.replies import text
from store.retention import Retention, retained_keys
from store.usage import tally_args

__all__ = ["REPLAYED", "SAVE_LUA", "SaveStatus", "fence", "save_answer", "save_call"]

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


def save_call(
    keys: KeyLayout,
    record: EncodedRecord,
    spec: tuple[str, bytes] | None,
    *,
    events_maxlen: int,
    retention: Retention,
) -> tuple[list[str], list[bytes | str | int]]:
    """KEYS and ARGV of the save script (its contract is on top of the script)."""
    turn_id = record.turn_id
    key_list = [keys.turn(turn_id), keys.bodies(turn_id), keys.events_of(turn_id)]
    key_list += [keys.in_progress_of(turn_id), keys.usage_of(turn_id)]
    key_list += [*retained_keys(keys, turn_id), keys.turns_of(turn_id), keys.phases_of(turn_id)]
    args: list[bytes | str | int] = [
        record.epoch, record.seq, turn_id, record.phase, record.reason,
        int(record.in_progress), events_maxlen, b"" if spec is None else spec[1],
        int(record.replace), len(record.puts), len(record.drops), *tally_args(record),
        retention.ttl_ms_of(record), len(record.settles),
    ]  # fmt: skip
    for settle in record.settles:
        args += (settle.call_key, settle.dispatched, settle.settled)
    for address, body in record.puts.items():
        args += (address, body)
    args += record.drops
    for name, value in record.fields.items():
        args += (name, value)
    return key_list, args


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
