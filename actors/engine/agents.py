"""Loading agents by import path (``"pkg.module:name"``), once per process.

The path is what a turn's spec stores, so a host on any node imports the very agent the turn was
submitted with. A path that does not import, or names something that is not an
:class:`~actors.turn.agent.Agent`, is a :class:`~bus.errors.ConfigError` raised at submission
(``check_agent``), never first seen on a host.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from enum import StrEnum

from actors.engine.imports import load_by_path
from actors.turn.agent import Agent, ModelContext
from actors.turn.tools import ToolRegistry
from bus.errors import ConfigError
from bus.events import LiveEvent, Recovering
from bus.outcomes import Action, EngineProblem
from store.records import CheckpointRecord, TurnInput

log = logging.getLogger(__name__)

__all__ = [
    "AgentChange",
    "AgentChanged",
    "agent_fingerprint",
    "agent_problem",
    "check_agent",
    "load_agent",
    "noted_agent",
    "record_on",
    "refuse_unrunnable",
]


class AgentChange(StrEnum):
    """What a turn resumed under a different agent (``[loop] on_agent_change``) does."""

    CONTINUE = "continue"
    """Go on with the agent as it is now; the change is noted in the turn and published."""
    SUSPEND = "suspend"
    """Park the turn (``suspended:agent_changed``) for a person to decide: ``phaseline resume
    TURN`` runs it on the agent as it is then."""


class AgentChanged(Exception):
    """A turn resumed under another agent than it started with, and the deployment says to
    suspend it (:attr:`AgentChange.SUSPEND`)."""


def noted_agent(
    record: CheckpointRecord, fingerprint: str, policy: AgentChange
) -> tuple[CheckpointRecord, str]:
    """``record`` with the agent it runs on noted, and the change ("" if none). A resume under
    another agent than the turn started with (an upgrade of its module mid-turn) goes on with
    the change noted in the turn, or raises :class:`AgentChanged` (``policy``)."""
    c = record.counters
    if c.agent_fingerprint == fingerprint:
        return record, ""
    if not c.agent_fingerprint:  # its first start (or accepted by an operator's resume)
        noted = c.model_copy(update={"agent_fingerprint": fingerprint})
        return record.model_copy(update={"counters": noted}), ""
    change = f"{c.agent_fingerprint} -> {fingerprint} at epoch {record.epoch}"
    if policy is AgentChange.SUSPEND:
        raise AgentChanged(change)
    counters = c.model_copy(
        update={"agent_fingerprint": fingerprint, "agent_changes": (*c.agent_changes, change)}
    )
    return record.model_copy(update={"counters": counters}), change


#: The last fingerprints by the identity of (agent, registry), with both kept alive so an id
#: is not reused: a turn whose agent has no per-turn tools gets the agent's own registry, so
#: every start of it would hash the same JSON again.
_FINGERPRINTS: dict[tuple[int, int], tuple[Agent, ToolRegistry, str]] = {}
_FINGERPRINTS_KEPT = 64


def agent_fingerprint(agent: Agent, tools: ToolRegistry) -> str:
    """A short hash of what the model sees of an agent: its model's name, system prompt, and
    each tool's name, description, argument schema and flags. Two turns with one fingerprint
    ran the same agent as far as the transcript can tell. Both are immutable, so the hash of
    one pair is computed once."""
    key = (id(agent), id(tools))
    kept = _FINGERPRINTS.get(key)
    if kept is not None and kept[0] is agent and kept[1] is tools:
        return kept[2]
    if len(_FINGERPRINTS) >= _FINGERPRINTS_KEPT:
        _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
    fingerprint = _fingerprint(agent, tools)
    _FINGERPRINTS[key] = (agent, tools, fingerprint)
    return fingerprint


def _fingerprint(agent: Agent, tools: ToolRegistry) -> str:
    shape = {
        "model": agent.model_name,
        "system": agent.system_prompt,
        "tools": sorted(
            [
                spec.name,
                spec.description,
                dict(spec.parameters),
                spec.idempotent,
                spec.requires_approval,
            ]
            for spec in tools
        ),
    }
    blob = json.dumps(shape, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def load_agent(path: str) -> Agent:
    """The agent at ``path``; cached, so every turn of a process shares one."""
    agent = load_by_path(path, "agent")
    if not isinstance(agent, Agent):
        raise ConfigError(f"agent {path!r}: {path} is a {type(agent).__name__}, not an Agent")
    return agent


def check_agent(path: str, turn_input: TurnInput) -> Agent:
    """Load the agent and let it check the input: what every submission does first."""
    agent = load_agent(path)
    agent.check_input(turn_input)
    return agent


def refuse_unrunnable(path: str, turn_input: TurnInput) -> None:
    """:class:`ConfigError` if a turn of this agent cannot start in this process, which is to
    run it (:func:`agent_problem`): refused before anything is written, or it would wait for
    ever in ``init``."""
    problem = agent_problem(path, turn_input)
    if problem:
        raise ConfigError(f"{problem}; this process runs the turns, so none was written")


def agent_problem(path: str, turn_input: TurnInput) -> str:
    """Why a turn of this agent cannot start in this process ("" if it can): what a host does
    before it runs one (import the agent, build its model client, which reads its variables),
    without running anything. A deployment asks one of its hosts at submission, where the
    submitter's own environment proves nothing."""
    try:
        agent = check_agent(path, turn_input)
        agent.client(ModelContext("check", turn_input, 0))
    except ConfigError as exc:
        return str(exc)
    return ""


def record_on(
    record: CheckpointRecord,
    agent: str,
    fingerprint: str,
    policy: AgentChange,
    *,
    on_event: Callable[[LiveEvent], None] | None = None,
) -> CheckpointRecord:
    """``record`` as it starts on ``agent`` here: the agent named (a record of schema 2 names
    none), its failures to load in a row ended (it loads here), and the agent it runs on noted
    (:func:`noted_agent`), a change logged and published."""
    if record.agent != agent:
        record = record.model_copy(update={"agent": agent})
    if record.counters.agent_failures:
        counters = record.counters.model_copy(update={"agent_failures": 0})
        record = record.model_copy(update={"counters": counters})
    record, change = noted_agent(record, fingerprint, policy)
    if change:
        log.warning("turn %s resumes under a changed agent: %s", record.turn_id, change)
        if on_event is not None:
            on_event(
                Recovering(
                    record.turn_id,
                    record.epoch,
                    EngineProblem.AGENT_CHANGED,
                    Action.CONTINUE,
                    f"the agent changed ({change}); going on with it",
                    int(time.time() * 1000),
                )
            )
    return record
