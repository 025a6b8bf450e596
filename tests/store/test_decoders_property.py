"""Property tests: every decoder of Redis or bus data, fed random and mutated input, either
returns exactly what is stored or raises its typed error. Never a crash, never a wrong record."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.errors import RecordError
from bus.events import (
    BadBusEntry,
    Checkpointed,
    Finished,
    ModelReplied,
    Recovering,
    Restarted,
    TextDelta,
    ToolCalled,
    ToolReturned,
    ToolWait,
    ToolWaiting,
    decode_bus_event,
    decode_event,
    encode_event,
)
from bus.outcomes import Action, EngineProblem, Outcome, Problem, SaveReason
from bus.phase import Transition, TurnPhase
from store.codec import RECORD_FIELDS, EncodedRecord, decode_record, encode_record, unpack_model
from store.records import InboxItem, LedgerEntry, ReplyJournal, TurnSpec
from store.write.transcript import Transcript
from tests.support.records import record

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def as_hash(fields: dict[str, bytes | str | int]) -> dict[bytes, bytes]:
    """A record's fields as HGETALL returns them."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def raw_hash(n: int = 2) -> dict[bytes, bytes]:
    return as_hash(encode_record(record("t1", n_turn_messages=n)))


# n = 40: one full chunk of digests and a tail.
BODIES = Transcript.of(
    record("t1", n_turn_messages=40).messages, record("t1", n_turn_messages=40).meta
).bodies


junk = st.one_of(
    st.binary(max_size=64),
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda i: str(i).encode()),
    st.builds(
        lambda v: msgpack.packb(v),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=6), inner, max_size=4)
            ),
            max_leaves=12,
        ),
    ),
)


@PROPS
@given(field=st.sampled_from(RECORD_FIELDS), value=junk)
def test_a_record_with_one_field_replaced_decodes_to_itself_or_fails_typed(
    field: str, value: bytes
) -> None:
    raw = raw_hash(40)
    raw[field.encode()] = value
    try:
        rec = decode_record("k", raw, BODIES)
    except RecordError:
        return
    # It decoded: then it is exactly what is stored, field for field.
    again = as_hash(encode_record(rec))
    for name in ("epoch", "seq", "baseline", "updated_at", "schema", "length"):
        assert int(again[name.encode()]) == int(raw[name.encode()])
    for name in ("turn_id", "session_id", "phase", "reason", "in_progress", "chunks", "tail"):
        assert again[name.encode()] == raw[name.encode()]


@PROPS
@given(victim=st.integers(min_value=0), value=st.binary(max_size=64) | junk, drop=st.booleans())
def test_a_record_with_one_body_replaced_or_missing_is_a_record_error(
    victim: int, value: bytes, drop: bool
) -> None:
    bodies = dict(BODIES)
    address = sorted(bodies)[victim % len(bodies)]
    if drop:
        del bodies[address]
    else:
        bodies[address] = value
    with pytest.raises(RecordError, match=r"missing|does not match"):
        decode_record("k", raw_hash(40), bodies)


@PROPS
@given(
    drop=st.sets(st.sampled_from(RECORD_FIELDS), max_size=3),
    extra=st.dictionaries(st.binary(min_size=1, max_size=8), st.binary(max_size=8), max_size=2),
)
def test_missing_or_extra_fields_are_record_errors(
    drop: set[str], extra: dict[bytes, bytes]
) -> None:
    raw = {k: v for k, v in raw_hash().items() if k.decode() not in drop}
    raw.update(
        {k: v for k, v in extra.items() if k.decode("utf-8", "replace") not in RECORD_FIELDS}
    )
    if not drop and len(raw) == len(RECORD_FIELDS):
        assert decode_record("k", raw, BODIES).turn_id == "t1"
        return
    with pytest.raises(RecordError):
        decode_record("k", raw)


@PROPS
@given(blob=st.binary(max_size=256) | junk)
def test_the_wire_form_rejects_anything_malformed_with_value_error(blob: bytes) -> None:
    try:
        enc = EncodedRecord.from_wire(blob)
    except ValueError:
        return
    assert set(enc.fields) == set(RECORD_FIELDS)


@PROPS
@given(
    model=st.sampled_from([LedgerEntry, TurnSpec, InboxItem, ReplyJournal]),
    data=st.binary(max_size=128) | junk,
)
def test_ledger_entries_specs_inbox_items_and_journals_fail_typed(model: Any, data: bytes) -> None:
    with contextlib.suppress(RecordError):  # anything else fails the test
        unpack_model(model, data, key="k")


