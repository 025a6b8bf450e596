"""msgpack <-> record conversion. Never pickle: every byte read from Redis is validated."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack
from pydantic import BaseModel, TypeAdapter, ValidationError

from bus.errors import RecordError, RecordTooLarge, UnknownSchema
from bus.phase import TurnPhase
from store.records import (
    MAX_FENCE,
    SCHEMA_VERSION,
    CheckpointRecord,
    Counters,
    Message,
    MessageMeta,
    SaveReason,
)

M = TypeVar("M", bound=BaseModel)
Item = TypeVar("Item", bound=BaseModel)

# Whole lists in one pydantic-core call each: per-message model calls were a third of a save's
# CPU in ``phaseline bench``.
_MESSAGES = TypeAdapter(tuple[Message, ...])
_METAS = TypeAdapter(tuple[MessageMeta, ...])

#: The hash fields of a checkpoint record; every save writes all of them.
RECORD_FIELDS = (
    "schema", "turn_id", "session_id", "epoch", "seq", "phase", "in_progress", "reason",
    "messages", "meta", "baseline", "counters", "updated_at",
)  # fmt: skip


def pack(value: Any) -> bytes:
    """msgpack with bin type, so bytes and str never get confused on the way back."""
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> Any:
    """Strict msgpack decode: str keys only, no ext types, no surprises."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def dump_model(model: BaseModel) -> Any:
    """JSON-compatible dict of a model, without defaults (smaller records)."""
    return model.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def pack_model(model: BaseModel) -> bytes:
    return pack(dump_model(model))


def unpack_model(cls: type[M], data: bytes, *, key: str) -> M:
    """Decode and validate one msgpack-encoded model, translating failures to RecordError."""
    try:
        return cls.model_validate(unpack(data))
    except (ValueError, TypeError, msgpack.UnpackException, ValidationError) as exc:
        raise RecordError(key, f"invalid {cls.__name__}: {exc}") from exc


def encode_record(record: CheckpointRecord) -> dict[str, bytes | str | int]:
    """The full hash mapping of a record (all fields, always)."""
    return {
        "schema": record.schema_version,
        "turn_id": record.turn_id,
        "session_id": record.session_id,
        "epoch": record.epoch,
        "seq": record.seq,
        "phase": record.phase.value,
        "in_progress": 1 if record.in_progress else 0,
        "reason": record.reason.value,
        "messages": _PACKED_MESSAGES.pack(record.messages),
        "meta": _PACKED_METAS.pack(record.meta),
        "baseline": record.baseline,
        "counters": pack_model(record.counters),
        "updated_at": record.updated_at,
    }


class _PackMemo(Generic[Item]):
    """msgpack bytes of transcript entries, remembered per live object.

    Every save packs the turn's whole transcript (never a diff), but between two saves of a turn
    only the new entries differ, and entries are frozen. So each entry is packed once and its
    bytes reused while the object lives: a msgpack array is its header followed by its packed
    elements, so the result is byte for byte what packing the whole list gives. Keyed by
    identity with a weak reference (entries hold dicts, so they are not hashable, and equality
    would compare whole payloads); an entry's bytes leave the memo when the entry is collected.
    Re-packing every transcript was most of a host's CPU per save (``phaseline bench``).
    """

    def __init__(self, adapter: TypeAdapter[tuple[Item, ...]]) -> None:
        self._adapter = adapter
        self._packed: dict[int, tuple[weakref.ref[Item], bytes]] = {}

    def pack(self, items: Sequence[Item]) -> bytes:
        parts: list[bytes | None] = []
        missing: list[Item] = []
        for item in items:
            hit = self._packed.get(id(item))
            if hit is not None and hit[0]() is item:
                parts.append(hit[1])
            else:
                parts.append(None)
                missing.append(item)
        if missing:
            dumped = self._adapter.dump_python(
                tuple(missing), mode="json", by_alias=True, exclude_defaults=True
            )
            fresh = iter(zip(missing, dumped, strict=True))
            for i, part in enumerate(parts):
                if part is None:
                    item, value = next(fresh)
                    parts[i] = self._remember(item, pack(value))
        header: bytes = _HEADERS.pack_array_header(len(parts))
        return header + b"".join(p for p in parts if p is not None)

    def _remember(self, item: Item, data: bytes) -> bytes:
        key = id(item)
        self._packed[key] = (weakref.ref(item, lambda _ref: self._packed.pop(key, None)), data)
        return data


_HEADERS = msgpack.Packer()
"""Writes bare array headers (``pack_array_header`` returns the bytes)."""
_PACKED_MESSAGES: _PackMemo[Message] = _PackMemo(_MESSAGES)
_PACKED_METAS: _PackMemo[MessageMeta] = _PackMemo(_METAS)


#: Default cap on one record's encoded size. Redis refuses a bulk string past
#: ``proto-max-bulk-len`` (512 MB) by resetting the connection, which a retrying client would
#: repeat forever; a record this big is a runaway turn anyway.
DEFAULT_MAX_RECORD_BYTES = 32 * 2**20
#: The most ``max_record_bytes`` may be set to: Redis's own ``proto-max-bulk-len`` default.
RECORD_BYTES_CEILING = 512 * 2**20


def check_record_size(turn_id: str, nbytes: int, limit: int) -> None:
    """Raise :class:`RecordTooLarge` for a record of ``nbytes`` over ``limit``."""
    if nbytes > limit:
        raise RecordTooLarge(
            f"record of turn {turn_id} is {nbytes:,} bytes, over the {limit:,}-byte cap "
            "([checkpoint] max_record_bytes)"
        )


