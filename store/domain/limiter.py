"""Admission of model calls to an endpoint, one limiter in Redis shared by the whole cluster.

Every host and process asks :meth:`EndpointLimiter.admit` before it sends a model call; the
answer comes from one atomic script (``store/lua/model_admit.lua``) over three keys of the
endpoint, which share a hash tag so the script runs on Redis Cluster too::

    {ns}:{m:<endpoint>}:limit    hash   GCRA schedules (requests, tokens), the provider's pause,
                                        a label, when each waiter said it would ask again
    {ns}:{m:<endpoint>}:line     zset   waiting calls -> when they were first held back
    {ns}:{m:<endpoint>}:flight   zset   admitted calls -> when their place in flight expires

Each process that calls an endpoint also names it in ``{ns}:{global}:models`` (a zset, by when
it last did, at most every :data:`REGISTER_EVERY_S`), which is how :meth:`EndpointLimiter.snapshot`
finds the endpoints without a ``SCAN`` of the whole keyspace (which the Supervisor would run
every few seconds, at a cost that grows with every key of every turn, on the server too).

A declared limit (requests and tokens per minute, calls in flight) is kept by the schedules; a
provider's 429 pauses the endpoint for everyone for the time it asked (:meth:`pause`), declared
limits or not, and an endpoint that declared no rate is then spaced at the rate its refusals
show it accepts (:meth:`pause`). Waiting calls are served in the order they were first held
back. Nothing here knows the model client: it deals in numbers, ``actors.engine.models.admission``
binds them to an agent's ``ModelLimits``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import cast

from bus.errors import ConfigError
from store.keys import KeyLayout, check_endpoint
from store.lua import lua_script
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import text

__all__ = ["EndpointLimiter", "EndpointState", "Schedule", "endpoint_id"]

log = logging.getLogger(__name__)

#: How long an admitted call holds its place in flight at most, beyond its own timeout.
HOLD_SLACK_MS = 30_000
#: How late a waiter may ask again (a busy host) before it leaves the line: a waiter whose turn
#: ended or whose host died must not hold up everyone behind it.
WAITER_GRACE_MS = 10_000
#: How long an endpoint's keys live after its last call (the scripts ``PEXPIRE`` them).
STATE_KEEP_MS = 3_600_000
#: How long a spacing set by a provider's refusals takes to halve (``model_admit.lua``): how
#: fast an endpoint that allows more than the last estimate is found again. Shorter finds it
#: sooner and meets more refusals on the way.
GAP_HALF_LIFE_MS = 20_000
#: The spacing of the first calls to an endpoint that declared no rate (``model_admit.lua``):
#: a crowd of turns starting at once would all be sent before the provider's first refusal
#: could pause them; spaced, that refusal stops the rest. It halves like any spacing.
FIRST_GAP_MS = 10
#: How long a spacing must have held before the calls sent under it measure the provider's
#: rate (``model_pause.lua``): over a shorter time, one call more or less is a large error.
ESTIMATE_MIN_MS = 2_000
#: How long it may have held at most: longer, the provider's bucket may have refilled past
#: what it holds while calls went slower than it allows, and the count says too little.
ESTIMATE_MAX_MS = 60_000
#: How often a process calling an endpoint names it in the registry again. An entry older than
#: this and :data:`STATE_KEEP_MS` together outlived the state it named and is dropped.
REGISTER_EVERY_S = 600.0


def endpoint_id(base_url: str, model: str) -> str:
    """A short stable name of an endpoint and model, for its keys (no URL in a key)."""
    return hashlib.sha256(f"{base_url}|{model}".encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Schedule:
    """An endpoint's declared limits, as the script reads them (0: none)."""

    request_ms: float = 0.0
    """Milliseconds between requests (60,000 / requests per minute)."""
    burst: int = 1
    """Requests that may go at once."""
    token_ms: float = 0.0
    """Milliseconds per token (60,000 / tokens per minute)."""
    max_in_flight: int = 0
    """Calls in flight at most."""
    hold_ms: int = 120_000 + HOLD_SLACK_MS
    """How long an admitted call holds its place in flight at most (its timeout and a slack)."""


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One endpoint's admission as ``phaseline status`` shows it."""

    endpoint: str
    """Its id (a hash of base URL and model)."""
    label: str
    """Model and base URL."""
    waiting: int
    """Calls held back right now (turns waiting on its rate limit)."""
    in_flight: int
    """Calls holding a place in flight (only counted under a declared ``max_in_flight``)."""
    paused_s: float
    """Seconds left of the provider's pause (0: not paused)."""


