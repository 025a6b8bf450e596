"""Resume plans: what a new owner needs to continue a turn whose host died.

A plan reads the last checkpoint, the turn's spec, its tool ledger and its inbox, and makes the
fencing claim (``epoch + 1``, one more resume attempt, persisted before any model call). A turn
claimed again before it saved anything counts a stalled resume; where it runs next, or whether
it is parked as ``suspended:poison``, is the poison-turn policy's call (``actors.turn.poison``). The
same function serves the in-process engine, the RecoveryActor and the isolation host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from actors.turn.poison import Placement, place
from actors.turn.run_result import RunStop
from bus.errors import RecordError, RecordNotFound, StaleOwner
from bus.outcomes import Outcome, SaveReason
from store.codec import dump_model
from store.domain.inbox import Inbox
from store.domain.isolation import Probation
from store.domain.ledger import LedgerView, ToolLedger, decode_reply
from store.msgpack_wire import pack, unpack
from store.records import CheckpointRecord, LedgerEntry, ReplyJournal, TurnSpec
from store.write.checkpoint import RedisCheckpointStore


@dataclass(frozen=True, slots=True)
class Resume:
    """Run the claimed record (the new epoch) from its checkpoint."""

    turn_id: str
    """The turn."""
    record: CheckpointRecord
    """The claimed record: the last checkpoint under the new epoch."""
    spec: TurnSpec
    """The turn's spec (its agent and input)."""
    resume_from: SaveReason
    """Reason of the checkpoint the turn restarts from (``force_stop`` resumes the wrap-up)."""
    in_flight: int = 0
    """Tool calls the ledger shows dispatched but unfinished (non-idempotent ones will be
    reported ``outcome_unknown``, idempotent ones re-run)."""
    pending_inbox: int = 0
    """Injected messages not yet in the transcript; appended after it at the first boundary."""
    detail: str = ""
    """Why, for logs."""
    journal: ReplyJournal | None = None
    """A model reply journaled after the checkpoint: the turn continues from it (its batch
    runs) instead of asking the model again."""
    lost_reply: str = ""
    """A journaled reply was refused (undecodable, or not the record's): what the model is
    told of it and of its calls before it is asked again ("" for none)."""

    @property
    def what(self) -> str:
        """What the plan does, as logs name it."""
        return "resume"


@dataclass(frozen=True, slots=True)
class Parked:
    """This claim parked the turn as ``suspended:poison``; nothing runs."""

    turn_id: str
    """The turn."""
    record: CheckpointRecord
    """The parked record (its isolated deaths are the evidence)."""
    detail: str = ""
    """Why, for logs."""

    @property
    def what(self) -> str:
        """What the plan does, as logs name it."""
        return "suspended"


@dataclass(frozen=True, slots=True)
class Skipped:
    """Nothing to run, and why: another owner claimed the turn (``fenced``), it ended
    (``finished``), its record, spec or ledger failed to decode and were quarantined
    (``unusable``), or the policy wants it alone on the isolation host (``isolate``, nothing
    claimed)."""

    turn_id: str
    """The turn."""
    stop: RunStop
    """What this run of it is then."""
    detail: str = ""
    """Why, for logs."""

    @property
    def what(self) -> str:
        """What the plan does, as logs name it: why nothing runs."""
        return self.stop.value


ResumePlan = Resume | Parked | Skipped
"""What to do with one turn that lost its host: one of three shapes, each with exactly the
fields it needs (``match`` on it)."""


