"""What a save's acknowledgement promises: written, fsynced, or on replicas.

``[redis] durability`` is applied once per group-commit batch: the batch's pipeline ends with a
``WAITAOF`` or ``WAIT`` on the same connection, so a batch is acknowledged only when every save
in it has reached the promised place. A batch that does not get there in time answers each of
its saves with :class:`~bus.errors.NotDurable`; the loop keeps its dirty flag and saves again at
the next site, exactly as after any failed save.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from bus.errors import NotDurable, StoreError
from store.redis.replies import text

__all__ = ["Durability", "DurabilityKind", "DurabilityWait", "parse_durability"]


class DurabilityKind(enum.StrEnum):
    ACK = "ack"
    """Redis answered: in its memory, in the AOF within a second (``appendfsync everysec``)."""
    FSYNC = "fsync"
    """The local AOF is fsynced (``WAITAOF 1 0``, or a server with ``appendfsync always``)."""
    REPLICAS = "replicas"
    """N replicas have the writes (``WAIT N``): survives the loss of the primary's machine."""


@dataclass(frozen=True, slots=True)
class Durability:
    """A parsed ``[redis] durability`` setting."""

    kind: DurabilityKind = DurabilityKind.ACK
    """What an acknowledgement promises."""
    replicas: int = 0
    """For ``replicas:N``: how many replicas must have each batch."""
    timeout_ms: int = 2000
    """How long a batch waits for it before its saves fail as not durable."""

    def __str__(self) -> str:
        if self.kind is DurabilityKind.REPLICAS:
            return f"replicas:{self.replicas}"
        return str(self.kind.value)


_SPEC = re.compile(r"^(ack|fsync|replicas:([1-9][0-9]{0,2}))$")


def parse_durability(text: str, *, timeout_ms: int = 2000) -> Durability:
    """``ack`` | ``fsync`` | ``replicas:N`` (N in 1..999); ValueError names the problem."""
    m = _SPEC.match(text)
    if m is None:
        raise ValueError(f"durability must be 'ack', 'fsync' or 'replicas:N', got {text!r}")
    if m.group(2):
        return Durability(DurabilityKind.REPLICAS, int(m.group(2)), timeout_ms)
    return Durability(DurabilityKind(text), 0, timeout_ms)


class DurabilityWait:
    """The command that ends a batch of saves under a :class:`Durability`, and what its reply
    means. Whether the server has ``WAITAOF`` is asked once, at the first ``fsync`` batch."""

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, durability: Durability):
        self.client = client
        self.durability = durability
        self._has_waitaof: bool | None = None

    async def command(self) -> tuple[str | int, ...] | None:
        """``WAIT``/``WAITAOF`` with its arguments (None: nothing to wait for)."""
        d = self.durability
        if d.kind is DurabilityKind.ACK:
            return None
        if d.kind is DurabilityKind.REPLICAS:
            return ("WAIT", d.replicas, d.timeout_ms)
        if self._has_waitaof is None:
            self._has_waitaof = await self._probe_fsync()
        return ("WAITAOF", 1, 0, d.timeout_ms) if self._has_waitaof else None

    async def _probe_fsync(self) -> bool:
        """True if the server has WAITAOF; False if it fsyncs every write anyway
        (``appendfsync always``: what the embedded Redis 6.2 fallback runs with); otherwise
        ``fsync`` cannot be promised and saves fail as :class:`NotDurable`."""
        try:
            await self.client.execute_command("WAITAOF", 0, 0, 0)
            return True
        except redis.ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise NotDurable(f"durability fsync: WAITAOF refused ({exc})") from exc
        except (redis.RedisError, OSError) as exc:
            raise StoreError(f"probe WAITAOF: {exc}") from exc
        try:
            conf = await self.client.config_get("appendfsync")
        except (redis.RedisError, OSError) as exc:
            raise NotDurable(f"durability fsync: no WAITAOF and CONFIG refused ({exc})") from exc
        if text(next(iter(conf.values()), None) or b"") == "always":
            return False
        raise NotDurable(
            "durability fsync needs WAITAOF (Redis >= 7.2, Valkey) or appendfsync always"
        )

    def shortfall(self, reply: object) -> str:
        """Why a batch's WAIT/WAITAOF reply falls short of the promise ('' if it does not)."""
        if isinstance(reply, Exception):
            return f"{self.durability} not confirmed: {reply}"
        d = self.durability
        if d.kind is DurabilityKind.REPLICAS:
            got = int(reply) if isinstance(reply, int) else -1
            return "" if got >= d.replicas else f"{got} of {d.replicas} replicas in time"
        if isinstance(reply, list) and reply and int(reply[0]) >= 1:
            return ""
        return f"local AOF not fsynced within {d.timeout_ms} ms ({reply!r})"
