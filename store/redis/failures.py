"""Redis' failures translated at the boundary into the store's typed errors (:mod:`bus.errors`):
what waiting can fix, what Redis refused to run, what is a bad key."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from bus.errors import RecordError, StoreError, StoreRefused, StoreUnavailable


@contextmanager
def translated(action: str) -> Iterator[None]:
    """Re-raise ``redis.RedisError`` (and socket errors) as :class:`StoreError`:
    :class:`StoreRefused` for a command the server answered it did not run,
    :class:`StoreUnavailable` for what else passes (see :func:`is_transient`)."""
    try:
        yield
    except (redis.RedisError, OSError) as exc:
        raise _store_error(exc, action) from exc


def _store_error(exc: BaseException, action: str) -> StoreError:
    kind = (
        StoreRefused if is_refusal(exc) else StoreUnavailable if is_transient(exc) else StoreError
    )
    return kind(f"{action}: {type(exc).__name__}: {exc}")


#: Codes of the error replies by which a server refuses to run a command it will take later:
#: loading its data, out of memory, writes stopped by a failing disk (MISCONF), a read-only
#: replica, too few replicas, a failover, a slot moving, a long script running. redis-py gives
#: some their own classes and keeps the code in ``status_code`` or at the head of the message.
_REFUSALS = frozenset(
    {
        "LOADING",
        "OOM",
        "MISCONF",
        "READONLY",
        "NOREPLICAS",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "BUSY",
    }
)


_REFUSAL_CLASSES = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


def is_refusal(exc: BaseException) -> bool:
    """Whether Redis answered that it did not run the command (so nothing was written)."""
    if isinstance(exc, _REFUSAL_CLASSES):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code in _REFUSALS


def is_transient(exc: BaseException) -> bool:
    """Whether waiting can fix it: a lost or refused connection, a timeout, a server that
    refused the command for now (:func:`is_refusal`)."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return True
    return is_refusal(exc)


@contextmanager
def reading(key: str, action: str) -> Iterator[None]:
    """Like :func:`translated`, for reading one key: a key of the wrong type (a string where a
    hash belongs) is that key's :class:`RecordError`, so the caller quarantines it and the
    other turns go on, instead of a StoreError that stops every reader."""
    try:
        yield
    except redis.ResponseError as exc:
        if str(exc).startswith("WRONGTYPE") or getattr(exc, "status_code", None) == "WRONGTYPE":
            raise RecordError(key, f"wrong Redis type: {exc}") from exc
        raise _store_error(exc, action) from exc
    except (redis.RedisError, OSError) as exc:
        raise _store_error(exc, action) from exc
