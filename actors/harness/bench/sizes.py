"""Synthetic transcripts of a chosen length, and what one checkpoint of them weighs.

The records are shaped like the scripted agent's (an assistant message with one tool call,
then its tool result, round after round) so sizes and costs match a real turn of that length.
"""

from __future__ import annotations

from typing import Any

from actors.engine.models.scripted import payload
from bus.messages import Message, ToolCall, ToolResult
from bus.phase import TurnPhase
from store.codec import EncodedRecord
from store.records import CheckpointRecord, MessageMeta
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.write.checkpoint import RedisCheckpointStore


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


async def checkpoint_sizes(
    client: StoreClient,
    store: RedisCheckpointStore,
    *,
    lengths: tuple[int, ...],
    payload_bytes: int,
) -> list[dict[str, Any]]:
    """Figure 6: per transcript length, what one save writes when two messages were added
    since the last one, against a full write of the record (what schema 1 sent at every save),
    what the turn holds in Redis, and the host-to-CheckpointActor wire form, against the
    transcript's own bytes."""
    rows = []
    for n in lengths:
        turn_id = f"bench-size-{n}"
        before = bench_record(turn_id, messages=n - 2, payload_bytes=payload_bytes)
        await store.save(before)
        record = bench_record(turn_id, messages=n, payload_bytes=payload_bytes, seq=2)
        delta = EncodedRecord.of(record, store.known)  # what the save below sends
        full = EncodedRecord.of(record)
        await store.save(record)
        with translated("measure record memory"):
            memory = 0
            for key in (store.keys.turn(turn_id), store.keys.bodies(turn_id)):
                memory += int(await client.memory_usage(key, samples=0) or 0)
        base = transcript_bytes(record)
        rows.append(
            {
                "messages": n,
                "transcript_bytes": base,
                "bytes_per_checkpoint": delta.sent_bytes,
                "full_record_bytes": full.sent_bytes,
                "redis_memory_bytes": memory,
                "wire_bytes": len(delta.to_wire()),
                "ratio_save_to_transcript": round(delta.sent_bytes / base, 3),
                "ratio_memory_to_transcript": round(memory / base, 3),
            }
        )
    first = rows[0]["bytes_per_checkpoint"] if rows else 0
    for row in rows:
        row["ratio_to_first_length"] = round(row["bytes_per_checkpoint"] / first, 2)
    return rows