@PROPS
@given(
    fields=st.dictionaries(
        st.sampled_from(
            [
                "kind",
                "turn_id",
                "epoch",
                "seq",
                "src",
                "dst",
                "at_ms",
                "label",
                "x",
                "text",
                "call_id",
                "name",
                "arguments",
                "status",
                "output",
                "resumed_from",
                "messages",
                "outcome",
                "answer",
            ]
        ),
        st.binary(max_size=16) | st.integers(-(2**70), 2**70).map(lambda i: str(i).encode()),
        max_size=12,
    )
    | st.fixed_dictionaries(
        {
            "kind": st.sampled_from(
                [b"text", b"tool_call", b"tool_result", b"restarted", b"finished"]
            )
        },
        optional={
            n: st.binary(max_size=8) for n in ("turn_id", "epoch", "text", "at_ms", "messages")
        },
    )
)
def test_bus_entries_decode_or_fail_typed(fields: dict[str, bytes]) -> None:
    with contextlib.suppress(BadBusEntry):  # anything else fails the test
        decode_event({k.encode(): v for k, v in fields.items()})


def test_a_valid_bus_entry_round_trips() -> None:
    t = Transition("t1", 2, 5, TurnPhase.AWAITING_LLM, TurnPhase.EXECUTING_TOOLS, 123)
    assert decode_event(encode_event(t)) == t
    for live in (
        TextDelta("t1", 2, "héllo\n", 1),
        ToolCalled("t1", 2, "c1", "echo", '{"a":1}', 2),
        ToolCalled("t1", 2, "c1", "counter_increment", "{}", 2, "t1:0:counter:0", False),
        ToolCalled("t1", 2, "c1", "echo", "{}", 2, "t1:0:echo:0", True),
        ModelReplied("t1", 2, "openai", "qwen", 1, 9, "tool_calls", 10, 4, 2),
        ModelReplied("t1", 2, "openai", "qwen", 1, 9, error="rate_limited"),
        Checkpointed("t1", 2, 4, SaveReason.TOOL_BATCH, 12, 9),
        ToolReturned("t1", 2, "c1", "echo", "outcome_unknown", "", 3),
        ToolWaiting("t1", 2, "c1", "echo", ToolWait.THREADS, 3),
        ToolWaiting("t1", 2, "c1", "echo", ToolWait.TOOL_LIMIT, 4, over=True),
        Restarted("t1", 3, SaveReason.TOOL_BATCH, 7, 4),
        Restarted("t1", 3, None, 7, 4),
        Finished("t1", 3, Outcome.ABORTED_LOOP, "done", 5, "model loop: again"),
        Recovering("t1", 3, Problem.RATE_LIMITED, Action.WAIT, "429", 6),
        Recovering("t1", 3, EngineProblem.RUN_FAILED, Action.RETRY, "KeyError", 6),
    ):
        wire = {k.encode(): str(v).encode() for k, v in encode_event(live).items()}
        assert decode_event(wire) == live
        with pytest.raises(BadBusEntry):
            decode_bus_event(wire)


def test_text_utf8_cannot_hold_is_made_storable_when_an_event_is_encoded() -> None:
    """A model's streamed text or a tool's output may hold a lone surrogate (a JSON ``\\ud800``
    escape): the event is encoded with U+FFFD in its place, not refused by Redis's client."""
    for live in (
        TextDelta("t1", 2, "done \ud800", 1),
        ToolReturned("t1", 2, "c1", "files", "ok", "report-\udcff.txt", 3),
    ):
        wire = {k.encode(): str(v).encode() for k, v in encode_event(live).items()}
        back = decode_event(wire)
        assert "\ufffd" in str(back) and "\ud800" not in str(back) and "\udcff" not in str(back)


@pytest.mark.parametrize(
    ("field", "value"),
    [("status", "exploded"), ("outcome", "aborted:boredom"), ("problem", "gremlins"),
     ("action", "panic"), ("resumed_from", "whim"), ("reason", "whim"), ("idempotent", "yes"),
     ("seq", "four"), ("waits_for", "godot"), ("over", "maybe")],
)  # fmt: skip
def test_a_live_event_with_a_word_no_layer_knows_is_a_bad_entry(field: str, value: str) -> None:
    events = {
        "status": ToolReturned("t1", 2, "c1", "echo", "ok", "", 3),
        "outcome": Finished("t1", 3, Outcome.ANSWERED, "done", 5),
        "problem": Recovering("t1", 3, Problem.LOOP, Action.NUDGE, "", 6),
        "action": Recovering("t1", 3, Problem.LOOP, Action.NUDGE, "", 6),
        "resumed_from": Restarted("t1", 3, SaveReason.FINAL, 7, 4),
        "reason": Checkpointed("t1", 2, 4, SaveReason.TOOL_BATCH, 12, 9),
        "seq": Checkpointed("t1", 2, 4, SaveReason.TOOL_BATCH, 12, 9),
        "idempotent": ToolCalled("t1", 2, "c1", "echo", "{}", 2, "k", True),
        "waits_for": ToolWaiting("t1", 2, "c1", "echo", ToolWait.THREADS, 3),
        "over": ToolWaiting("t1", 2, "c1", "echo", ToolWait.THREADS, 3),
    }
    wire = {**encode_event(events[field]), field: value}
    with pytest.raises(BadBusEntry):
        decode_event(wire)