_INT_FIELDS = ("schema", "epoch", "seq", "baseline", "updated_at")
_STR_FIELDS = ("turn_id", "session_id", "phase", "reason")
_BLOB_FIELDS = ("messages", "meta", "counters")


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A checkpoint record in its Redis hash form, with the fields a save and its fence read.

    Hosts encode their records once and ship this form to the CheckpointActor, which checks
    its framing (:meth:`from_wire`) instead of rebuilding pydantic models: the content was
    produced from a validated :class:`~store.records.CheckpointRecord`, and every read
    validates it in full again (:func:`decode_record`, quarantine on failure).
    """

    turn_id: str
    """The turn."""
    epoch: int
    """Owner epoch (the fencing token)."""
    seq: int
    """Checkpoint number."""
    phase: str
    """Phase value, as stored."""
    reason: str
    """Why this checkpoint was taken."""
    in_progress: bool
    """Whether the turn is still running."""
    fields: dict[str, bytes | str | int]
    """Every hash field (:data:`RECORD_FIELDS`), ready for HSET."""

    @classmethod
    def of(cls, record: CheckpointRecord) -> EncodedRecord:
        return cls(
            record.turn_id, record.epoch, record.seq, record.phase.value, record.reason.value,
            record.in_progress, encode_record(record),
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes of the hash's values, about what the save sends."""
        return sum(len(v) if isinstance(v, bytes | str) else 8 for v in self.fields.values())

    def to_wire(self) -> bytes:
        return pack(self.fields)

    @classmethod
    def from_wire(cls, blob: bytes) -> EncodedRecord:
        """Check the framing of a shipped hash; ``ValueError`` says what is wrong."""
        try:
            fields = unpack(blob)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"not msgpack: {exc}") from exc
        if not isinstance(fields, dict) or set(fields) != set(RECORD_FIELDS):
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"hash fields must be {list(RECORD_FIELDS)}, got {got}")
        for name, kind in (
            [(f, int) for f in _INT_FIELDS]
            + [(f, str) for f in _STR_FIELDS]
            + [(f, bytes) for f in _BLOB_FIELDS]
        ):
            value = fields[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"field {name} must be {kind.__name__}, got {value!r:.80}")
        if fields["schema"] != SCHEMA_VERSION:
            raise ValueError(f"schema {fields['schema']} (this build writes {SCHEMA_VERSION})")
        TurnPhase(fields["phase"])  # ValueError for an unknown phase or reason
        SaveReason(fields["reason"])
        if (
            fields["in_progress"] not in (0, 1)
            or not 1 <= fields["epoch"] <= MAX_FENCE
            or not 0 <= fields["seq"] <= MAX_FENCE
        ):
            raise ValueError("in_progress must be 0 or 1, epoch in 1..2^53-1, seq in 0..2^53-1")
        return cls(
            fields["turn_id"], fields["epoch"], fields["seq"], fields["phase"], fields["reason"],
            fields["in_progress"] == 1, fields,
        )  # fmt: skip


def decode_record(key: str, raw: Mapping[bytes, bytes]) -> CheckpointRecord:
    """Validate a hash read with HGETALL. Raises :class:`RecordError` / :class:`UnknownSchema`."""
    fields = {k.decode("utf-8", "replace"): v for k, v in raw.items()}
    missing = [f for f in RECORD_FIELDS if f not in fields]
    if missing:
        raise RecordError(key, f"missing fields {missing}")
    extra = sorted(set(fields) - set(RECORD_FIELDS))
    if extra:
        raise RecordError(key, f"unexpected fields {extra}")
    try:
        schema = int(fields["schema"])
    except ValueError as exc:
        raise RecordError(key, f"schema is not an integer: {fields['schema']!r}") from exc
    if schema != SCHEMA_VERSION:
        raise UnknownSchema(key, f"unknown schema {schema} (this build reads {SCHEMA_VERSION})")
    try:
        text = {f: fields[f].decode() for f in ("turn_id", "session_id", "phase", "reason")}
        messages = unpack(fields["messages"])
        meta = unpack(fields["meta"])
        counters = unpack(fields["counters"])
        if not isinstance(messages, list) or not isinstance(meta, list):
            raise ValueError("messages and meta must be msgpack lists")
        return CheckpointRecord(
            schema_version=schema,
            turn_id=text["turn_id"],
            session_id=text["session_id"],
            epoch=int(fields["epoch"]),
            seq=int(fields["seq"]),
            phase=TurnPhase(text["phase"]),
            in_progress=_flag(fields["in_progress"]),
            reason=SaveReason(text["reason"]),
            messages=_MESSAGES.validate_python(messages),
            meta=_METAS.validate_python(meta),
            baseline=int(fields["baseline"]),
            counters=Counters.model_validate(counters),
            updated_at=int(fields["updated_at"]),
        )
    except (ValueError, TypeError, UnicodeDecodeError, msgpack.UnpackException) as exc:
        # pydantic.ValidationError is a ValueError.
        raise RecordError(key, f"undecodable record: {exc}") from exc


def _flag(value: bytes) -> bool:
    if value in (b"1", b"0"):
        return value == b"1"
    raise ValueError(f"in_progress must be 1 or 0, got {value!r}")