def plan_to_wire(plan: ResumePlan) -> bytes:
    """msgpack form for crossing a Ray call (read back, validated, by :func:`plan_from_wire`)."""
    if isinstance(plan, Resume):
        return pack(
            {
                "kind": "resume",
                "turn_id": plan.turn_id,
                "record": dump_model(plan.record),
                "spec": dump_model(plan.spec),
                "resume_from": plan.resume_from.value,
                "in_flight": plan.in_flight,
                "pending_inbox": plan.pending_inbox,
                "detail": plan.detail,
                "lost_reply": plan.lost_reply,
                "journal": None if plan.journal is None else dump_model(plan.journal),
            }
        )
    if isinstance(plan, Parked):
        return pack(
            {
                "kind": "parked",
                "turn_id": plan.turn_id,
                "record": dump_model(plan.record),
                "detail": plan.detail,
            }
        )
    return pack(
        {"kind": "skipped", "turn_id": plan.turn_id, "stop": plan.stop.value, "detail": plan.detail}
    )


def plan_from_wire(data: bytes) -> ResumePlan:
    """A plan read back from :func:`plan_to_wire`; :class:`RecordError` for anything else."""
    d: Any = unpack(data)
    turn_id = str(d.get("turn_id", ""))[:128] if isinstance(d, dict) else "?"
    try:
        kind, detail = d["kind"], str(d["detail"])
        if kind == "resume":
            return Resume(
                turn_id=str(d["turn_id"]),
                record=CheckpointRecord.model_validate(d["record"]),
                spec=TurnSpec.model_validate(d["spec"]),
                resume_from=SaveReason(d["resume_from"]),
                in_flight=int(d["in_flight"]),
                pending_inbox=int(d["pending_inbox"]),
                detail=detail,
                journal=None if d["journal"] is None else ReplyJournal.model_validate(d["journal"]),
                lost_reply=str(d["lost_reply"]),
            )
        if kind == "parked":
            record = CheckpointRecord.model_validate(d["record"])
            return Parked(turn_id=str(d["turn_id"]), record=record, detail=detail)
        if kind == "skipped":
            return Skipped(turn_id=str(d["turn_id"]), stop=RunStop(d["stop"]), detail=detail)
        raise ValueError(f"unknown plan kind {kind!r}")
    except (KeyError, TypeError, ValueError) as exc:  # a pydantic error is a ValueError
        raise RecordError(f"plan of {turn_id}", str(exc)[:200]) from exc


def stalled_resumes(record: CheckpointRecord) -> int:
    """Resumes in a row without progress up to ``record``: its count if the record is itself a
    claim (nothing was saved since), else 0 (the turn saved a checkpoint after its last claim)."""
    return record.counters.stalled_resumes if record.reason is SaveReason.RESUME else 0


def claim_for_resume(
    record: CheckpointRecord, *, now_ms: int, died_at: str | None = None
) -> CheckpointRecord:
    """The fencing write of a new owner: same transcript, epoch + 1, one more resume attempt
    (and, when its isolated predecessor died inside a step, that step as evidence)."""
    c = record.counters
    deaths = c.isolated_deaths if died_at is None else (*c.isolated_deaths, died_at)
    counters = c.model_copy(
        update={
            "resume_attempts": c.resume_attempts + 1,
            "stalled_resumes": stalled_resumes(record) + 1,
            "isolated_deaths": deaths,
        }
    )
    return record.model_copy(
        update={
            "epoch": record.epoch + 1,
            "seq": record.seq + 1,
            "reason": SaveReason.RESUME,
            "counters": counters,
            "updated_at": now_ms,
        }
    )


def suspended(claimed: CheckpointRecord) -> CheckpointRecord:
    """A claim turned into the parked record: out of the in-progress index, with its evidence."""
    counters = claimed.counters.model_copy(update={"outcome": Outcome.SUSPENDED_POISON})
    return claimed.model_copy(
        update={"in_progress": False, "reason": SaveReason.SUSPENDED, "counters": counters}
    )