class EndpointLimiter:
    """The cluster's admission to model endpoints."""

    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys
        self._admit = client.register_script(lua_script("model_admit.lua"))
        self._settle = client.register_script(lua_script("model_settle.lua"))
        self._pause = client.register_script(lua_script("model_pause.lua"))
        self._named: dict[str, float] = {}
        """Endpoint -> when this process last named it in the registry (monotonic s)."""

    async def admit(
        self, endpoint: str, ticket: str, schedule: Schedule, tokens: int, label: str = ""
    ) -> float:
        """0 when the call may go now (it takes its place), else the seconds to wait before
        asking again with the same ``ticket`` (its place in the line is kept). ``label`` names
        the endpoint for a person (``phaseline status``)."""
        await self._name(endpoint)
        k = self.keys
        args: list[str | int | float] = [
            ticket,
            schedule.request_ms,
            max(1, schedule.burst),
            schedule.token_ms,
            max(0, tokens),
            schedule.max_in_flight,
            schedule.hold_ms,
            WAITER_GRACE_MS,
            label or endpoint,
            STATE_KEEP_MS,
            GAP_HALF_LIFE_MS,
            FIRST_GAP_MS,
        ]
        with translated(f"admit a call to model endpoint {endpoint}"):
            wait_ms = await self._admit(
                keys=[k.model_limit(endpoint), k.model_line(endpoint), k.model_flight(endpoint)],
                args=args,
            )
        return int(wait_ms) / 1000

    async def settle(
        self, endpoint: str, ticket: str, schedule: Schedule, token_delta: int
    ) -> None:
        """The admitted call ended: free its place, correct the token schedule by
        ``token_delta`` (used minus estimated; 0 when the reply said nothing)."""
        k = self.keys
        with translated(f"settle a call to model endpoint {endpoint}"):
            await self._settle(
                keys=[k.model_limit(endpoint), k.model_flight(endpoint)],
                args=[ticket, schedule.token_ms, token_delta],
            )

    async def pause(self, endpoint: str, seconds: float, sent_s_ago: float) -> None:
        """The provider refused a call for its rate limit and asked to wait ``seconds`` (0:
        it did not say): no host sends it anything before then, and an endpoint that declared
        no rate is spaced at the rate it was measured to accept (``model_pause.lua``).
        ``sent_s_ago``: when the refused call was admitted, which says whether it went under
        the current spacing."""
        with translated(f"pause model endpoint {endpoint}"):
            await self._pause(
                keys=[self.keys.model_limit(endpoint)],
                args=[
                    max(1, int(seconds * 1000)),
                    STATE_KEEP_MS,
                    max(0, int(sent_s_ago * 1000)),
                    ESTIMATE_MIN_MS,
                    ESTIMATE_MAX_MS,
                    GAP_HALF_LIFE_MS,
                ],
            )

    async def snapshot(self) -> list[EndpointState]:
        """Every endpoint with a limiter state in this namespace, as it is now."""
        states = []
        for endpoint in await self.endpoints():
            k = self.keys
            with translated(f"read model endpoint {endpoint}"):  # a few reads, not hot
                label, paused = await self.client.hmget(
                    k.model_limit(endpoint), ["label", "paused_until"]
                )
                if label is None:  # every admit labels the state: it expired since
                    continue
                line = await self.client.zcard(k.model_line(endpoint))
                flight = await self.client.zcard(k.model_flight(endpoint))
                sec, usec = await self.client.time()  # the pause is in the server's time
            left = max(0, int(paused or 0) - (int(sec) * 1000 + int(usec) // 1000)) / 1000
            name = text(label) if label else endpoint
            states.append(EndpointState(endpoint, name, int(line), int(flight), left))
        return states

    async def waiting(self, endpoint: str) -> int:
        """Calls waiting in the endpoint's line right now."""
        with translated(f"read the line of model endpoint {endpoint}"):
            return int(await self.client.zcard(self.keys.model_line(endpoint)))

    async def endpoints(self) -> list[str]:
        """Endpoints called in this namespace within the life of their state, from the
        registry; an entry that outlived it is dropped, one that names no endpoint is skipped
        with a warning (it came from Redis, not from this code)."""
        stale = int(time.time() * 1000) - STATE_KEEP_MS - int(REGISTER_EVERY_S * 1000)
        with translated("list model endpoints"):
            await self.client.zremrangebyscore(self.keys.models(), "-inf", stale)
            named = await self.client.zrangebyscore(self.keys.models(), stale, "+inf")
        found = []
        for raw in cast(list[bytes], named):
            try:
                found.append(check_endpoint(text(raw)))
            except ConfigError as exc:
                log.warning("model endpoint registry: %s; skipped", exc)
        return sorted(found)

    async def _name(self, endpoint: str) -> None:
        """Name ``endpoint`` in the registry unless this process did so lately."""
        now = time.monotonic()
        last = self._named.get(endpoint)
        if last is not None and now - last < REGISTER_EVERY_S:
            return
        with translated(f"name model endpoint {endpoint}"):
            await self.client.zadd(
                self.keys.models(), {check_endpoint(endpoint): int(time.time() * 1000)}
            )
        self._named[endpoint] = now
