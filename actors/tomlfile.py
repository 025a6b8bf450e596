"""Reading TOML input files with errors a user can act on."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bus.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed table of ``path``; a missing, unreadable or malformed file is a ConfigError."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: {what} is not valid TOML: {exc}") from exc
