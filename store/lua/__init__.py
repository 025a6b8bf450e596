"""Redis server-side scripts, one file each, with its KEYS/ARGV contract on top."""

from __future__ import annotations

from importlib.resources import files

__all__ = ["lua_script"]


def lua_script(name: str) -> str:
    """The source of ``store/lua/<name>``, read once per importing module."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")
