"""What each console page shows, read from Redis (and from the deployment when attached).

Plain frozen values the templates render; nothing here writes. The same records and events
the CLI reads (``store.views.summaries`` for the list, the record, ledger and approvals for a turn,
its live stream for the timeline, ``actors.cluster.status`` for the deployment).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from actors.cluster.runtime import Runtime
from actors.cluster.status import DeploymentStatus, deployment_status
from actors.console.timeline import Row, read_timeline
from bus.errors import RecordError, RecordNotFound
from bus.messages import Message, Usage
from bus.outcomes import Outcome
from bus.phase import TurnPhase
from store.domain.approvals import Approvals
from store.domain.ledger import ToolLedger
from store.domain.limiter import EndpointLimiter, EndpointState
from store.domain.pools import PoolSizes
from store.domain.usage import AgentUsage, agent_usage, outcome_counts
from store.keys import KeyLayout
from store.records import Approval, CheckpointRecord, LedgerEntry, MessageMeta, TurnSpec
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text
from store.views.summaries import Cursor, TurnFilter, TurnPage, phase_counts, turn_page
from store.write.checkpoint import RedisCheckpointStore

__all__ = [
    "DeploymentView",
    "LedgerRow",
    "ListView",
    "MessageRow",
    "TurnView",
    "deployment_view",
    "list_view",
    "turn_view",
]

#: Characters of a message, argument list or result a row shows before "show all".
SHORT = 600


@dataclass(frozen=True, slots=True)
class ListView:
    """The turns page."""

    page: TurnPage
    """The rows and where the next page starts."""
    where: TurnFilter
    """The filter it was read with."""
    running: dict[TurnPhase, int]
    """Turns in progress per phase."""
    outcomes: dict[Outcome, int]
    """Finished turns per outcome, all time."""
    indexed: int
    """Turns in the index (what retention has not expired)."""


async def list_view(
    client: StoreClient,
    keys: KeyLayout,
    where: TurnFilter,
    after: Cursor | None,
    *,
    limit: int,
    scan: int,
) -> ListView:
    page = await turn_page(client, keys, where=where, after=after, limit=limit, scan=scan)
    with translated("count indexed turns"):
        async with client.pipeline(transaction=False) as pipe:
            for shard in keys.all_shards():
                pipe.zcard(keys.turns(shard))
            indexed = sum(int(n) for n in await pipe.execute())
    return ListView(
        page=page,
        where=where,
        running=await phase_counts(client, keys),
        outcomes=await outcome_counts(client, keys),
        indexed=indexed,
    )


@dataclass(frozen=True, slots=True)
class MessageRow:
    """One message of the transcript with its meta."""

    index: int
    """Its place in the transcript."""
    message: Message
    """The message."""
    meta: MessageMeta
    """Where it came from, when, its usage, an approval."""
    before_turn: bool
    """Part of the baseline (the session's earlier turns, the system prompt)."""

    @property
    def usage(self) -> Usage | None:
        return self.meta.usage


@dataclass(frozen=True, slots=True)
class LedgerRow:
    """One tool call of the ledger."""

    call_key: str
    """Its stable key (the tool's idempotency key downstream)."""
    tool: str
    """The tool."""
    args: str
    """Its arguments as JSON, as the transcript holds them ("" when the call never reached
    the transcript's results: in flight at a crash)."""
    state: str
    """``prepared``, ``dispatched``, ``committed``, ``failed``, ``outcome_unknown``."""
    status: str
    """The result's status as the model read it ("" without a result)."""
    output: str
    """The result's text, cut short."""
    epoch: int
    """The owner epoch that wrote its state."""
    updated_at_ms: int
    """When its state last changed."""

    @property
    def unknown(self) -> bool:
        """Caught in flight by a crash and not re-run: its effect may or may not have
        happened."""
        return self.state == "outcome_unknown" or self.status == "outcome_unknown"


@dataclass(frozen=True, slots=True)
class TurnView:
    """A turn's page."""

    record: CheckpointRecord
    """Its latest record."""
    spec: TurnSpec | None
    """What was asked (None if its spec is gone)."""
    messages: list[MessageRow]
    """The transcript."""
    ledger: list[LedgerRow]
    """Its tool calls, oldest first."""
    waiting: dict[str, Approval]
    """Calls waiting for a decision, by call key."""
    decided: dict[str, Approval]
    """Calls decided, by call key."""
    timeline: list[Row]
    """What its live stream holds, as rows."""
    last_event: str
    """The live stream's last entry id: where the page's live updates go on from."""
    phase: TurnPhase
    """Its phase now: its last transition's, else its record's."""

    @property
    def suspended(self) -> bool:
        outcome = self.record.counters.outcome
        return outcome is not None and outcome.suspended

    @property
    def status(self) -> str:
        outcome = self.record.counters.outcome
        if outcome is not None and (outcome.suspended or not self.record.in_progress):
            return outcome.value
        return f"running ({self.phase.value})" if self.record.in_progress else "final"


def _ledger_rows(record: CheckpointRecord, entries: dict[str, LedgerEntry]) -> list[LedgerRow]:
    calls = {c.id: c for m in record.messages for c in m.tool_calls}
    rows = []
    for key, entry in entries.items():
        result = entry.result
        call = calls.get(result.call_id) if result is not None else None
        rows.append(
            LedgerRow(
                call_key=key,
                tool=entry.name,
                args="" if call is None else json.dumps(call.args, ensure_ascii=False)[:SHORT],
                state=entry.state,
                status="" if result is None else result.status,
                output="" if result is None else result.output[:SHORT],
                epoch=entry.epoch,
                updated_at_ms=entry.updated_at,
            )
        )
    return sorted(rows, key=lambda r: (r.updated_at_ms, r.call_key))


async def turn_view(client: StoreClient, keys: KeyLayout, turn_id: str) -> TurnView:
    """The turn's page; :class:`RecordNotFound` for no such turn, :class:`RecordError` for one
    whose record cannot be read (it is quarantined)."""
    store = RedisCheckpointStore(client, keys)
    record = await store.load(turn_id)
    try:
        spec: TurnSpec | None = await store.load_spec(turn_id)
    except (RecordNotFound, RecordError):
        spec = None
    entries = await ToolLedger(client, keys).entries(turn_id)
    approvals = await Approvals(client, keys).all(turn_id)
    timeline = await read_timeline(client, keys, turn_id)
    messages = [
        MessageRow(i, m, meta, i < record.baseline)
        for i, (m, meta) in enumerate(zip(record.messages, record.meta, strict=True))
    ]
    return TurnView(
        record=record,
        spec=spec,
        messages=messages,
        ledger=_ledger_rows(record, entries),
        waiting={k: a for k, a in approvals.items() if a.state == "pending"},
        decided={k: a for k, a in approvals.items() if a.state != "pending"},
        timeline=timeline.rows,
        last_event=timeline.last_id,
        phase=timeline.phase if record.in_progress and timeline.phase else record.phase,
    )


@dataclass(frozen=True, slots=True)
class DeploymentView:
    """The deployment page: what Redis knows, and what the actors say when attached."""

    namespace: str
    """The key namespace."""
    live: DeploymentStatus | None
    """Hosts, pools, rates, sampled from the actors (None: the console is not attached to a
    Ray cluster; then only what Redis holds is shown)."""
    generations: dict[int, int]
    """Host slot -> its current generation."""
    pool_sizes: dict[str, int]
    """Tool pool -> its size."""
    models: list[EndpointState]
    """Model endpoints: calls waiting, in flight, pauses."""
    agents: list[AgentUsage]
    """Agents' finished turns and tokens."""
    in_progress: int
    """Turns in progress."""
    respawns: int
    """Hosts the Supervisor replaced so far."""


async def deployment_view(
    client: StoreClient, keys: KeyLayout, runtime: Runtime | None
) -> DeploymentView:
    live = None if runtime is None else await deployment_status(runtime, sample_s=0.5)
    with translated("read the deployment"):
        raw_generations = await client.hgetall(keys.hosts())
        respawns = await client.hget(keys.supervisor(), "respawns")
    running = await phase_counts(client, keys)
    return DeploymentView(
        namespace=keys.namespace,
        live=live,
        generations={int(text(k)): int(text(v)) for k, v in sorted(raw_generations.items())},
        pool_sizes=await PoolSizes(client, keys, ttl_s=0).all(),
        models=await EndpointLimiter(client, keys).snapshot(),
        agents=await agent_usage(client, keys),
        in_progress=sum(running.values()),
        respawns=int(respawns or 0),
    )
