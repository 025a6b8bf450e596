"""msgpack <-> record conversion. Never pickle: every byte read from Redis is validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from bus.errors import RecordError, RecordTooLarge, UnknownSchema
from bus.messages import Message
from bus.outcomes import SaveReason
from bus.phase import TurnPhase
from store.msgpack_wire import pack, unpack
from store.records import (
    MAX_FENCE,
    SCHEMA_VERSION,
    CheckpointRecord,
    Counters,
    MessageMeta,
    Settle,
)
from store.write.transcript import (
    DIGEST_BYTES,
    MESSAGES,
    METAS,
    KnownBodies,
    Plan,
    Transcript,
    digest,
    unpack_entries,
)

M = TypeVar("M", bound=BaseModel)

#: The hash fields of a checkpoint record; every save writes all of them (and nothing else).
RECORD_FIELDS = (
    "schema",
    "turn_id",
    "session_id",
    "agent",
    "epoch",
    "seq",
    "phase",
    "in_progress",
    "reason",
    "chunks",
    "tail",
    "length",
    "baseline",
    "counters",
    "updated_at",
)
#: The fields of a schema-2 record (no agent), still read.
SCHEMA2_FIELDS = tuple(f for f in RECORD_FIELDS if f != "agent")
#: The fields of a schema-1 record (the whole transcript inline), still read.
SCHEMA1_FIELDS = (
    "schema",
    "turn_id",
    "session_id",
    "epoch",
    "seq",
    "phase",
    "in_progress",
    "reason",
    "messages",
    "meta",
    "baseline",
    "counters",
    "updated_at",
)


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


def encode_record(
    record: CheckpointRecord, transcript: Transcript | None = None
) -> dict[str, bytes | str | int]:
    """The full hash mapping of a record (all fields, always); the bodies it names are
    ``transcript.bodies``."""
    t = transcript or Transcript.of(record.messages, record.meta)
    return {
        "schema": SCHEMA_VERSION,
        "turn_id": record.turn_id,
        "session_id": record.session_id,
        "agent": record.agent,
        "epoch": record.epoch,
        "seq": record.seq,
        "phase": record.phase.value,
        "in_progress": 1 if record.in_progress else 0,
        "reason": record.reason.value,
        "chunks": t.chunks,
        "tail": t.tail,
        "length": t.length,
        "baseline": record.baseline,
        "counters": pack_model(record.counters),
        "updated_at": record.updated_at,
    }


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


#: What :meth:`EncodedRecord.from_wire` checks, built once: it runs for every save a host sends.
_FIELD_KINDS = (
    *((f, int) for f in ("schema", "epoch", "seq", "length", "baseline", "updated_at")),
    *((f, str) for f in ("turn_id", "session_id", "agent", "phase", "reason")),
    *((f, bytes) for f in ("chunks", "tail", "counters")),
)
_RECORD_FIELD_SET = frozenset(RECORD_FIELDS)
_WIRE_PARTS = frozenset({"fields", "puts", "drops", "replace", "nbytes", "settles"})
_PHASES = frozenset(p.value for p in TurnPhase)
_REASONS = frozenset(r.value for r in SaveReason)


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """One save in its Redis form: the record's hash and what it does to the turn's bodies.

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
    puts: dict[bytes, bytes]
    """Bodies to write, by digest (only those the writer does not know the store has)."""
    drops: tuple[bytes, ...]
    """Digests of bodies the record stopped referencing."""
    replace: bool
    """Empty the bodies hash before the puts (then ``puts`` holds every body)."""
    nbytes: int
    """The whole record's size: its fields and every body it references (the size cap)."""
    settles: tuple[Settle, ...] = ()
    """Outcomes of tool calls journaled with this save (:class:`~store.records.Settle`)."""

    @classmethod
    def of(cls, record: CheckpointRecord, known: KnownBodies | None = None) -> EncodedRecord:
        """Encode a save; ``known`` (the writer's memory of the turn) turns it into a delta."""
        transcript = Transcript.of(record.messages, record.meta)
        fields = encode_record(record, transcript)
        if known is None:
            plan = Plan(dict(transcript.bodies), (), replace=True)
        else:
            plan = known.plan(record.turn_id, record.epoch, record.seq, transcript)
        return cls(
            record.turn_id,
            record.epoch,
            record.seq,
            record.phase.value,
            record.reason.value,
            record.in_progress,
            fields,
            plan.puts,
            plan.drops,
            plan.replace,
            _field_bytes(fields) + transcript.nbytes,
        )

    def counters(self) -> Counters:
        """The record's counters, decoded (only the final save's tally and retention need
        them, so this is not done for every save)."""
        raw = self.fields["counters"]
        blob = raw if isinstance(raw, bytes) else str(raw).encode()
        return unpack_model(Counters, blob, key=f"counters of {self.turn_id}")

    @property
    def sent_bytes(self) -> int:
        """Bytes this save writes: the record's fields and the new bodies."""
        return _field_bytes(self.fields) + sum(len(k) + len(v) for k, v in self.puts.items())

    def to_wire(self) -> bytes:
        return pack(
            {
                "fields": self.fields,
                "puts": self.puts,
                "drops": list(self.drops),
                "replace": self.replace,
                "nbytes": self.nbytes,
                "settles": [[x.call_key, x.dispatched, x.settled] for x in self.settles],
            }
        )

    @classmethod
    def from_wire(cls, blob: bytes) -> EncodedRecord:
        """Check the framing of a shipped save; ``ValueError`` says what is wrong."""
        try:
            parts = unpack(blob)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"not msgpack: {exc}") from exc
        if not isinstance(parts, dict) or parts.keys() != _WIRE_PARTS:
            got = sorted(parts) if isinstance(parts, dict) else type(parts).__name__
            raise ValueError(f"a save must have parts {sorted(_WIRE_PARTS)}, got {got}")
        fields, puts, drops = parts["fields"], parts["puts"], parts["drops"]
        if not isinstance(fields, dict) or fields.keys() != _RECORD_FIELD_SET:
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"hash fields must be {list(RECORD_FIELDS)}, got {got}")
        for name, kind in _FIELD_KINDS:
            value = fields[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"field {name} must be {kind.__name__}, got {value!r:.80}")
        if fields["schema"] != SCHEMA_VERSION:
            raise ValueError(f"schema {fields['schema']} (this build writes {SCHEMA_VERSION})")
        if fields["phase"] not in _PHASES:
            raise ValueError(f"unknown phase {fields['phase']!r:.80}")
        if fields["reason"] not in _REASONS:
            raise ValueError(f"unknown save reason {fields['reason']!r:.80}")
        if (
            fields["in_progress"] not in (0, 1)
            or not 1 <= fields["epoch"] <= MAX_FENCE
            or not 0 <= fields["seq"] <= MAX_FENCE
        ):
            raise ValueError("in_progress must be 0 or 1, epoch in 1..2^53-1, seq in 0..2^53-1")
        for name in ("chunks", "tail"):
            if len(fields[name]) % DIGEST_BYTES:
                raise ValueError(f"field {name} is not a whole number of digests")
        if not isinstance(puts, dict) or not all(
            isinstance(v, bytes) and digest(v) == k for k, v in puts.items()
        ):
            raise ValueError("puts must map each body's digest to the body")
        if not isinstance(drops, list) or not all(
            isinstance(d, bytes) and len(d) == DIGEST_BYTES for d in drops
        ):
            raise ValueError(f"drops must be a list of {DIGEST_BYTES}-byte digests")
        if not isinstance(parts["replace"], bool):
            raise ValueError("replace must be a bool")
        nbytes = parts["nbytes"]
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError("nbytes must be a byte count")
        return cls(
            fields["turn_id"],
            fields["epoch"],
            fields["seq"],
            fields["phase"],
            fields["reason"],
            fields["in_progress"] == 1,
            fields,
            puts,
            tuple(drops),
            parts["replace"],
            # A host cannot make a save pass the size cap by under-reporting what it sends.
            max(nbytes, sum(len(v) for v in puts.values())),
            _settles_of(parts["settles"]),
        )


