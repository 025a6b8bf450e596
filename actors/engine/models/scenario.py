"""Scenarios: TOML descriptions of a scripted workload (DESIGN §5).

Every key but ``name`` is optional; unknown keys are rejected so a typo cannot silently run a
different experiment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from actors.engine.settings.shipped import scenario_path
from actors.engine.settings.tomlfile import describe, read_toml
from bus.errors import ConfigError
from store.codec import RECORD_BYTES_CEILING

#: Bytes one round may add to the transcript (a model reply and its tool results).
MAX_ROUND_BYTES = 64 * 2**20
#: Bytes a whole scripted transcript may reach: the largest record a checkpoint may hold.
MAX_TURN_BYTES = RECORD_BYTES_CEILING

FaultKind = Literal[
    "retryable", "context_length", "hang", "empty", "oversized", "loop", "fatal", "crash"
]


class ModelFault(BaseModel):
    """A model fault injected at one call of the turn."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at_call: StrictInt = Field(ge=1)
    """The Nth model call of the turn (1-based)."""
    kind: FaultKind
    """What goes wrong (see the scripted model)."""
    times: StrictInt = Field(default=1, ge=1, le=100)
    """For ``retryable`` and ``oversized``: how many consecutive attempts of that call fail."""


class Scenario(BaseModel):
    """A scripted workload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=100)
    """Label, also part of the scripted model's seed."""
    rounds: StrictInt = Field(default=3, ge=0, le=10_000)
    """Tool rounds before the final answer."""
    tools_per_round: StrictInt = Field(default=1, ge=1, le=1000)
    """Tool calls in each batch."""
    tools: tuple[str, ...] = ("echo",)
    """Registered tool names, used round-robin."""
    llm_latency_ms: StrictInt = Field(default=0, ge=0, le=3_600_000)
    """Simulated latency of each model call."""
    tool_latency_ms: StrictInt = Field(default=0, ge=0, le=3_600_000)
    """Simulated latency of each tool call."""
    payload_bytes: StrictInt = Field(default=200, ge=0, le=10_000_000)
    """Size of each model reply and tool result."""
    require_approval: tuple[str, ...] = ()
    """Tools whose calls wait for an approval in this scenario."""
    prompt: str = "Run the scripted task."
    """The user message that opens the turn."""
    faults: tuple[ModelFault, ...] = ()
    """Injected model faults."""
    replies: Literal["fixed", "random"] = "fixed"
    """``fixed``: each reply a pure function of the scenario and the transcript, so a resumed
    turn reproduces the fault-free transcript exactly. ``random``: like a real model, never the
    same reply twice (the text and every call's arguments carry fresh randomness, drawn from
    ``seed``, the process and the model client), so a reply asked for again differs and so
    does the call it makes."""
    seed: StrictInt = 0
    """Seeds the ``random`` replies (together with the process and client that answer)."""

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if not self.tools:
            raise ValueError("tools must name at least one tool")
        per_round = (1 + self.tools_per_round) * self.payload_bytes  # a reply + its results
        if per_round > MAX_ROUND_BYTES:
            raise ValueError(
                f"a round would carry (1 + tools_per_round) x payload_bytes = {per_round:,} "
                f"bytes; at most {MAX_ROUND_BYTES:,}"
            )
        if per_round * max(self.rounds, 1) > MAX_TURN_BYTES:
            raise ValueError(
                f"the transcript would grow to about {per_round * self.rounds:,} bytes; at most "
                f"{MAX_TURN_BYTES:,} (the largest record [checkpoint] max_record_bytes allows)"
            )
        unknown = set(self.require_approval) - set(self.tools)
        if unknown:
            raise ValueError(f"require_approval names tools not in tools: {sorted(unknown)}")
        return self

    def fault_at(self, call: int) -> ModelFault | None:
        return next((f for f in self.faults if f.at_call == call), None)


def parse_scenario(data: dict[str, Any], *, source: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid scenario:\n{describe(exc, Scenario)}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file, or a shipped one named by its stem (``tool_loop``,
    from any directory); every failure is a :class:`ConfigError`."""
    found = scenario_path(str(path))
    return parse_scenario(read_toml(found, "scenario"), source=str(found))
