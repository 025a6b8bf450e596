"""Turns at a glance: a page of the turns index with each turn's summary, filtered.

What ``phaseline turns`` and the web console's list show. The list walks the turns index
(``KeyLayout.turns``: one sorted set per shard, turn ids scored by submission time) newest
first and reads only the few record fields a row needs (``HMGET``: no transcript is loaded),
so a page costs the same with ten turns in the store or a hundred thousand: its reads are
bounded by the page, plus at most ``scan`` candidates when a filter is narrow.

Paging is by a cursor (``Cursor``: the submission time and turn id of the last row), not by an
offset, so turns submitted while someone pages do not shift the pages. Many turns share one
millisecond (a run submits hundreds at once), so the cursor keeps the turn id too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import cast

from bus.errors import RecordError
from bus.events import BadBusEntry, decode_event
from bus.outcomes import Outcome, OutcomeKind
from bus.phase import Transition, TurnPhase
from store.codec import unpack_model
from store.keys import KeyLayout
from store.records import Counters, TurnError
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text
from store.views.shard_sums import summed

__all__ = [
    "Cursor",
    "TurnFilter",
    "TurnPage",
    "TurnSummary",
    "live_phases",
    "phase_counts",
    "summaries",
    "turn_page",
]

#: The record fields a summary reads, in this order.
_FIELDS = ("session_id", "agent", "in_progress", "phase", "epoch", "seq", "counters", "updated_at")


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """One turn as a list row shows it."""

    turn_id: str
    """The turn."""
    session_id: str
    """Its session ("" for none)."""
    agent: str
    """Its agent's import path ("" for records older than agents)."""
    submitted_at_ms: int
    """When it was submitted (its score in the turns index)."""
    updated_at_ms: int
    """When its latest record was written."""
    in_progress: bool
    """Whether it still runs (a suspended turn is in progress: it waits for an operator)."""
    phase: TurnPhase
    """The phase of its latest record."""
    epoch: int
    """Its owner incarnation (1 for a turn never resumed)."""
    seq: int
    """Its latest checkpoint's number."""
    outcome: Outcome | None
    """How it ended (or why it is parked); None while it runs."""
    tokens: int
    """Tokens its model calls used, as the endpoints reported them."""
    resumes: int
    """Times it was resumed after losing its host."""
    last_error: TurnError | None
    """Its last model or tool error, if any."""

    @property
    def status(self) -> str:
        """``running (<phase>)``, or its outcome."""
        if self.outcome is not None and (self.outcome.suspended or not self.in_progress):
            return self.outcome.value
        return f"running ({self.phase.value})" if self.in_progress else "final"


#: The furthest back a filter by age may look, in seconds (ten years): a larger number (or
#: ``inf``) would overflow the unix-ms arithmetic of the bound.
MAX_LOOKBACK_S = 10 * 365 * 86_400


@dataclass(frozen=True, slots=True)
class TurnFilter:
    """Which turns a list shows; an unset field admits every turn."""

    session: str | None = None
    """Only this session's turns."""
    agent: str | None = None
    """Only turns of this agent (its import path)."""
    phase: TurnPhase | None = None
    """Only running turns in this phase."""
    outcome: str | None = None
    """Only turns that ended so: an outcome kind (``aborted``) or a whole outcome
    (``aborted:retryable``)."""
    since_ms: int = 0
    """Only turns submitted at or after this time (unix ms)."""

    def __post_init__(self) -> None:
        if self.outcome is not None:
            kind, _, _cause = self.outcome.partition(":")
            if kind not in OutcomeKind.__members__.values():
                raise ValueError(f"unknown outcome {self.outcome!r}")

    def admits(self, s: TurnSummary) -> bool:
        if self.session is not None and s.session_id != self.session:
            return False
        if self.agent is not None and s.agent != self.agent:
            return False
        if self.phase is not None and (not s.in_progress or s.phase is not self.phase):
            return False
        if self.outcome is not None:
            got = s.outcome
            return got is not None and self.outcome in (got.value, got.kind.value)
        return True

    @property
    def narrow(self) -> bool:
        """Whether it may leave rows out (then a page scans more candidates than it shows)."""
        return any(v is not None for v in (self.session, self.agent, self.phase, self.outcome))


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """Where a page ended: the last row's place in the newest-first order."""

    at_ms: int
    """Its submission time."""
    turn_id: str
    """Its id (turns submitted in one millisecond are ordered by id)."""

    def wire(self) -> str:
        return f"{self.at_ms}:{self.turn_id}"

    @classmethod
    def parse(cls, raw: str) -> Cursor:
        """Read a cursor back (``ValueError`` for anything else)."""
        at, sep, turn_id = raw.partition(":")
        if not sep or not at.isdigit() or not turn_id:
            raise ValueError(f"not a cursor: {raw[:80]!r}")
        return cls(int(at), turn_id)

    def before(self, at_ms: int, turn_id: str) -> bool:
        """Whether a turn comes after this cursor in the newest-first order."""
        return at_ms < self.at_ms or (at_ms == self.at_ms and turn_id > self.turn_id)


