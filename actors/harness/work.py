"""What every turn of a harness run does: an agent on an input.

The demo and the chaos harness run either a scenario (the scripted agent, whose replies are a
pure function of scenario and transcript) or any agent named by import path on one input (an
HTTP model whose endpoint answers deterministically per conversation, like the tests' server).
Their verdict compares every turn with a fault-free run of the same work in this process.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.agents import check_agent
from actors.engine.models.scenario import Scenario
from actors.engine.models.scripted import scripted_turn
from store.records import TurnInput


@dataclass(frozen=True, slots=True)
class Work:
    """An agent and the input each turn gets."""

    agent: str
    """Import path of the agent."""
    turn_input: TurnInput
    """The input of every turn."""
    label: str
    """How reports name it (the scenario's name, or the agent's path)."""
    scenario: Scenario | None = None
    """The scenario, for scripted work (poison turns and a latency-free reference need it)."""

    @classmethod
    def scripted(cls, scenario: Scenario) -> Work:
        agent, turn_input = scripted_turn(scenario)
        return cls(agent, turn_input, scenario.name, scenario)

    @classmethod
    def of_agent(cls, agent: str, message: str) -> Work:
        """An agent on one user message; :class:`ConfigError` if it does not load or refuses it."""
        turn_input = TurnInput(message=message)
        check_agent(agent, turn_input)
        return cls(agent, turn_input, agent)

    @property
    def deterministic(self) -> bool:
        """Whether its model answers a conversation the same way every time, as the ``exact``
        verdict needs: a fixed scenario does, one of random replies does not; an agent is
        trusted to (its endpoint at temperature 0)."""
        return self.scenario is None or self.scenario.replies == "fixed"

    def reference(self) -> tuple[str, TurnInput]:
        """The same work for the fault-free reference run: the scripted model skips its
        latency (its replies do not depend on it)."""
        if self.scenario is None:
            return self.agent, self.turn_input
        return scripted_turn(self.scenario.model_copy(update={"llm_latency_ms": 0}))
