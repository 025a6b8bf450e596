"""msgpack as phaseline writes and reads it: one place for the two calls every encoder makes.

Its own module so that the record codec (``store.codec``) and the transcript's bodies
(``store.write.transcript``), which the codec builds on, share it without importing each other.
"""

from __future__ import annotations

from typing import Any

import msgpack

from bus.errors import UnstorableRecord

__all__ = ["pack", "unpack"]


def pack(value: Any) -> bytes:
    """msgpack with bin type, so bytes and str never get confused on the way back. A value
    msgpack cannot encode is :class:`UnstorableRecord` (typed, so it fails the one turn that
    holds it, never the process): text from outside is made storable where it enters
    (``store.records.storable``), so this is the net under that."""
    try:
        return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError) as exc:
        raise UnstorableRecord(f"a value cannot be encoded: {type(exc).__name__}: {exc}") from exc


def unpack(data: bytes) -> Any:
    """Strict msgpack decode: str or bytes keys only, no ext types, no surprises."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True)
