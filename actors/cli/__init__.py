"""The ``phaseline`` command line: :mod:`actors.cli.app` (the group, the shared options, the
run, demo, chaos, bench, serve and inspection verbs) and :mod:`actors.cli.operate` (the
operator's verbs on running turns: turns, cancel, inject, approvals, approve, deny)."""

from __future__ import annotations

from actors.cli import operate as _operate  # noqa: F401  (registers its verbs on main)
from actors.cli.app import main

__all__ = ["main"]