@dataclass(frozen=True, slots=True)
class TurnPage:
    """One page of the list."""

    rows: list[TurnSummary]
    """The turns, newest first."""
    next: Cursor | None
    """Where the next (older) page starts; None at the end of the index."""
    scanned: int
    """Index entries read to fill it (more than the rows when a filter left some out)."""
    gone: int = 0
    """Indexed turns whose record expired or was purged meanwhile (left out)."""
    shown_counts: dict[str, int] = field(default_factory=dict)
    """Rows per status (what the page itself shows)."""


def _summary(turn_id: str, at_ms: int, values: list[bytes | None]) -> TurnSummary | None:
    """A summary from the record's fields, or None if the record is gone (expired, purged).
    An unreadable record is summarised as far as it can be: the list must not fail on it."""
    if values[0] is None and values[3] is None:
        return None
    raw = dict(zip(_FIELDS, values, strict=True))
    counters = Counters()
    if raw["counters"] is not None:
        with contextlib.suppress(RecordError):  # the row shows no counters, the list goes on
            counters = unpack_model(Counters, raw["counters"], key=f"counters of {turn_id}")
    try:
        phase = TurnPhase(text(raw["phase"] or b"init"))
    except ValueError:
        phase = TurnPhase.INIT
    return TurnSummary(
        turn_id=turn_id,
        session_id=text(raw["session_id"] or b""),
        agent=text(raw["agent"] or b""),
        submitted_at_ms=at_ms,
        updated_at_ms=_int(raw["updated_at"]),
        in_progress=text(raw["in_progress"] or b"0") == "1",
        phase=phase,
        epoch=_int(raw["epoch"]),
        seq=_int(raw["seq"]),
        outcome=counters.outcome,
        tokens=counters.tokens.total,
        resumes=counters.resume_attempts,
        last_error=counters.last_error,
    )


def _int(raw: bytes | None) -> int:
    value = text(raw or b"0")
    return int(value) if value.lstrip("-").isdigit() else 0


async def summaries(
    client: StoreClient, keys: KeyLayout, turns: list[tuple[str, int]]
) -> list[TurnSummary | None]:
    """The summary of each ``(turn id, submission ms)``, in order (None: its record is gone).
    One pipelined ``HMGET`` per turn."""
    if not turns:
        return []
    with translated("read turn summaries"):
        async with client.pipeline(transaction=False) as pipe:
            for turn_id, _ in turns:
                pipe.hmget(keys.turn(turn_id), list(_FIELDS))
            rows = cast(list[list[bytes | None]], await pipe.execute())
    return [_summary(t, at, row) for (t, at), row in zip(turns, rows, strict=True)]


