"""What a new turn is made of: its spec and first record, alone or as the next turn of a session.

A session's next turn starts from the previous turn's final transcript as its baseline (what
was saved wins, the new user message is appended after it), with the meta kept index-aligned
and the pre-turn meta as it was; ``store.sessions`` opens it atomically.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from actors.engine.agents import check_agent
from actors.turn.agent import Agent
from bus.phase import TurnPhase
from store.keys import check_turn_id
from store.records import (
    CheckpointRecord,
    Message,
    MessageMeta,
    SaveReason,
    TurnInput,
    TurnSpec,
)
from store.sessions import Builder

__all__ = ["initial_record", "new_turns", "session_turn"]


def initial_record(
    turn_id: str, session_id: str, agent: Agent, turn_input: TurnInput, *, now_ms: int
) -> CheckpointRecord:
    """The record a turn is created with: the pre-turn baseline, nothing run yet."""
    messages: list[Message] = []
    meta: list[MessageMeta] = []
    if agent.system_prompt:
        messages.append(Message(role="system", text=agent.system_prompt))
        meta.append(MessageMeta(source="prompt", message_id=f"{turn_id}:system", at_ms=now_ms))
    messages.append(Message(role="user", text=turn_input.message))
    meta.append(_user_meta(turn_id, now_ms))
    return _first_record(turn_id, session_id, messages, meta, now_ms=now_ms)


def _first_record(
    turn_id: str,
    session_id: str,
    messages: Sequence[Message],
    meta: Sequence[MessageMeta],
    *,
    now_ms: int,
) -> CheckpointRecord:
    """A record at submission: all of ``messages`` is the pre-turn baseline."""
    return CheckpointRecord.model_validate(
        {
            "turn_id": turn_id,
            "session_id": session_id,
            "epoch": 1,
            "seq": 0,
            "phase": TurnPhase.INIT,
            "in_progress": True,
            "reason": SaveReason.SUBMITTED,
            "messages": messages,
            "meta": meta,
            "baseline": len(messages),
            "counters": {},
            "updated_at": now_ms,
        }
    )


def new_turns(
    agent_path: str,
    turn_input: TurnInput,
    turn_ids: Iterable[str],
    *,
    session_id: str | None = None,
) -> list[tuple[TurnSpec, CheckpointRecord]]:
    """Specs and first records of turns, ready for ``RedisCheckpointStore.submit_many``; the
    agent is loaded and checks the input first (:class:`ConfigError` if either is bad)."""
    agent = check_agent(agent_path, turn_input)
    now = int(time.time() * 1000)
    out = []
    for turn_id in turn_ids:
        check_turn_id(turn_id)
        session = session_id or f"session-{turn_id}"
        spec = TurnSpec(
            turn_id=turn_id, session_id=session, agent=agent_path, input=turn_input, created_at=now
        )
        out.append((spec, initial_record(turn_id, session, agent, turn_input, now_ms=now)))
    return out


def session_turn(agent_path: str, turn_input: TurnInput, session_id: str) -> Builder:
    """How ``store.sessions.Sessions.open`` builds the session's next turn of ``agent`` on
    ``turn_input``: the agent is loaded and checks the input first (:class:`ConfigError`)."""
    agent = check_agent(agent_path, turn_input)

    def build(previous: CheckpointRecord | None, turn_id: str) -> tuple[TurnSpec, CheckpointRecord]:
        now = int(time.time() * 1000)
        spec = TurnSpec(
            turn_id=turn_id, session_id=session_id, agent=agent_path, input=turn_input,
            created_at=now,
        )  # fmt: skip
        if previous is None:
            return spec, initial_record(turn_id, session_id, agent, turn_input, now_ms=now)
        return spec, _first_record(
            turn_id,
            session_id,
            (*previous.messages, Message(role="user", text=turn_input.message)),
            (*previous.meta, _user_meta(turn_id, now)),
            now_ms=now,
        )

    return build


def _user_meta(turn_id: str, now_ms: int) -> MessageMeta:
    return MessageMeta(source="prompt", message_id=f"{turn_id}:user", at_ms=now_ms)
