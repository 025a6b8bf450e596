"""The verdict of a run, read from the evidence in Redis, never from the runtime's counters.

For every turn that was submitted: its final record exists and is not in progress; its
transcript equals the fault-free transcript of its work message for message (a tool result
``outcome_unknown`` is accepted in place of the call's real result: that is the documented
answer for a non-idempotent call caught in flight); meta is index-aligned with the pre-turn
ids intact; no non-idempotent call ran twice and none ran without the model being told
(side-effect counters, read against the transcript's call keys: :func:`effect_findings`); and
the checkpoint
events show no write accepted out of order (an older epoch after a newer one, or a seq that
did not increase), which is what a stale owner's accepted write would look like.

Tool-call ids are the endpoint's (a real server makes new random ones for every reply), so
transcripts are compared modulo them: each id is replaced by the call's position in its
transcript, in the call and in the result that answers it.

Two verdicts (:class:`VerdictMode`): ``exact`` compares every transcript with the fault-free
one (for a model that answers a conversation deterministically: the scripted model, a local
model at temperature 0); ``promises`` checks only what the runtime promises whatever the model
says: every turn final and none lost, none aborted, nothing left in progress, no side effect
twice, no meta drift, no stale write accepted, every tool call of a transcript answered once.

Poison turns (``expect_suspended``) are judged the other way round: each must end parked as
``suspended:poison``, and no other turn may be suspended or aborted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from actors.engine.resume import LOST_REPLY_PREFIX
from actors.engine.settings.engine_settings import EngineSettings
from actors.engine.turn_engine import TurnEngine
from actors.harness.work import Work
from actors.turn.compaction import read_summary
from actors.turn.settings import LoopSettings
from bus.errors import RecordError, RecordNotFound
from bus.messages import Message
from bus.outcomes import Outcome
from store.domain.effects import EffectCounters
from store.domain.ledger import ToolLedger
from store.keys import KeyLayout
from store.records import CheckpointRecord, LedgerEntry
from store.redis.connection import StoreClient
from store.redis.replies import text
from store.redis.stream_reads import read_range
from store.write.checkpoint import RedisCheckpointStore


class VerdictMode(StrEnum):
    """What a verdict compares (``phaseline demo --verdict``, ``chaos --verdict``)."""

    EXACT = "exact"
    """Every transcript equals the fault-free run's, modulo tool-call ids."""
    PROMISES = "promises"
    """What the runtime promises, without transcript equality (a model that is not
    deterministic)."""


async def reference_transcript(
    client: StoreClient, work: Work, namespace: str
) -> tuple[Message, ...]:
    """The fault-free transcript of ``work``, run in this process in its own namespace (the
    scripted model's replies depend on the scenario and the transcript only; an HTTP model's
    endpoint must answer as deterministically)."""
    engine = TurnEngine(
        client,
        KeyLayout(namespace, shards=1),
        EngineSettings(loop=LoopSettings(checkpoint_min_interval_s=0)),
    )
    await engine.run_new(*work.reference(), ["reference"])
    return (await engine.store.load("reference")).messages


async def expected_for(
    mode: VerdictMode, client: StoreClient, work: Work, namespace: str
) -> tuple[Message, ...] | None:
    """What ``mode`` compares transcripts with: the fault-free transcript (``exact``, run in
    ``namespace``), or None (``promises``, which needs none)."""
    if mode is VerdictMode.PROMISES:
        return None
    return await reference_transcript(client, work, namespace)


def without_call_ids(messages: Sequence[Message]) -> list[Message]:
    """The transcript with each tool-call id replaced by the call's position (``#0``, ``#1``
    ...), in the call and in its result: what is left when the endpoint's random ids go."""
    ids: dict[str, str] = {}
    out = []
    for m in messages:
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                ids[c.id] = f"#{len(ids)}"
                calls.append(c.model_copy(update={"id": ids[c.id]}))
            m = m.model_copy(update={"tool_calls": tuple(calls)})
        elif m.tool_result is not None and m.tool_result.call_id in ids:
            result = m.tool_result.model_copy(update={"call_id": ids[m.tool_result.call_id]})
            m = m.model_copy(update={"tool_result": result})
        out.append(m)
    return out


def unanswered_calls(messages: Sequence[Message]) -> str | None:
    """None if every tool call is answered by exactly one result after its message and before
    the next one (what the model must see); else the first that is not."""
    expected: list[str] = []
    for i, m in enumerate(messages):
        if m.tool_result is not None:
            if m.tool_result.call_id not in expected:
                return f"message {i}: a result for {m.tool_result.call_id!r} out of place"
            expected.remove(m.tool_result.call_id)
            continue
        if expected:
            return f"message {i}: calls {expected} left unanswered"
        expected = [c.id for c in m.tool_calls]
    return f"calls {expected} left unanswered" if expected else None


