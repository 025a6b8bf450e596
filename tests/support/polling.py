"""Waiting on a condition with a deadline: the only way tests synchronise with running turns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, timeout: float = 10.0, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)


def wait_until(
    probe: Callable[[], T | None], *, timeout: float = 30.0, what: str = "condition"
) -> T:
    """The blocking twin of :func:`eventually`, for tests that drive processes, not turns."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