def unsuspended(record: CheckpointRecord, *, now_ms: int) -> CheckpointRecord:
    """An operator's ``phaseline resume TURN`` of a parked turn: back in progress, evidence
    cleared (the next claim treats it as a turn that lost its host once)."""
    changed = record.counters.outcome is Outcome.SUSPENDED_AGENT_CHANGED
    counters = record.counters.model_copy(
        update={
            "outcome": None,
            "stalled_resumes": 0,
            "isolated_deaths": (),
            "agent_failures": 0,
            # the operator accepts the agent as it is now: the turn goes on with it
            **({"agent_fingerprint": ""} if changed else {}),
        }
    )
    return record.model_copy(
        update={
            "epoch": record.epoch + 1,
            "seq": record.seq + 1,
            "in_progress": True,
            "reason": SaveReason.UNSUSPENDED,
            "counters": counters,
            "updated_at": now_ms,
        }
    )


async def reopen(store: RedisCheckpointStore, turn_id: str) -> CheckpointRecord:
    """An operator asked for this turn by id: a suspended one goes back in progress (fenced
    like any claim); any other record is returned as it is."""
    record = await store.load(turn_id)
    outcome = record.counters.outcome
    if record.in_progress or outcome is None or not outcome.suspended:
        return record
    reopened = unsuspended(record, now_ms=int(time.time() * 1000))
    await store.save(reopened)
    return reopened


def died_inside(marker: Probation | None, record: CheckpointRecord) -> str | None:
    """The step inside which the isolation host died with this turn, if the probation marker
    says so: it names this turn at the epoch the record still has (nobody claimed it since),
    and a step had begun. A marker is cleared whenever a probation ends without its host
    dying, and forgotten after a freeze, so what is left is a death."""
    if marker is None or marker.turn_id != record.turn_id or marker.epoch != record.epoch:
        return None
    return marker.step or None


async def plan_resume(
    store: RedisCheckpointStore,
    ledger: ToolLedger,
    inbox: Inbox,
    turn_id: str,
    *,
    isolated: bool = False,
    marker: Probation | None = None,
) -> ResumePlan:
    """Load, inspect and claim one turn. Bad records are quarantined (``unusable``).

    ``isolated``: the caller is the isolation host (it runs what it claims alone), and
    ``marker`` the probation marker it found (:func:`died_inside` reads the evidence from it).
    A shared caller gets ``isolate`` (and claims nothing) for a turn the policy isolates."""
    try:
        record = await store.load(turn_id)
    except (RecordNotFound, RecordError) as exc:  # deleted under us, or quarantined on load
        return Skipped(turn_id, RunStop.UNUSABLE, detail=str(exc))
    if not record.in_progress:
        return Skipped(turn_id, RunStop.FINISHED, detail=str(record.counters.outcome))
    try:
        spec = await store.load_spec(turn_id)
        view = await ledger.read(turn_id)
    except (RecordNotFound, RecordError) as exc:
        # An in-progress record whose spec is missing or bad, or whose ledger is unreadable,
        # can never resume: take it aside, so it is reported once instead of planned again
        # at every adopt.
        await store.quarantine(turn_id, f"unusable: {exc}")
        return Skipped(turn_id, RunStop.UNUSABLE, detail=str(exc))
    died_at = died_inside(marker, record) if isolated else None
    deaths = (*record.counters.isolated_deaths, *((died_at,) if died_at else ()))
    placement = place(stalled_resumes(record) + 1, deaths)
    if placement is Placement.ISOLATED and not isolated:
        detail = "stalled: runs alone on the isolation host"
        return Skipped(turn_id, RunStop.ISOLATE, detail=detail)
    entries = view.entries
    in_flight = sum(e.state == "dispatched" for e in entries.values())
    pending = len(await inbox.read_from(turn_id, record.counters.inbox_offset))
    claimed = claim_for_resume(record, now_ms=int(time.time() * 1000), died_at=died_at)
    if placement is Placement.SUSPEND:
        claimed = suspended(claimed)
    try:
        await store.save(claimed)
    except StaleOwner as exc:
        return Skipped(turn_id, RunStop.FENCED, detail=str(exc))
    if placement is Placement.SUSPEND:
        return Parked(turn_id, claimed, detail="poison")
    journal, refused = judge_reply(record, view)
    lost = ""
    if refused:
        lost = lost_reply_note(refused, calls_since(entries, record.counters.tool_batches))
        await ledger.refuse_reply(turn_id, view.reply or b"", refused)
    return Resume(
        turn_id,
        record=claimed,
        resume_from=record.reason,
        spec=spec,
        in_flight=in_flight,
        pending_inbox=pending,
        detail=f"resume attempt {claimed.counters.resume_attempts}"
        + (" from its journaled reply" if journal else "")
        + (f"; its journaled reply refused: {refused}" if refused else ""),
        journal=journal,
        lost_reply=lost,
    )


