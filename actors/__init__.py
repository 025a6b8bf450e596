"""phaseline's public API: what a Python program needs to run turns on a cluster.

Everything here is re-exported from the layer that owns it (``actors.cluster``,
``actors.engine``, ``actors.turn``, ``store.records``, ``bus``), loaded on first use, so that
importing a pure layer such as ``actors.turn`` does not start importing Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: name -> module that defines it.
_EXPORTS = {
    # running turns
    "Runtime": "actors.cluster.runtime",
    "TurnEngine": "actors.engine.turn_engine",
    "RunStats": "actors.engine.turn_engine",
    "Settings": "actors.engine.settings.config",
    "load_settings": "actors.engine.settings.config",
    "Scenario": "actors.engine.models.scenario",
    "load_scenario": "actors.engine.models.scenario",
    "BUILTIN_TOOLS": "actors.engine.tools.builtin_tools",
    "scripted_turn": "actors.engine.models.scripted",
    "load_agent": "actors.engine.agents",
    "OpenAIChat": "actors.engine.models.openai_chat",
    "OpenAIResponses": "actors.engine.models.openai_responses",
    "FrontDesk": "actors.engine.front_desk",
    "SessionSubmit": "actors.engine.front_desk",
    "IfBusy": "store.domain.sessions",
    "Cancelled": "actors.engine.cancel",
    # agents
    "Agent": "actors.turn.agent",
    "AgentSettings": "actors.turn.agent",
    "ModelContext": "actors.turn.agent",
    "LoopThresholds": "actors.turn.loopdetect",
    "tool": "actors.turn.tools",
    "MCPServer": "actors.turn.mcp",
    "LLMReply": "actors.turn.llm",
    "ModelLimits": "actors.turn.llm",
    "TurnInput": "store.records",
    "Usage": "bus.messages",
    # the model and tool interfaces
    "LLMClient": "actors.turn.llm",
    "LLMRequest": "actors.turn.llm",
    "ToolSpec": "actors.turn.tools",
    "ToolRegistry": "actors.turn.tools",
    "ToolContext": "actors.turn.tools",
    # records
    "CheckpointRecord": "store.records",
    "Counters": "store.records",
    "Message": "bus.messages",
    "MessageMeta": "store.records",
    "ToolCall": "bus.messages",
    "ToolResult": "bus.messages",
    "TurnSpec": "store.records",
    "InboxItem": "store.records",
    "Outcome": "bus.outcomes",
    "SaveReason": "bus.outcomes",
    "TurnError": "store.records",
    "Approval": "store.records",
    "TurnPhase": "bus.phase",
    # live events (Runtime.watch)
    "WatchEvent": "bus.events",
    "TextDelta": "bus.events",
    "ToolCalled": "bus.events",
    "ToolReturned": "bus.events",
    "ToolWait": "bus.events",
    "ToolWaiting": "bus.events",
    "Restarted": "bus.events",
    "Finished": "bus.events",
    "Recovering": "bus.events",
    "StatusEvent": "bus.events",
    # errors
    "PhaselineError": "bus.errors",
    "ConfigError": "bus.errors",
    "StoreError": "bus.errors",
    "StoreRefused": "bus.errors",
    "StoreUnavailable": "bus.errors",
    "StaleOwner": "bus.errors",
    "RecordError": "bus.errors",
    "RecordNotFound": "bus.errors",
    "TurnExists": "bus.errors",
    "LLMError": "bus.errors",
    "RetryableLLMError": "bus.errors",
    "ContextLengthError": "bus.errors",
    "FatalLLMError": "bus.errors",
    "ToolError": "bus.errors",
    "SessionBusy": "bus.errors",
    "BudgetExhausted": "bus.errors",
    "TurnNotRunning": "bus.errors",
    "NamespaceHeld": "bus.errors",
}

__all__ = [
    "BUILTIN_TOOLS",
    "Agent",
    "AgentSettings",
    "Approval",
    "BudgetExhausted",
    "Cancelled",
    "CheckpointRecord",
    "ConfigError",
    "ContextLengthError",
    "Counters",
    "FatalLLMError",
    "Finished",
    "FrontDesk",
    "IfBusy",
    "InboxItem",
    "LLMClient",
    "LLMError",
    "LLMReply",
    "LLMRequest",
    "LoopThresholds",
    "MCPServer",
    "Message",
    "MessageMeta",
    "ModelContext",
    "ModelLimits",
    "NamespaceHeld",
    "OpenAIChat",
    "OpenAIResponses",
    "Outcome",
    "PhaselineError",
    "RecordError",
    "RecordNotFound",
    "Recovering",
    "Restarted",
    "RetryableLLMError",
    "RunStats",
    "Runtime",
    "SaveReason",
    "Scenario",
    "SessionBusy",
    "SessionSubmit",
    "Settings",
    "StaleOwner",
    "StatusEvent",
    "StoreError",
    "StoreRefused",
    "StoreUnavailable",
    "TextDelta",
    "ToolCall",
    "ToolCalled",
    "ToolContext",
    "ToolError",
    "ToolRegistry",
    "ToolResult",
    "ToolReturned",
    "ToolSpec",
    "ToolWait",
    "ToolWaiting",
    "TurnEngine",
    "TurnError",
    "TurnExists",
    "TurnInput",
    "TurnNotRunning",
    "TurnPhase",
    "TurnSpec",
    "Usage",
    "WatchEvent",
    "load_agent",
    "load_scenario",
    "load_settings",
    "scripted_turn",
    "tool",
]

if TYPE_CHECKING:
    from actors.cluster.runtime import Runtime
    from actors.engine.agents import load_agent
    from actors.engine.cancel import Cancelled
    from actors.engine.front_desk import FrontDesk, SessionSubmit
    from actors.engine.models.openai_chat import OpenAIChat
    from actors.engine.models.openai_responses import OpenAIResponses
    from actors.engine.models.scenario import Scenario, load_scenario
    from actors.engine.models.scripted import scripted_turn
    from actors.engine.run_stats import RunStats
    from actors.engine.settings.config import Settings, load_settings
    from actors.engine.tools.builtin_tools import BUILTIN_TOOLS
    from actors.engine.turn_engine import TurnEngine
    from actors.turn.agent import Agent, AgentSettings, ModelContext
    from actors.turn.llm import LLMClient, LLMReply, LLMRequest, ModelLimits
    from actors.turn.loopdetect import LoopThresholds
    from actors.turn.mcp import MCPServer
    from actors.turn.tools import ToolContext, ToolRegistry, ToolSpec, tool
    from bus.errors import (
        BudgetExhausted,
        ConfigError,
        ContextLengthError,
        FatalLLMError,
        LLMError,
        NamespaceHeld,
        PhaselineError,
        RecordError,
        RecordNotFound,
        RetryableLLMError,
        SessionBusy,
        StaleOwner,
        StoreError,
        StoreRefused,
        StoreUnavailable,
        ToolError,
        TurnExists,
        TurnNotRunning,
    )
    from bus.events import (
        Finished,
        Recovering,
        Restarted,
        StatusEvent,
        TextDelta,
        ToolCalled,
        ToolReturned,
        ToolWait,
        ToolWaiting,
        WatchEvent,
    )
    from bus.messages import Message, ToolCall, ToolResult, Usage
    from bus.outcomes import Outcome, SaveReason
    from bus.phase import TurnPhase
    from store.domain.sessions import IfBusy
    from store.records import (
        Approval,
        CheckpointRecord,
        Counters,
        InboxItem,
        MessageMeta,
        TurnError,
        TurnInput,
        TurnSpec,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
