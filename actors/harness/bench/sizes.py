"""Synthetic transcripts of a chosen length, and what one checkpoint of them weighs.

The records are shaped like the scripted agent's (an assistant message with one tool call,
then its tool result, round after round) so sizes and costs match a real turn of that length.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from actors.cluster.checkpoint_actor import record_to_wire
from actors.engine.scripted import payload
from bus.phase import TurnPhase
from store.checkpoint import RedisCheckpointStore
from store.codec import encode_record
from store.connection import translated
from store.records import CheckpointRecord, Message, MessageMeta, ToolCall, ToolResult


def bench_record(
    turn_id: str, *, messages: int, payload_bytes: int, seq: int = 1
) -> CheckpointRecord:
    """A mid-turn record (after a tool batch) holding ``messages`` messages (at least 2)."""
    msgs = [
        Message(role="system", text="You are a phaseline bench agent."),
        Message(role="user", text="Run the bench task."),
    ]
    meta = [
        MessageMeta(source="prompt", message_id=f"{turn_id}:system", at_ms=0),
        MessageMeta(source="prompt", message_id=f"{turn_id}:user", at_ms=0),
    ]
    for i in range(len(msgs), max(messages, 2)):
        call_id = f"c{i // 2}"
        if i % 2 == 0:
            msgs.append(
                Message(
                    role="assistant",
                    text=payload(f"{turn_id}:{i}", payload_bytes),
                    tool_calls=(ToolCall(id=call_id, name="echo", args={"round": i // 2}),),
                )
            )
            meta.append(MessageMeta(source="llm", message_id=f"{turn_id}:{i}", at_ms=i))
        else:
            result = ToolResult(
                call_id=call_id, name="echo", status="ok", output=payload(call_id, payload_bytes)
            )
            msgs.append(Message(role="tool", tool_result=result))
            meta.append(MessageMeta(source="tool", message_id=f"{turn_id}:{i}", at_ms=i))
    return CheckpointRecord.model_validate(
        {
            "turn_id": turn_id,
            "session_id": f"session-{turn_id}",
            "epoch": 1,
            "seq": seq,
            "phase": TurnPhase.EXECUTING_TOOLS,
            "in_progress": True,
            "reason": "tool_batch",
            "messages": msgs,
            "meta": meta,
            "baseline": 2,
            "counters": {"tool_batches": (len(msgs) - 2) // 2},
            "updated_at": 1,
        }
    )


def transcript_bytes(record: CheckpointRecord) -> int:
    """UTF-8 bytes of what the model reads: message texts and tool outputs."""
    total = 0
    for m in record.messages:
        total += len(m.text.encode())
        if m.tool_result is not None:
            total += len(m.tool_result.output.encode())
    return total


def hash_bytes(record: CheckpointRecord) -> int:
    """Bytes of field names and values in the record's Redis hash."""
    total = 0
    for name, value in encode_record(record).items():
        v = value if isinstance(value, bytes) else str(value).encode()
        total += len(name) + len(v)
    return total


async def checkpoint_sizes(
    client: aioredis.Redis,
    store: RedisCheckpointStore,
    *,
    lengths: tuple[int, ...],
    payload_bytes: int,
) -> list[dict[str, Any]]:
    """Figure 6: per transcript length, the stored hash, its Redis memory and the wire form,
    against the transcript's own bytes."""
    rows = []
    for n in lengths:
        record = bench_record(f"bench-size-{n}", messages=n, payload_bytes=payload_bytes)
        await store.save(record)
        with translated("measure record memory"):
            memory = await client.memory_usage(store.keys.turn(record.turn_id), samples=0)
        base = transcript_bytes(record)
        stored = hash_bytes(record)
        rows.append(
            {
                "messages": n,
                "transcript_bytes": base,
                "hash_bytes": stored,
                "redis_memory_bytes": memory,
                "wire_bytes": len(record_to_wire(record)),
                "ratio_hash_to_transcript": round(stored / base, 3),
                "ratio_memory_to_transcript": round(int(memory or 0) / base, 3),
            }
        )
    return rows
