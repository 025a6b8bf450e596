"""What travels on the bus, and its wire form (flat string fields of a Redis Streams entry).

Every entry read from the bus is validated here; a malformed one raises :class:`BadBusEntry`
and is moved to the dead-letter stream by the reader instead of stopping anybody.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from bus.errors import PhaselineError
from bus.phase import Transition, TurnPhase


class BadBusEntry(PhaselineError):
    """A bus entry that is not a valid phaseline event."""


class Status(StrEnum):
    """Kinds of :class:`StatusEvent`."""

    IDLE_SOFT = "idle_soft"
    """The turn has been idle past the watchdog's soft timeout; nothing was done to it."""
    HARD_IDLE_TIMEOUT = "hard_idle_timeout"
    """The watchdog cancelled the turn's model call; the recovery policy aborts the turn."""


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """A report about a turn that changes nothing (e.g. the watchdog's ``idle_soft``)."""

    turn_id: str
    """The turn concerned."""
    epoch: int
    """Owner epoch the report is about."""
    status: Status
    """Kind of report."""
    label: str
    """A line a person can read."""
    at_ms: int
    """Unix milliseconds of the report."""


BusEvent = Transition | StatusEvent


def encode_event(event: BusEvent) -> dict[str, str | int]:
    if isinstance(event, Transition):
        return {
            "kind": "transition",
            "turn_id": event.turn_id,
            "epoch": event.epoch,
            "seq": event.seq,
            "src": event.src.value,
            "dst": event.dst.value,
            "at_ms": event.at_ms,
        }
    return {
        "kind": "status",
        "turn_id": event.turn_id,
        "epoch": event.epoch,
        "status": event.status.value,
        "label": event.label,
        "at_ms": event.at_ms,
    }


def _s(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_event(fields: Mapping[bytes, bytes] | Mapping[str, str | int]) -> BusEvent:
    """Validate one entry's fields (as read, or as encoded); :class:`BadBusEntry` says why."""
    try:
        f = {_s(k): _s(v) for k, v in fields.items()}
        kind = f["kind"]
        if kind == "transition":
            return Transition(
                turn_id=f["turn_id"],
                epoch=int(f["epoch"]),
                seq=int(f["seq"]),
                src=TurnPhase(f["src"]),
                dst=TurnPhase(f["dst"]),
                at_ms=int(f["at_ms"]),
            )
        if kind == "status":
            return StatusEvent(
                turn_id=f["turn_id"],
                epoch=int(f["epoch"]),
                status=Status(f["status"]),
                label=f["label"],
                at_ms=int(f["at_ms"]),
            )
        raise BadBusEntry(f"unknown event kind {kind!r}")
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise BadBusEntry(f"malformed bus entry {dict(fields)!r}: {exc!r}") from exc
