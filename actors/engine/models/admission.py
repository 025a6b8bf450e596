"""The cluster's admission to model endpoints: an agent's :class:`ModelLimits` bound to the
limiter in Redis (``store.domain.limiter``), which every host and process shares."""

from __future__ import annotations

from actors.turn.llm import Admission, ModelLimits
from store.domain.limiter import HOLD_SLACK_MS, EndpointLimiter, Schedule
from store.keys import KeyLayout
from store.redis.connection import StoreClient

__all__ = ["RedisAdmission", "schedule_of"]


def schedule_of(limits: ModelLimits | None, hold_s: float) -> Schedule:
    """The limiter's numbers for ``limits`` (no limits: only the provider's pauses apply)."""
    hold_ms = int(hold_s * 1000) + HOLD_SLACK_MS
    if limits is None:
        return Schedule(hold_ms=hold_ms)
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    return Schedule(
        request_ms=60_000 / rpm if rpm else 0.0,
        burst=limits.burst,
        token_ms=60_000 / tpm if tpm else 0.0,
        max_in_flight=limits.max_in_flight or 0,
        hold_ms=hold_ms,
    )


class RedisAdmission(Admission):
    """:class:`~actors.turn.llm.Admission` on Redis."""

    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.limiter = EndpointLimiter(client, keys)

    async def admit(
        self,
        endpoint: str,
        ticket: str,
        limits: ModelLimits | None,
        tokens: int,
        hold_s: float,
        label: str = "",
    ) -> float:
        schedule = schedule_of(limits, hold_s)
        return await self.limiter.admit(endpoint, ticket, schedule, tokens, label)

    async def settle(
        self, endpoint: str, ticket: str, limits: ModelLimits | None, token_delta: int
    ) -> None:
        if limits is None:
            return  # nothing held: no place in flight, no token schedule
        await self.limiter.settle(endpoint, ticket, schedule_of(limits, 0), token_delta)

    async def pause(self, endpoint: str, seconds: float, sent_s_ago: float) -> None:
        await self.limiter.pause(endpoint, seconds, sent_s_ago)
