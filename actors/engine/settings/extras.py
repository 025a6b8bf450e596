"""The optional parts of phaseline (``pip install 'phaseline[console,otel,plots]'``): the
libraries a feature needs beyond the core, imported only where the feature is used, and the
error that names the extra when they are missing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import StrEnum

from bus.errors import MissingExtra

__all__ = ["Extra", "needs"]


class Extra(StrEnum):
    """An extra of the ``phaseline`` distribution (``pyproject.toml``)."""

    CONSOLE = "console"
    """The web console (``phaseline ui``): Starlette, Jinja2, uvicorn."""
    OTEL = "otel"
    """OpenTelemetry traces (``[telemetry]``): the SDK and its OTLP/HTTP exporter."""
    PLOTS = "plots"
    """Timeline and benchmark plots (``--plot``): matplotlib."""


@contextlib.contextmanager
def needs(extra: Extra, what: str) -> Iterator[None]:
    """Import what ``what`` needs inside the block; a missing library is a
    :class:`~bus.errors.MissingExtra` naming the install that brings it."""
    try:
        yield
    except ImportError as exc:
        raise MissingExtra(
            f"{what} needs phaseline's {extra.value!r} extra ({exc.name or exc} is not "
            f"installed): pip install 'phaseline[{extra.value}]'"
        ) from exc