def first_difference(messages: Sequence[Message], expected: Sequence[Message]) -> str | None:
    """None if the transcript matches, modulo tool-call ids; else where and how it first
    differs."""
    messages, expected = without_call_ids(messages), without_call_ids(expected)
    for i, (got, want) in enumerate(zip(messages, expected, strict=False)):
        if got == want:
            continue
        g, w = got.tool_result, want.tool_result
        unknown = g is not None and w is not None and g.status == "outcome_unknown"
        if unknown and (g.call_id, g.name) == (w.call_id, w.name):  # type: ignore[union-attr]
            continue
        return f"message {i}: got {_brief(got)}, want {_brief(want)}"
    if len(messages) != len(expected):
        return f"{len(messages)} messages, want {len(expected)}"
    return None


def _brief(m: Message) -> str:
    if m.tool_result is not None:
        return f"tool {m.tool_result.name}[{m.tool_result.status}] {m.tool_result.output[:40]!r}"
    calls = ",".join(f"{c.name}({c.arguments_json()[:60]})" for c in m.tool_calls)
    return f"{m.role} {m.text[:40]!r}" + (f" calls {calls}" if calls else "")


@dataclass(slots=True)
class Verdict:
    mode: VerdictMode = VerdictMode.EXACT
    """What was compared."""
    turns: int = 0
    lost: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)
    meta_drift: list[str] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)
    duplicate_effects: list[str] = field(default_factory=list)
    """Turns where a non-idempotent call's effect happened twice: one call run twice, or two
    different calls in one place of one batch (a reply asked for again, answered otherwise)."""
    orphaned_effects: list[str] = field(default_factory=list)
    """Turns with an effect the model was never told of: its call is not the one the
    transcript answered in that place."""
    stale_accepted: list[str] = field(default_factory=list)
    bad_input_accepted: list[str] = field(default_factory=list)
    """Bad input the deployment took as good, or that took something down: a bad-input turn
    that did not answer with each raising call failed alone, a console probe let through."""
    suspended: list[str] = field(default_factory=list)
    """Turns parked as ``suspended:poison`` that were not poison turns."""
    aborted: list[str] = field(default_factory=list)
    """Turns that ended ``aborted:<cause>`` (also counted in ``differ``)."""
    poison_escaped: list[str] = field(default_factory=list)
    """Poison turns that did not end suspended."""
    poison: dict[str, dict[str, object]] = field(default_factory=dict)
    """Per poison turn: how many owners it lost (each a host death) and where its isolation
    host died."""
    poison_deaths: int = 0
    """Owners the poison turns lost, summed: the host deaths under them."""
    outcome_unknown: int = 0
    resumed: int = 0
    most_resumes: int = 0
    """The most times one turn was resumed."""
    checkpoints: int = 0
    model_calls: int = 0
    """Model calls in the turns' durable histories (``Counters.model_calls``), summed."""
    replies_adopted: int = 0
    """Journaled replies resumes continued from instead of asking the model again."""
    generations_adopted: int = 0
    """Generations in flight at a host's death that its resumed turn adopted (not repaid)."""
    generations_repaid: int = 0
    """Generations lost with their model worker and asked for again (paid twice)."""
    calls_repaid: int | None = None
    """Complete replies the model gave again to the same request after a crash (counted by the
    scripted model's ``random`` replies from outside; None where nothing counted them)."""
    flagged: set[str] = field(default_factory=set)
    """Turn ids behind any failing count (for the timeline; not in the JSON)."""
    resumes: dict[str, int] = field(default_factory=dict)
    """Resume attempts per turn (for the timeline; not in the JSON)."""

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.differ
            or self.meta_drift
            or self.in_progress
            or self.duplicate_effects
            or self.orphaned_effects
            or self.stale_accepted
            or self.bad_input_accepted
            or self.suspended
            or self.aborted
            or self.poison_escaped
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "verdict": self.mode.value,
            "turns": self.turns,
            "lost": len(self.lost),
            "transcripts_differ": len(self.differ),
            "meta_drift": len(self.meta_drift),
            "in_progress_left": len(self.in_progress),
            "duplicate_side_effects": len(self.duplicate_effects),
            "orphaned_side_effects": len(self.orphaned_effects),
            "stale_writes_accepted": len(self.stale_accepted),
            "bad_input_accepted": len(self.bad_input_accepted),
            "suspended_unexpectedly": len(self.suspended),
            "aborted": len(self.aborted),
            "poison_turns": len(self.poison),
            "poison_suspended": len(self.poison) - len(self.poison_escaped),
            "poison_escaped": len(self.poison_escaped),
            "poison_host_deaths": self.poison_deaths,
            "poison_detail": self.poison,
            "outcome_unknown_results": self.outcome_unknown,
            "resumed_turns": self.resumed,
            "most_resumes_of_one_turn": self.most_resumes,
            "checkpoints": self.checkpoints,
            "model_calls": self.model_calls,
            "replies_adopted": self.replies_adopted,
            "generations_adopted": self.generations_adopted,
            "generations_repaid": self.generations_repaid,
            "calls_repaid": self.calls_repaid,
            "examples": {
                k: v[:5]
                for k, v in (
                    ("lost", self.lost),
                    ("differ", self.differ),
                    ("meta_drift", self.meta_drift),
                    ("in_progress", self.in_progress),
                    ("duplicate_effects", self.duplicate_effects),
                    ("orphaned_effects", self.orphaned_effects),
                    ("stale_accepted", self.stale_accepted),
                    ("bad_input_accepted", self.bad_input_accepted),
                    ("suspended", self.suspended),
                    ("aborted", self.aborted),
                    ("poison_escaped", self.poison_escaped),
                )
                if v
            },
        }


