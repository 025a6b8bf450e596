"""The provider's id of each turn's model call in flight, for an endpoint that keeps its
generations (OpenAI's Responses API with ``background``): a resumed turn that asks for the same
generation finds the response there and follows it instead of paying for another.

One key per turn (``KeyLayout.response``), overwritten by each call: a turn has one model call
in flight at a time, and only that one can be adopted. Its value is ``<generation> <response
id>``, the generation named as a model worker names it (the request's digest), so a resumed
turn whose transcript differs (a tool result now ``outcome_unknown``) does not take a reply to
another request. The key lives and dies with the turn's other keys (the final save gives it the
retention's time to live; ``purge`` deletes it). One write per model call, on this path only:
the provider holds the generation, and its id is the only way back to it.
"""

from __future__ import annotations

from store.keys import KeyLayout
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text

__all__ = ["RedisResponses"]


class RedisResponses:
    """The :class:`~actors.turn.llm.ResponseJournal` on Redis."""

    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys

    async def note(self, turn_id: str, generation: str, response_id: str) -> None:
        with translated(f"note the response of {turn_id}'s model call"):
            await self.client.set(self.keys.response(turn_id), f"{generation} {response_id}")

    async def find(self, turn_id: str, generation: str) -> str | None:
        with translated(f"read the response of {turn_id}'s model call"):
            raw = await self.client.get(self.keys.response(turn_id))
        if raw is None:
            return None
        noted, _, response_id = text(raw).partition(" ")
        return response_id if noted == generation and response_id else None
