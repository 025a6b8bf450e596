"""What a new turn is made of: its spec and first record, alone or as the next turn of a session.

A session's next turn starts from the previous turn's final transcript as its baseline (what
was saved wins, the new user message is appended after it), with the meta kept index-aligned
and the pre-turn meta as it was; ``store.domain.sessions`` opens it atomically.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from actors.engine.agents import check_agent
from actors.turn.agent import Agent
from bus.errors import BudgetExhausted, ConfigError
from bus.messages import Message, Usage
from bus.outcomes import SaveReason
from bus.phase import TurnPhase
from store.domain.sessions import Builder
from store.keys import check_turn_id
from store.records import CheckpointRecord, MessageMeta, QueuedTurn, TurnInput, TurnSpec

__all__ = ["initial_record", "new_turns", "queued_turn", "session_tokens", "session_turn"]


def initial_record(
    turn_id: str,
    session_id: str,
    agent: Agent,
    turn_input: TurnInput,
    *,
    now_ms: int,
    agent_path: str = "",
) -> CheckpointRecord:
    """The record a turn is created with: the pre-turn baseline, nothing run yet."""
    messages: list[Message] = []
    meta: list[MessageMeta] = []
    if agent.system_prompt:
        messages.append(Message(role="system", text=agent.system_prompt))
        meta.append(MessageMeta(source="prompt", message_id=f"{turn_id}:system", at_ms=now_ms))
    messages.append(Message(role="user", text=turn_input.message))
    meta.append(_user_meta(turn_id, now_ms))
    return _first_record(turn_id, session_id, agent_path, messages, meta, now_ms=now_ms)


def _first_record(
    turn_id: str,
    session_id: str,
    agent_path: str,
    messages: Sequence[Message],
    meta: Sequence[MessageMeta],
    *,
    now_ms: int,
    session_prior: Usage | None = None,
) -> CheckpointRecord:
    """A record at submission: all of ``messages`` is the pre-turn baseline."""
    return CheckpointRecord.model_validate(
        {
            "turn_id": turn_id,
            "session_id": session_id,
            "agent": agent_path,
            "epoch": 1,
            "seq": 0,
            "phase": TurnPhase.INIT,
            "in_progress": True,
            "reason": SaveReason.SUBMITTED,
            "messages": messages,
            "meta": meta,
            "baseline": len(messages),
            "counters": {"session_prior": session_prior or Usage()},
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
        if "/" in check_turn_id(turn_id):
            raise ConfigError(
                f"turn id {turn_id!r}: ids of the form <session>/<n> are a session's own; "
                "open a session's turn with --session (Runtime.submit(session=...))"
            )
        session = session_id or f"session-{turn_id}"
        spec = TurnSpec(
            turn_id=turn_id, session_id=session, agent=agent_path, input=turn_input, created_at=now
        )
        out.append(
            (
                spec,
                initial_record(
                    turn_id, session, agent, turn_input, now_ms=now, agent_path=agent_path
                ),
            )
        )
    return out


def session_turn(agent_path: str, turn_input: TurnInput, session_id: str) -> Builder:
    """How ``store.domain.sessions.Sessions.open`` builds the session's next turn of ``agent`` on
    ``turn_input``: the agent is loaded and checks the input first (:class:`ConfigError`); a
    session that spent its agent's token budget opens no more (:class:`BudgetExhausted`)."""
    agent = check_agent(agent_path, turn_input)

    def build(previous: CheckpointRecord | None, turn_id: str) -> tuple[TurnSpec, CheckpointRecord]:
        now = int(time.time() * 1000)
        spec = TurnSpec(
            turn_id=turn_id,
            session_id=session_id,
            agent=agent_path,
            input=turn_input,
            created_at=now,
        )
        if previous is None:
            first = initial_record(
                turn_id, session_id, agent, turn_input, now_ms=now, agent_path=agent_path
            )
            return spec, first
        prior = session_tokens(previous)
        budget = agent.settings.max_tokens_per_session
        if budget is not None and prior.total >= budget:
            raise BudgetExhausted(
                f"session {session_id} has used {prior.total:,} tokens of its agent's budget of "
                f"{budget:,} per session; it opens no more turns",
                prior.total,
                budget,
            )
        return spec, _first_record(
            turn_id,
            session_id,
            agent_path,
            (*previous.messages, Message(role="user", text=turn_input.message)),
            (*previous.meta, _user_meta(turn_id, now)),
            now_ms=now,
            session_prior=prior,
        )

    return build


def queued_turn(session_id: str) -> Callable[[QueuedTurn], Builder]:
    """How ``store.domain.sessions.Sessions.open_queued`` builds the session's next queued turn."""
    return lambda queued: session_turn(queued.agent, queued.input, session_id)


def session_tokens(latest: CheckpointRecord) -> Usage:
    """Tokens of a session's turns up to and including ``latest`` (its newest turn)."""
    return latest.counters.session_prior.plus(latest.counters.tokens)


def _user_meta(turn_id: str, now_ms: int) -> MessageMeta:
    return MessageMeta(source="prompt", message_id=f"{turn_id}:user", at_ms=now_ms)