def meta_ok(record: CheckpointRecord) -> bool:
    ids = [m.message_id for m in record.meta]
    return (
        len(record.meta) == len(record.messages)
        and ids[: record.baseline] == [f"{record.turn_id}:system", f"{record.turn_id}:user"]
        and len(ids) == len(set(ids))
    )


async def judge(
    client: StoreClient,
    keys: KeyLayout,
    turn_ids: Sequence[str],
    expected: Sequence[Message] | None,
    *,
    effects_client: StoreClient | None = None,
    expect_suspended: frozenset[str] = frozenset(),
) -> Verdict:
    """``expected``: the fault-free transcript (None: the ``promises`` verdict, no transcript
    equality); ``effects_client``: where the side effects were counted, if not in ``client``'s
    Redis; ``expect_suspended``: the poison turns, which must end suspended."""
    mode = VerdictMode.PROMISES if expected is None else VerdictMode.EXACT
    v = Verdict(mode=mode, turns=len(turn_ids))
    store = RedisCheckpointStore(client, keys)
    ledger = ToolLedger(client, keys)
    effects = EffectCounters(effects_client or client, keys)
    for tid in turn_ids:
        try:
            record = await store.load(tid)
        except (RecordNotFound, RecordError):
            v.lost.append(tid)
            v.flagged.add(tid)
            continue
        v.resumes[tid] = record.counters.resume_attempts
        if tid in expect_suspended:
            _judge_poison(v, record)
        elif _judge_end(v, record):
            _judge_transcript(v, record, expected)
        else:
            continue  # in progress or suspended: flagged already
        dup, orphans = effect_findings(await effects.counts(tid), record, await ledger.entries(tid))
        if dup:
            v.duplicate_effects.append(f"{tid}: {dup}")
            v.flagged.add(tid)
        if orphans:
            v.orphaned_effects.append(f"{tid}: {orphans}")
            v.flagged.add(tid)
        replies = await effects.replies(tid)
        if replies:
            v.calls_repaid = (v.calls_repaid or 0) + sum(n - 1 for n in replies.values())
    v.stale_accepted = await out_of_order_writes(client, keys, set(turn_ids))
    v.flagged.update(v.stale_accepted)
    return v


def _judge_poison(v: Verdict, record: CheckpointRecord) -> None:
    """A poison turn must end ``suspended:poison``."""
    tid, c = record.turn_id, record.counters
    v.poison[tid] = {
        "outcome": c.outcome,
        "owners_lost": c.resume_attempts,
        "isolated_deaths": list(c.isolated_deaths),
    }
    v.poison_deaths += c.resume_attempts
    if c.outcome is not Outcome.SUSPENDED_POISON:
        v.poison_escaped.append(f"{tid}: outcome {c.outcome or 'none (in progress)'}")
        v.flagged.add(tid)


