"""The turn list (``store.views.summaries``) and the outcome counts, on fakeredis, a real server and
a Redis Cluster, through both atomic save paths: what ``phaseline turns`` and the console show."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from bus.errors import StaleOwner
from bus.messages import Usage
from bus.outcomes import Outcome, Problem, SaveReason
from bus.phase import TurnPhase
from store.domain.usage import outcome_counts
from store.keys import KeyLayout
from store.records import CheckpointRecord, Counters, TurnSpec
from store.views.summaries import Cursor, TurnFilter, phase_counts, turn_page
from store.write.checkpoint import RedisCheckpointStore
from store.write.transaction import AtomicSave
from tests.support.records import record


@pytest.fixture(params=list(AtomicSave))
def store(
    request: pytest.FixtureRequest, any_client: aioredis.Redis, keys: KeyLayout
) -> RedisCheckpointStore:
    return RedisCheckpointStore(any_client, keys, atomic=AtomicSave(request.param))


async def _submit(
    store: RedisCheckpointStore, turn_id: str, at: int, *, session: str = "s1", agent: str = "a:b"
) -> CheckpointRecord:
    rec = record(turn_id).model_copy(
        update={"updated_at": at, "seq": 0, "session_id": session, "agent": agent}
    )
    spec = TurnSpec(turn_id=turn_id, session_id=session, agent=agent,
                    input={"message": "hi"}, created_at=at)  # fmt: skip
    await store.submit(spec, rec)
    return rec


async def _finish(store: RedisCheckpointStore, rec: CheckpointRecord, outcome: Outcome) -> None:
    counters = Counters(outcome=outcome, tokens=Usage(prompt_tokens=5), resume_attempts=1)
    await store.save(
        rec.model_copy(update={"seq": rec.seq + 1, "in_progress": False, "reason": SaveReason.FINAL,
                               "phase": TurnPhase.DONE, "counters": counters})
    )  # fmt: skip


async def test_pages_run_newest_first_and_a_cursor_splits_one_millisecond(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    # five turns submitted in the same millisecond, and two later ones: no row twice, none lost
    for i in range(5):
        await _submit(store, f"same{i}", 1000)
    await _submit(store, "late0", 2000)
    await _submit(store, "late1", 3000)
    seen: list[str] = []
    after = None
    while True:
        page = await turn_page(any_client, keys, after=after, limit=2)
        seen += [r.turn_id for r in page.rows]
        if page.next is None:
            break
        after = Cursor.parse(page.next.wire())
    assert seen == ["late1", "late0", "same0", "same1", "same2", "same3", "same4"]
    first = (await turn_page(any_client, keys, limit=1)).rows[0]
    assert (first.submitted_at_ms, first.status, first.in_progress) == (
        3000,
        "running (executing_tools)",
        True,
    )


async def test_filters_admit_by_session_agent_phase_and_outcome_kind(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    a = await _submit(store, "f-a", 1000, session="s1", agent="x:one")
    b = await _submit(store, "f-b", 2000, session="s2", agent="x:two")
    await _submit(store, "f-c", 3000, session="s2", agent="x:one")
    await _finish(store, a, Outcome.ANSWERED)
    await _finish(store, b, Outcome.aborted_by(Problem.RETRYABLE))

    async def ids(where: TurnFilter) -> list[str]:
        return [r.turn_id for r in (await turn_page(any_client, keys, where=where)).rows]

    assert await ids(TurnFilter(session="s2")) == ["f-c", "f-b"]
    assert await ids(TurnFilter(agent="x:one")) == ["f-c", "f-a"]
    assert await ids(TurnFilter(outcome="aborted")) == ["f-b"]
    assert await ids(TurnFilter(outcome="aborted:retryable")) == ["f-b"]
    assert await ids(TurnFilter(outcome="answered")) == ["f-a"]
    assert await ids(TurnFilter(phase=TurnPhase.EXECUTING_TOOLS)) == ["f-c"]
    assert await ids(TurnFilter(since_ms=2000)) == ["f-c", "f-b"]
    with pytest.raises(ValueError, match="unknown outcome"):
        TurnFilter(outcome="exploded")
    row = (await turn_page(any_client, keys, where=TurnFilter(outcome="answered"))).rows[0]
    assert (row.tokens, row.resumes, row.status) == (5, 1, "answered")


async def test_a_narrow_filter_stops_at_its_scan_bound_and_says_where_to_go_on(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    for i in range(12):
        await _submit(store, f"n{i:02d}", 1000 + i, session="busy")
    await _submit(store, "needle", 500, session="rare")
    page = await turn_page(any_client, keys, where=TurnFilter(session="rare"), scan=5)
    assert page.rows == [] and page.scanned == 5 and page.next is not None
    rest = await turn_page(any_client, keys, where=TurnFilter(session="rare"), after=page.next)
    assert [r.turn_id for r in rest.rows] == ["needle"] and rest.next is None


async def test_outcomes_are_counted_once_per_finished_turn(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    for i, outcome in enumerate((Outcome.ANSWERED, Outcome.ANSWERED, Outcome.CANCELLED)):
        rec = await _submit(store, f"o{i}", 1000 + i)
        await _finish(store, rec, outcome)
    with pytest.raises(StaleOwner):  # a zombie's late final save counts nothing
        await _finish(store, rec.model_copy(update={"epoch": 0}), Outcome.ANSWERED)
    await _submit(store, "running", 2000)
    assert await outcome_counts(any_client, keys) == {Outcome.ANSWERED: 2, Outcome.CANCELLED: 1}
    assert await phase_counts(any_client, keys) == {TurnPhase.EXECUTING_TOOLS: 1}


async def test_a_purged_turn_is_left_out_and_counted_as_gone(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    await _submit(store, "kept", 2000)
    await _submit(store, "purged", 1000)
    await any_client.delete(keys.turn("purged"))
    page = await turn_page(any_client, keys)
    assert [r.turn_id for r in page.rows] == ["kept"] and page.gone == 1


async def test_phase_counts_follow_each_turns_latest_record_and_ignore_refused_saves(
    store: RedisCheckpointStore, any_client: aioredis.Redis, keys: KeyLayout
) -> None:
    a = await _submit(store, "p-a", 1000)
    b = await _submit(store, "p-b", 1001)
    assert await phase_counts(any_client, keys) == {TurnPhase.EXECUTING_TOOLS: 2}
    waiting = a.model_copy(update={"seq": 1, "phase": TurnPhase.AWAITING_LLM})
    await store.save(waiting)
    assert await phase_counts(any_client, keys) == {
        TurnPhase.EXECUTING_TOOLS: 1, TurnPhase.AWAITING_LLM: 1,
    }  # fmt: skip
    with pytest.raises(StaleOwner):  # refused: moves nothing
        await store.save(waiting.model_copy(update={"epoch": 0, "seq": 9,
                                                    "phase": TurnPhase.COMPACTING}))  # fmt: skip
    assert (await store.save(waiting)).event_id  # a replay: moves nothing either
    await _finish(store, b, Outcome.ANSWERED)
    assert await phase_counts(any_client, keys) == {TurnPhase.AWAITING_LLM: 1}
    await _finish(store, waiting, Outcome.CANCELLED)
    assert await phase_counts(any_client, keys) == {}
