"""The real model server for the tests, started as a user starts it: ``phaseline
model-server`` (``actors.engine.models.local_model``), from a directory outside the checkout, in the
background with its output in a log."""

from __future__ import annotations

import subprocess
from pathlib import Path

from actors.engine.models.local_model import MODEL_ALIAS, available, model_path
from tests.support.processes import PHASELINE

__all__ = ["MODEL_ALIAS", "available", "model_path", "start"]


def start(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [PHASELINE, "model-server", "--port", str(port)], cwd=log.parent, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
