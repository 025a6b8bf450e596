"""Agents: what a user defines to run their model, tools and prompt on phaseline. Pure.

An :class:`Agent` is a frozen value named in each turn by import path (``"pkg.module:name"``,
``actors.engine.agents`` loads it), so every host on every node builds the same agent from the
same code, as arq's ``WorkerSettings`` and Temporal's worker registration do. Nothing but the
agent decides which model a turn talks to or which tools it may call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from actors.turn.llm import Admission, LLMClient, ResponseJournal
from actors.turn.loopdetect import LoopThresholds
from actors.turn.mcp import MCPServer
from actors.turn.settings import LoopSettings
from actors.turn.tools import EffectSink, ToolRegistry
from store.records import TurnInput

__all__ = ["Agent", "AgentSettings", "ModelContext", "ModelFactory"]


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a model factory may know about the turn it builds a client for."""

    turn_id: str
    """The turn."""
    input: TurnInput
    """The turn's input (the scripted agent reads its scenario from the context)."""
    baseline: int
    """Messages before the turn's own (the system prompt, earlier turns of the session)."""
    admission: Admission | None = None
    """The cluster's admission to model endpoints (rate limits shared by every host); None
    where there is none (a unit test)."""
    effects: EffectSink | None = None
    """Where a test double counts what it did, seen from outside the process (the scripted
    model's ``random`` replies count each reply it completed there); None: nowhere."""
    responses: ResponseJournal | None = None
    """Where a client whose endpoint keeps generations notes their ids (None: nowhere, and
    such a client asks again after a crash like any other)."""


ModelFactory = Callable[[ModelContext], LLMClient]
"""Builds the model client of one turn (cheap: clients share their connection pools)."""


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Per-agent limits on top of the deployment's settings."""

    max_tool_rounds: int | None = None
    """Tool rounds a turn may run; a reply asking for more is not run, the turn wraps up in
    ``force_stop`` instead. None: no limit besides the loop detector."""
    tool_timeouts: Mapping[str, float] = field(default_factory=dict)
    """Per-tool timeouts (seconds) that replace the tools' own."""
    compact_at_chars: int | None = None
    """Compact before a model call once the transcript holds this many characters, instead of
    waiting for the endpoint's context-length error. None: reactive compaction only."""
    max_tokens_per_turn: int | None = None
    """A turn's token budget (prompt and reply of all its model calls, as the endpoint reports
    them): once a reply takes it there, the turn runs no more tools and wraps up in
    ``force_stop`` (outcome ``budget_exhausted``). None: no budget."""
    max_tokens_per_session: int | None = None
    """A session's token budget (all its turns' model calls): a turn that takes the session
    there wraps up like one over its own budget, and the session opens no more turns
    (:class:`~bus.errors.BudgetExhausted`). None: no budget."""
    loop_thresholds: LoopThresholds = field(default_factory=LoopThresholds)
    """When a call that keeps returning the same result is skipped (and the model nudged), and
    when the turn is stopped for it; a call whose result changes is never a loop."""

    def __post_init__(self) -> None:
        if self.max_tool_rounds is not None and self.max_tool_rounds < 0:
            raise ValueError("max_tool_rounds must be >= 0")
        for name in ("max_tokens_per_turn", "max_tokens_per_session"):
            budget = getattr(self, name)
            if budget is not None and budget < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.compact_at_chars is not None and self.compact_at_chars < 1:
            raise ValueError("compact_at_chars must be >= 1")
        bad = {k: v for k, v in self.tool_timeouts.items() if not v > 0}
        if bad:
            raise ValueError(f"tool timeouts must be > 0 s: {bad}")

    def tuned(self, base: LoopSettings) -> LoopSettings:
        """``base`` (the deployment's loop settings) with this agent's limits."""
        return replace(
            base,
            max_tool_rounds=self.max_tool_rounds,
            compact_at_chars=self.compact_at_chars,
            loop_thresholds=self.loop_thresholds,
            max_tokens_per_turn=self.max_tokens_per_turn,
            max_tokens_per_session=self.max_tokens_per_session,
        )


@dataclass(frozen=True, slots=True)
class Agent:
    """A model, its tools, its system prompt and its limits."""

    model: ModelFactory
    """Builds the turn's model client."""
    tools: ToolRegistry = field(default_factory=lambda: ToolRegistry(()))
    """The tools the model may call."""
    system_prompt: str = ""
    """Opens every session's transcript (left out when empty)."""
    settings: AgentSettings = field(default_factory=AgentSettings)
    """Per-agent limits."""
    model_name: str = ""
    """The model's name, for logs and reports (the factory knows what it calls)."""
    mcp: tuple[MCPServer, ...] = ()
    """MCP servers whose tools the model may call too (as ``<server>__<tool>``)."""

    def __post_init__(self) -> None:
        names = [s.name for s in self.mcp]
        if len(set(names)) != len(names):
            raise ValueError(f"MCP server names must differ: {names}")

    def resource_shapes(self) -> list[Mapping[str, float]]:
        """The Ray resources of its tools' calls, one entry per tool or MCP server."""
        return [spec.resources for spec in self.tools] + [s.resources for s in self.mcp]

    def check_input(self, turn_input: TurnInput) -> None:
        """Refuse, with a :class:`~bus.errors.ConfigError`, input this agent cannot run (called at
        submission, so a bad turn never reaches a host)."""

    def registry(self, turn_input: TurnInput) -> ToolRegistry:
        """The tools of one turn, with the agent's timeouts applied."""
        if not self.settings.tool_timeouts:
            return self.tools
        self.tools.require(self.settings.tool_timeouts)
        return ToolRegistry(
            replace(spec, timeout_s=self.settings.tool_timeouts.get(spec.name, spec.timeout_s))
            for spec in self.tools
        )

    def client(self, ctx: ModelContext) -> LLMClient:
        """The model client of one turn."""
        return self.model(ctx)
