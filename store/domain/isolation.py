"""The isolation queue and the probation marker: where the poison-turn policy keeps its facts.

A turn the policy isolates (``actors.turn.poison``) waits in one sorted set, scored by the earliest
time it may run (its backoff). The isolation host runs the due ones one at a time; while one
runs, the *probation marker* names it, its epoch and the step it has started. The marker is
written before the step begins and cleared when the probation ends by itself, so a marker
still there when the next isolation host starts says the host died with that turn inside that
step: the evidence the policy counts. Both keys are single-key values under the ``{global}``
tag, so they work unchanged on Redis Cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum
from typing import cast

from bus.errors import ConfigError
from store.keys import KeyLayout, check_turn_id
from store.lua import lua_script
from store.records import MAX_FENCE
from store.redis.connection import StoreClient
from store.redis.failures import translated
from store.redis.replies import answer, text, text_fields

__all__ = ["Isolation", "Probation"]


@dataclass(frozen=True, slots=True)
class Probation:
    """The marker of the turn running alone on the isolation host."""

    turn_id: str
    """The turn."""
    epoch: int
    """The epoch of its isolated owner: a later claim makes the marker stale."""
    step: str
    """The step it started last (``phase@position``), empty before its first step."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class MarkAnswer(IntEnum):
    """What ``probation_mark.lua`` answers."""

    NOT_THEIRS = 0
    """The marker is not this turn's probation at this epoch (a successor's, or none): a
    zombie incarnation can neither move nor clear it."""
    MOVED = 1
    """The marker was updated or deleted."""


class Isolation:
    def __init__(self, client: StoreClient, keys: KeyLayout) -> None:
        self.client = client
        self.keys = keys
        self._mark = client.register_script(lua_script("probation_mark.lua"))

    # -- the queue ----------------------------------------------------------------------------

    async def enqueue(self, turn_id: str, *, delay_s: float = 0.0) -> None:
        """Queue a turn for isolation (again), to run no earlier than ``delay_s`` from now."""
        with translated(f"queue {turn_id} for isolation"):
            await self.client.zadd(self.keys.isolation(), {turn_id: _now_ms() + delay_s * 1000})

    async def members(self) -> set[str]:
        """Every queued turn (shared hosts leave these alone)."""
        with translated("read the isolation queue"):
            raw = await self.client.zrange(self.keys.isolation(), 0, -1)
        return {text(m) for m in cast(list[bytes], raw)}

    async def due(self) -> tuple[list[str], float | None]:
        """The queued turns that may run now, earliest first, and the seconds until the next
        one that may not yet (None if there is none)."""
        with translated("read the isolation queue"):
            scored = await self.client.zrange(self.keys.isolation(), 0, -1, withscores=True)
        raw = cast(list[tuple[bytes, float]], scored)
        now = _now_ms()
        ready = [text(m) for m, score in raw if score <= now]
        later = [score for _, score in raw if score > now]
        return ready, (min(later) - now) / 1000 if later else None

    async def remove(self, turn_id: str) -> None:
        with translated(f"take {turn_id} off the isolation queue"):
            await self.client.zrem(self.keys.isolation(), turn_id)

    # -- the probation marker -----------------------------------------------------------------

    async def begin(self, turn_id: str, epoch: int) -> None:
        """Name the turn now running alone (replacing any earlier marker)."""
        with translated(f"mark the probation of {turn_id}"):
            await self.client.hset(
                self.keys.probation(),
                mapping={"turn_id": turn_id, "epoch": str(epoch), "step": "", "at": _now_ms()},
            )

    async def step(self, turn_id: str, epoch: int, step: str) -> bool:
        """Note, before it begins, the step the turn is about to run; False if the marker is
        no longer this incarnation's (it was replaced by a successor)."""
        return await self._update("step", turn_id, epoch, step)

    async def end(self, turn_id: str, epoch: int) -> bool:
        """Clear the marker when the probation ended without its host dying."""
        return await self._update("end", turn_id, epoch, "")

    async def _update(self, op: str, turn_id: str, epoch: int, step: str) -> bool:
        with translated(f"update the probation of {turn_id}"):
            reply = await self._mark(
                keys=[self.keys.probation()], args=[op, turn_id, str(epoch), step, _now_ms()]
            )
        return answer(MarkAnswer, reply, f"probation of {turn_id}") is MarkAnswer.MOVED

    async def current(self) -> Probation | None:
        """The marker, if any. A malformed one (written by hand, or by another build) reads as
        none: it must never count a death against a turn."""
        with translated("read the probation marker"):
            raw = await self.client.hgetall(self.keys.probation())
        fields = text_fields(raw)
        try:
            probation = Probation(
                turn_id=check_turn_id(fields["turn_id"]),
                epoch=int(fields["epoch"]),
                step=fields.get("step", "")[:200],
            )
        except (KeyError, ValueError, ConfigError):  # missing field, not a number, bad id
            return None
        return probation if 1 <= probation.epoch <= MAX_FENCE else None

    async def forget(self) -> None:
        """Drop the marker without reading it (a predecessor that froze, not died)."""
        with translated("clear the probation marker"):
            await self.client.delete(self.keys.probation())