def _judge_end(v: Verdict, record: CheckpointRecord) -> bool:
    """Whether an ordinary turn ended (an aborted one is flagged, and judged on); a turn left
    in progress or suspended is flagged and judged no further."""
    tid, outcome = record.turn_id, record.counters.outcome
    if record.in_progress:
        v.in_progress.append(tid)
        v.flagged.add(tid)
        return False
    if outcome is not None and outcome.suspended:
        v.suspended.append(f"{tid}: {outcome} {list(record.counters.isolated_deaths)}")
        v.flagged.add(tid)
        return False
    if outcome is not None and outcome.aborted:
        v.aborted.append(f"{tid}: {outcome}")
        v.flagged.add(tid)
    return True


def _judge_transcript(
    v: Verdict, record: CheckpointRecord, expected: Sequence[Message] | None
) -> None:
    """An ended turn's transcript: the fault-free one (or, without it, every call answered),
    and its meta aligned."""
    tid, c = record.turn_id, record.counters
    v.resumed += c.resume_attempts > 0
    v.most_resumes = max(v.most_resumes, c.resume_attempts)
    v.checkpoints += record.seq
    v.model_calls += c.model_calls
    v.replies_adopted += c.replies_adopted
    v.generations_adopted += c.generations_adopted
    v.generations_repaid += c.generations_repaid
    v.outcome_unknown += sum(
        m.tool_result is not None and m.tool_result.status == "outcome_unknown"
        for m in record.messages
    )
    if expected is None:
        diff = unanswered_calls(record.messages)
    else:
        diff = first_difference(record.messages, expected)
    if diff is not None:
        v.differ.append(f"{tid}: {diff} (outcome {c.outcome})")
        v.flagged.add(tid)
    if not meta_ok(record):
        v.meta_drift.append(tid)
        v.flagged.add(tid)


#: A call key as a note names it (``store.domain.ledger.call_key``).
CALL_KEY = re.compile(r"\b\d+\.\d+\.[0-9a-f]{24}\b")


def slot_of(call_key: str) -> str:
    """A call's place: ``<batch>.<index>`` of its key (two calls asked for in one place are
    one reply's call and a different reply's, asked for again)."""
    return ".".join(call_key.split(".")[:2])


def effect_findings(
    counts: dict[str, int], record: CheckpointRecord, ledger: dict[str, LedgerEntry]
) -> tuple[str, str]:
    """What the side effects counted from outside say of one ended turn: duplicates (a call
    run twice, or two calls' effects in one place) and orphans (an effect the model was never
    told of), each "" when there is none.

    An effect is told of when its key is a tool result's in the transcript's meta (or named
    in the note that tells the model of a refused journal's calls). A
    compaction drops results from the transcript; then an effect whose key is gone is an
    orphan only if the ledger never settled it or the transcript answered its place with
    another call."""
    ran = {k: n for k, n in counts.items() if n > 0}
    twice = sorted(k for k, n in ran.items() if n > 1)
    places: dict[str, list[str]] = {}
    for k in ran:
        places.setdefault(slot_of(k), []).append(k)
    shared = sorted(p for p, ks in places.items() if len(ks) > 1)
    told = {m.call_key for m in record.meta if m.call_key}
    for m in record.messages:  # a refused journal's calls, told to the model in a note
        if m.role == "user" and m.text.startswith(LOST_REPLY_PREFIX):
            told.update(CALL_KEY.findall(m.text))
    told_places = {slot_of(k) for k in told}
    compacted = any(read_summary(m) for m in record.messages)
    orphans = []
    for k in sorted(ran):
        if k in told:
            continue
        entry = ledger.get(k)
        settled = entry is not None and entry.state not in ("prepared", "dispatched")
        if not compacted or not settled or slot_of(k) in told_places:
            orphans.append(k)
    dup = "; ".join(
        [
            *(f"{k} ran {ran[k]} times" for k in twice),
            *(f"{len(places[p])} calls ran at {p}" for p in shared),
        ]
    )
    return dup, ", ".join(orphans)


async def out_of_order_writes(
    client: StoreClient, keys: KeyLayout, turn_ids: set[str]
) -> list[str]:
    """Turns whose checkpoint events show a write accepted after a newer one."""
    last: dict[str, tuple[int, int]] = {}
    bad: set[str] = set()
    for shard in keys.all_shards():
        for _, f in await read_range(client, keys.events(shard)):
            tid = text(f[b"turn_id"])
            if tid not in turn_ids:
                continue
            epoch, seq = int(f[b"epoch"]), int(f[b"seq"])
            prev = last.get(tid)
            if prev is not None and (epoch < prev[0] or seq <= prev[1]):
                bad.add(tid)
            last[tid] = (max(epoch, prev[0]) if prev else epoch, seq)
    return sorted(bad)
