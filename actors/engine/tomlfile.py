"""Reading TOML input files with errors a user can act on."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bus.errors import ConfigError


def describe(exc: ValidationError) -> str:
    """A pydantic error as one line per problem (where, what), without echoing the input:
    a config's values may hold a password."""
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed table of ``path``; a missing, unreadable or malformed file is a ConfigError."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: {what} is not valid TOML: {exc}") from exc
