"""Builders of small valid records for tests."""

from __future__ import annotations

import redis.asyncio as aioredis

from bus.messages import Message
from bus.phase import TurnPhase
from store.codec import encode_record, pack_model
from store.keys import KeyLayout
from store.records import CheckpointRecord, Counters, LedgerEntry, MessageMeta
from store.write.transcript import Transcript


def record(
    turn_id: str = "t1",
    *,
    epoch: int = 1,
    seq: int = 1,
    n_turn_messages: int = 0,
    in_progress: bool = True,
    reason: str = "tool_batch",
) -> CheckpointRecord:
    msgs = [Message(role="system", text="sys"), Message(role="user", text="hi")]
    meta = [
        MessageMeta(source="prompt", message_id="m0", at_ms=1),
        MessageMeta(source="prompt", message_id="m1", at_ms=2),
    ]
    for i in range(n_turn_messages):
        msgs.append(Message(role="assistant", text=f"reply {i}"))
        meta.append(MessageMeta(source="llm", message_id=f"r{i}", at_ms=10 + i))
    return CheckpointRecord(
        turn_id=turn_id,
        session_id="s1",
        epoch=epoch,
        seq=seq,
        phase=TurnPhase.EXECUTING_TOOLS,
        in_progress=in_progress,
        reason=reason,
        messages=tuple(msgs),
        meta=tuple(meta),
        baseline=2,
        counters=Counters(tool_batches=n_turn_messages),
        updated_at=1000,
    )


async def put_ledger(
    client: aioredis.Redis, keys: KeyLayout, turn_id: str, entries: dict[str, LedgerEntry]
) -> None:
    """Leave ledger entries as a host that died would have (a plain HSET, no fence)."""
    mapping = {k: pack_model(e) for k, e in entries.items()}
    await client.hset(keys.tools(turn_id), mapping=mapping)  # type: ignore[arg-type]


async def put_record(client: aioredis.Redis, keys: KeyLayout, rec: CheckpointRecord) -> None:
    """Write a record and its bodies as a forger would: plain HSETs, no fence, no event."""
    transcript = Transcript.of(rec.messages, rec.meta)
    await client.hset(keys.bodies(rec.turn_id), mapping=transcript.bodies)  # type: ignore[arg-type]
    await client.delete(keys.turn(rec.turn_id))
    await client.hset(keys.turn(rec.turn_id), mapping=encode_record(rec, transcript))  # type: ignore[arg-type]
