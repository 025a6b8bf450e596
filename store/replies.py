"""Reading Redis replies: bytes or str as they come, as text or bytes as the caller wants."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """A Redis reply as str (redis-py types replies as ``bytes | str``)."""
    return value.decode() if isinstance(value, bytes) else value


def raw(value: bytes | str) -> bytes:
    """A Redis reply as bytes."""
    return value if isinstance(value, bytes) else value.encode()