#: How the model's note of a refused journal begins (the verdict reads its call keys as told).
LOST_REPLY_PREFIX = "[phaseline: lost replies]"


def judge_reply(record: CheckpointRecord, view: LedgerView) -> tuple[ReplyJournal | None, str]:
    """The journaled reply a resume continues from (None: none, or one a later checkpoint
    already holds), or why it is refused ("" if it is not): it does not decode, or it claims
    an epoch newer than the record's or a batch the record is not at. ``record`` is the
    record as read, before the claim."""
    if view.reply is None:
        return None, ""
    try:
        journal = decode_reply(record.turn_id, view.reply)
    except RecordError as exc:
        return None, f"it does not decode ({exc})"[:300]
    if journal.epoch > record.epoch:
        return None, f"it was journaled at epoch {journal.epoch}, after the record's {record.epoch}"
    if not journal.extends(record):
        return None, ""  # a later checkpoint holds it: spent
    # The journal may span batches a debounced save left out: its reply is the last of them.
    if (
        journal.batch != journal.counters.tool_batches
        or journal.batch < record.counters.tool_batches
    ):
        return None, (
            f"its reply is batch {journal.batch} (its counters say "
            f"{journal.counters.tool_batches}) after a record at batch "
            f"{record.counters.tool_batches}"
        )
    return journal, ""


def calls_since(entries: dict[str, LedgerEntry], batch: int) -> list[tuple[str, LedgerEntry]]:
    """The ledger's calls of ``batch`` and later ones (keys ``<batch>.<index>.<digest>``), in
    order: what a refused journal may have run that the record does not hold."""

    def place(key: str) -> tuple[int, int]:
        b, i, _ = (*key.split(".", 2), "", "")[:3]
        return (int(b), int(i)) if b.isdigit() and i.isdigit() else (-1, -1)  # not a call key

    return sorted(
        ((k, e) for k, e in entries.items() if place(k)[0] >= batch), key=lambda ke: place(ke[0])
    )


def lost_reply_note(why: str, calls: list[tuple[str, LedgerEntry]]) -> str:
    """What the model is told when its journaled reply was refused on resume: that it was
    lost, and what became of each call the ledger holds for it, so nothing it may have done
    goes unmentioned (a call caught in flight or of unknown fate is ``outcome_unknown``)."""
    parts = []
    for key, entry in calls:
        if entry.state in ("committed", "failed") and entry.result is not None:
            parts.append(
                f"{entry.name} (call key {key}): finished, {entry.result.status}: "
                f"{entry.result.output[:200]}"
            )
        elif entry.state == "prepared":
            parts.append(f"{entry.name} (call key {key}): never started")
        else:
            parts.append(
                f"{entry.name} (call key {key}): outcome_unknown, it may or may not "
                "have taken effect and will not be re-run"
            )
    calls_said = "; ".join(parts) if parts else "none of its calls had started"
    return (
        f"{LOST_REPLY_PREFIX} Your replies since this point, which asked for tools, were lost in "
        f"a crash and could not be recovered ({why}). What their calls did: {calls_said}. Do "
        "not assume a call whose outcome is unknown did not happen."
    )