async def _candidates(
    client: StoreClient, keys: KeyLayout, after: Cursor | None, since_ms: int, n: int
) -> list[tuple[str, int]]:
    """The next ``n`` index entries after ``after``, newest first, merged over the shards."""
    top: int | str = "+inf" if after is None else after.at_ms
    with translated("list turns"):
        tied = [0] * len(keys.all_shards())
        if after is not None:  # entries at the cursor's very millisecond come back too
            async with client.pipeline(transaction=False) as pipe:
                for shard in keys.all_shards():
                    pipe.zcount(keys.turns(shard), after.at_ms, after.at_ms)
                tied = [int(c) for c in await pipe.execute()]
        async with client.pipeline(transaction=False) as pipe:
            for shard in keys.all_shards():
                pipe.zrevrangebyscore(
                    keys.turns(shard),
                    top,
                    since_ms,
                    start=0,
                    num=n + tied[shard],
                    withscores=True,
                )
            shards = await pipe.execute()
    rows = (
        (int(score), text(member))
        for entries in shards
        for member, score in cast(list[tuple[bytes, float]], entries)
    )
    fresh = (r for r in rows if after is None or after.before(*r))
    return [(t, at) for at, t in heapq.nsmallest(n, fresh, key=lambda r: (-r[0], r[1]))]


async def live_phases(
    client: StoreClient, keys: KeyLayout, turn_ids: list[str], *, look_back: int = 50
) -> dict[str, TurnPhase]:
    """The phase each turn's last transition entered, for the running turns of a page (one
    pipelined read of the last ``look_back`` entries of each live stream)."""
    if not turn_ids:
        return {}
    with translated("read live phases"):
        async with client.pipeline(transaction=False) as pipe:
            for turn_id in turn_ids:
                pipe.xrevrange(keys.live(turn_id), count=look_back)
            streams = await pipe.execute()
    found: dict[str, TurnPhase] = {}
    for turn_id, entries in zip(turn_ids, streams, strict=True):
        for _entry_id, fields in entries or []:
            if fields.get(b"kind") == b"transition":
                with contextlib.suppress(BadBusEntry):
                    event = decode_event(fields)
                    if isinstance(event, Transition):
                        found[turn_id] = event.dst
                break
    return found


async def turn_page(
    client: StoreClient,
    keys: KeyLayout,
    *,
    where: TurnFilter = TurnFilter(),
    after: Cursor | None = None,
    limit: int = 50,
    scan: int = 5000,
) -> TurnPage:
    """Up to ``limit`` turns that ``where`` admits, newest first, after ``after``; at most
    ``scan`` index entries are read (a narrow filter over a large store stops there and
    says where to go on)."""
    rows: list[TurnSummary] = []
    scanned = gone = 0
    cursor = after
    exhausted = False
    while len(rows) < limit and scanned < scan:
        batch = min(max(limit - len(rows), 50 if where.narrow else 0, 1), scan - scanned)
        found = await _candidates(client, keys, cursor, where.since_ms, batch)
        rows_read = await summaries(client, keys, found)
        # A record's phase is its last checkpoint's; a running turn's last transition says
        # where it is now (waiting for an approval, retrying), which a filter by phase means.
        live = await live_phases(
            client, keys, [s.turn_id for s in rows_read if s is not None and s.in_progress]
        )
        rows_read = [
            s
            if s is None or s.turn_id not in live
            else dataclasses.replace(s, phase=live[s.turn_id])
            for s in rows_read
        ]
        for (turn_id, at), summary in zip(found, rows_read, strict=True):
            scanned += 1
            cursor = Cursor(at, turn_id)
            if summary is None:
                gone += 1
            elif where.admits(summary):
                rows.append(summary)
                if len(rows) == limit:
                    break
        if len(found) < batch:
            exhausted = True
            break
    more = not exhausted and cursor is not None
    return TurnPage(
        rows=rows,
        next=cursor if more else None,
        scanned=scanned,
        gone=gone,
        shown_counts=dict(Counter(r.status for r in rows)),
    )


async def phase_counts(client: StoreClient, keys: KeyLayout) -> dict[TurnPhase, int]:
    """Turns in progress per phase of their latest record (suspended ones under the phase
    they stopped in), as the save script counts them (``KeyLayout.phases``): one read per
    shard, whatever the number of turns. Records saved before these counts existed are not
    in them until their next save; a count never shows below 0."""
    counts = await summed(client, keys, keys.phases, "the phase counts")
    return {
        TurnPhase(phase): n
        for phase, n in counts.items()
        if phase in TurnPhase.__members__.values() and n > 0
    }
