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

__all__ = ["Durability", "DurabilityKind", "parse_durability"]


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
