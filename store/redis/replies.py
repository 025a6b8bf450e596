"""Reading Redis replies: bytes or str as they come, as text or bytes as the caller wants."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def text(value: bytes | str) -> str:
    """A Redis reply as str (redis-py types replies as ``bytes | str``)."""
    return value.decode() if isinstance(value, bytes) else value


def raw(value: bytes | str) -> bytes:
    """A Redis reply as bytes."""
    return value if isinstance(value, bytes) else value.encode()


def text_fields(reply: Mapping[Any, Any]) -> dict[str, str]:
    """A hash as ``HGETALL`` answers it, its fields and values as text."""
    return {text(k): text(v) for k, v in reply.items()}
