"""What every model client of one process shares, and the context each turn's client is built
with: one place, so the engine's hosts and the model workers give a client the same services."""

from __future__ import annotations

from actors.engine.models.admission import RedisAdmission
from actors.turn.agent import ModelContext
from actors.turn.tools import EffectSink
from store.domain.responses import RedisResponses
from store.keys import KeyLayout
from store.records import TurnInput
from store.redis.connection import StoreClient

__all__ = ["ModelServices"]


class ModelServices:
    """The cluster's admission to endpoints, where test doubles count their effects, and where
    clients of endpoints that keep generations note their ids."""

    def __init__(self, client: StoreClient, keys: KeyLayout, effects: EffectSink) -> None:
        self.admission = RedisAdmission(client, keys)
        self.effects = effects
        self.responses = RedisResponses(client, keys)

    def context(self, turn_id: str, turn_input: TurnInput, baseline: int) -> ModelContext:
        return ModelContext(
            turn_id, turn_input, baseline, self.admission, self.effects, self.responses
        )
