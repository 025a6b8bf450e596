"""Where the shipped ``configs/`` live: the checkout's, or the copy a wheel installs.

A wheel installs ``configs/`` as data files under ``<prefix>/share/phaseline/configs``
(``pyproject.toml``, ``[tool.setuptools.data-files]``); a checkout (and an editable install)
uses its own ``configs/``. A scenario can then be named by its stem (``tool_loop``) from
anywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bus.errors import ConfigError

__all__ = ["configs_dir", "scenario_path"]


def configs_dir() -> Path:
    """The ``configs/`` directory to read shipped settings and scenarios from."""
    for candidate in (
        Path(__file__).resolve().parents[3] / "configs",
        Path(sys.prefix) / "share" / "phaseline" / "configs",
    ):
        if (candidate / "scenarios").is_dir():
            return candidate
    raise ConfigError("the shipped configs/ directory is missing from this installation")


def scenario_path(name_or_path: str) -> Path:
    """A scenario file: the path as given if it exists, else a shipped scenario of that stem."""
    path = Path(name_or_path)
    if path.exists() or path.suffix or "/" in name_or_path:
        return path
    shipped = configs_dir() / "scenarios" / f"{name_or_path}.toml"
    if not shipped.exists():
        known = sorted(p.stem for p in (configs_dir() / "scenarios").glob("*.toml"))
        raise ConfigError(f"no scenario file {name_or_path!r}; shipped ones: {', '.join(known)}")
    return shipped
