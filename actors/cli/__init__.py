"""The ``phaseline`` command line, a module per group of verbs, all registered on one group.

* :mod:`actors.cli.app`: the group, its shared options and how a verb reaches Redis and Ray;
* :mod:`actors.cli.runs`: ``run``, ``resume``;
* :mod:`actors.cli.harness`: ``demo``, ``chaos``, ``bench``;
* :mod:`actors.cli.views`: ``inspect``, ``watch``, ``status``;
* :mod:`actors.cli.sessions`: ``submit``, ``chat``;
* :mod:`actors.cli.serve`: ``serve``, ``redis``;
* :mod:`actors.cli.operate`: the operator's verbs on turns (``turns``, ``cancel``, ``inject``,
  ``approvals``, ``approve``, ``deny``, ``export``, ``purge``);
* :mod:`actors.cli.ui`: ``ui``, the web console.
"""

from __future__ import annotations

# Each module registers its verbs on ``main`` when imported.
from actors.cli import harness, operate, runs, serve, sessions, ui, views  # noqa: F401
from actors.cli.app import main

__all__ = ["main"]
