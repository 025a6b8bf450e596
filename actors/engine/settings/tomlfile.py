"""Reading TOML input files with errors a user can act on."""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from bus.errors import ConfigError


def describe(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """A pydantic error as one line per problem (where, what), without echoing the input:
    a config's values may hold a password. With the ``model`` validated, a key it does not
    know gets the nearest one it does ("did you mean ...?")."""
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = err["loc"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        line = f"  {where}: {err['msg']}"
        if err["type"] == "extra_forbidden" and loc:
            near = difflib.get_close_matches(str(loc[-1]), _keys_at(model, loc[:-1]), n=1)
            line += f" (did you mean {near[0]!r}?)" if near else ""
        lines.append(line)
    return "\n".join(lines)


def _keys_at(model: type[BaseModel] | None, path: tuple[int | str, ...]) -> list[str]:
    """The keys the (nested) model at ``path`` of ``model`` takes ([]: not a model there)."""
    for part in path:
        field = model.model_fields.get(str(part)) if model is not None else None
        kind = field.annotation if field is not None else None
        model = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed table of ``path``; a missing, unreadable or malformed file is a ConfigError."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: {what} is not valid TOML: {exc}") from exc
