"""Reading Redis replies: bytes or str as they come, as text or bytes as the caller wants, and a
script's answer as the enum its caller declares."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, IntEnum
from typing import Any, TypeVar

from bus.errors import StoreError

__all__ = ["answer", "raw", "text", "text_fields"]

E = TypeVar("E", bound=Enum)


def text(value: bytes | str) -> str:
    """A Redis reply as str (redis-py types replies as ``bytes | str``)."""
    return value.decode() if isinstance(value, bytes) else value


def raw(value: bytes | str) -> bytes:
    """A Redis reply as bytes."""
    return value if isinstance(value, bytes) else value.encode()


def text_fields(reply: Mapping[Any, Any]) -> dict[str, str]:
    """A hash as ``HGETALL`` answers it, its fields and values as text."""
    return {text(k): text(v) for k, v in reply.items()}


def answer(kind: type[E], reply: object, what: str) -> E:
    """A server-side script's answer as ``kind``, the enum its caller declares beside the
    script: the reply itself, or the first element of a list (the rest is the caller's). A
    word or number the enum does not have is a :class:`StoreError` naming ``what``: a script
    and its reader out of step, never read as a yes or a no."""
    head = reply[0] if isinstance(reply, list) and reply else reply
    value: object = text(head) if isinstance(head, bytes | str) else head
    try:
        return kind(int(str(value)) if issubclass(kind, IntEnum) else value)
    except ValueError:
        raise StoreError(f"{what}: unexpected answer {reply!r:.80}") from None