def _settles_of(raw: object) -> tuple[Settle, ...]:
    """The wire form's settles: a list of [call key, dispatched entry, settled entry]."""
    if not isinstance(raw, list) or not all(
        isinstance(x, list)
        and len(x) == 3
        and isinstance(x[0], str)
        and isinstance(x[1], bytes)
        and isinstance(x[2], bytes)
        for x in raw
    ):
        raise ValueError("settles must be a list of [call key, dispatched, settled]")
    return tuple(Settle(k, d, s) for k, d, s in raw)


def _field_bytes(fields: Mapping[str, bytes | str | int]) -> int:
    return sum(len(v) if isinstance(v, bytes | str) else 8 for v in fields.values())


def decode_record(
    key: str, raw: Mapping[bytes, bytes], bodies: Mapping[bytes, bytes] | None = None
) -> CheckpointRecord:
    """Validate a record's hash and the bodies it names (what ``checkpoint_load.lua`` reads).
    Raises :class:`RecordError` / :class:`UnknownSchema`; schema-1 records are read too."""
    fields = {k.decode("utf-8", "replace"): v for k, v in raw.items()}
    try:
        schema = int(fields["schema"])
    except KeyError:
        raise RecordError(key, "missing fields ['schema']") from None
    except ValueError as exc:
        raise RecordError(key, f"schema is not an integer: {fields['schema']!r}") from exc
    expected = _FIELDS_OF.get(schema)
    if expected is None:
        raise UnknownSchema(key, f"unknown schema {schema} (this build reads 1..{SCHEMA_VERSION})")
    missing = [f for f in expected if f not in fields]
    if missing:
        raise RecordError(key, f"missing fields {missing}")
    extra = sorted(set(fields) - set(expected))
    if extra:
        raise RecordError(key, f"unexpected fields {extra}")
    try:
        text = {f: fields[f].decode() for f in ("turn_id", "session_id", "phase", "reason")}
        agent = fields["agent"].decode() if "agent" in fields else ""
        if schema == 1:
            messages, meta = _schema1_transcript(fields)
        else:
            messages, meta = unpack_entries(
                fields["chunks"], fields["tail"], int(fields["length"]), dict(bodies or {})
            )
        counters = unpack(fields["counters"])
        return CheckpointRecord(
            schema_version=schema,
            turn_id=text["turn_id"],
            session_id=text["session_id"],
            agent=agent,
            epoch=int(fields["epoch"]),
            seq=int(fields["seq"]),
            phase=TurnPhase(text["phase"]),
            in_progress=_flag(fields["in_progress"]),
            reason=SaveReason(text["reason"]),
            messages=messages,
            meta=meta,
            baseline=int(fields["baseline"]),
            counters=Counters.model_validate(counters),
            updated_at=int(fields["updated_at"]),
        )
    except (ValueError, TypeError, UnicodeDecodeError, msgpack.UnpackException) as exc:
        # pydantic.ValidationError is a ValueError.
        raise RecordError(key, f"undecodable record: {exc}") from exc


_FIELDS_OF = {1: SCHEMA1_FIELDS, 2: SCHEMA2_FIELDS, SCHEMA_VERSION: RECORD_FIELDS}


def _schema1_transcript(
    fields: Mapping[str, bytes],
) -> tuple[tuple[Message, ...], tuple[MessageMeta, ...]]:
    """A schema-1 record carries its whole transcript inline, as two msgpack lists."""
    messages, meta = unpack(fields["messages"]), unpack(fields["meta"])
    if not isinstance(messages, list) or not isinstance(meta, list):
        raise ValueError("messages and meta must be msgpack lists")
    return MESSAGES.validate_python(messages), METAS.validate_python(meta)


def _flag(value: bytes) -> bool:
    if value in (b"1", b"0"):
        return value == b"1"
    raise ValueError(f"in_progress must be 1 or 0, got {value!r}")
