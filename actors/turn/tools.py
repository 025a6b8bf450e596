"""Tools as the loop sees them: specs and the registry (the built-in tools are in
``actors.engine.builtin_tools``).

A tool is an async function ``(args, ctx) -> str``. Its spec carries what the runtime needs to
run it safely: a timeout, a concurrency limit, whether re-running it is harmless (``idempotent``)
and whether a human must approve each call (``requires_approval``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bus.errors import ConfigError, UnknownTool


class EffectSink(Protocol):
    async def increment(self, turn_id: str, call_key: str) -> int: ...


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a running tool may know about its call."""

    turn_id: str
    """The turn that made the call."""
    call_key: str
    """Stable idempotency key; pass it downstream so a retried call can be deduplicated."""
    effects: EffectSink | None = None
    """Where ``counter_increment`` performs its side effect (None: no side-effect store)."""


ToolFn = Callable[[Mapping[str, Any], ToolContext], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A registered tool and the rules for running it."""

    name: str
    """Name the model calls it by."""
    fn: ToolFn
    """The implementation."""
    idempotent: bool
    """Re-running it after a crash is harmless; if False a call caught in flight is never
    re-run but reported as ``outcome_unknown``."""
    requires_approval: bool = False
    """Each call waits in ``awaiting_approval`` for a decision (denied after the cap)."""
    timeout_s: float = 30.0
    """Per-call timeout; the call's result is ``timeout`` past it."""
    max_concurrency: int = 64
    """Calls of this tool running at once in one process."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray resources a call of this tool needs (its ToolWorker pool is keyed by them)."""


class ToolRegistry:
    """Name -> spec. Immutable after construction; derive variants with :meth:`with_approval`."""

    def __init__(self, specs: Iterable[ToolSpec]) -> None:
        self._specs = {s.name: s for s in specs}

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def get(self, name: str) -> ToolSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownTool(f"unknown tool {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self._specs)

    def require(self, names: Iterable[str]) -> None:
        """Raise ConfigError naming every tool in ``names`` that is not registered."""
        missing = sorted(set(names) - set(self._specs))
        if missing:
            raise ConfigError(f"unknown tools {missing}; registered: {self.names()}")

    def with_approval(self, names: Iterable[str]) -> ToolRegistry:
        wanted = set(names)
        self.require(wanted)
        return ToolRegistry(
            replace(s, requires_approval=True) if s.name in wanted else s
            for s in self._specs.values()
        )
