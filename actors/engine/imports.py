"""User code named by import path (``"package.module:name"``): agents, hooks.

A path is what configs and turn specs store, so every process of a deployment loads the very
object the submitter named. Whatever goes wrong (a malformed path, an import that raises, a
missing name) is a :class:`~bus.errors.ConfigError` saying which.
"""

from __future__ import annotations

import importlib
import re

from bus.errors import ConfigError

__all__ = ["load_by_path"]

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def load_by_path(path: str, what: str) -> object:
    """The object at ``path``; ``what`` names it in errors ("agent", "on_finish hook")."""
    if not _PATH.match(path):
        raise ConfigError(f"{what} {path!r}: not an import path of the form 'package.module:name'")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything the user's module raises while importing
        raise ConfigError(f"{what} {path!r}: cannot import {module_name}: {exc!r}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{what} {path!r}: module {module_name} has no {attr!r}") from None
