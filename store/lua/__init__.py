"""Redis server-side scripts, one file each, with its KEYS/ARGV contract on top."""

from __future__ import annotations

from importlib.resources import files

__all__ = ["all_scripts", "lua_script"]


def lua_script(name: str) -> str:
    """The source of ``store/lua/<name>``, read once per importing module."""
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def all_scripts() -> list[str]:
    """The source of every script here (what a server that lost its cache is given again)."""
    return [
        f.read_text(encoding="utf-8") for f in files(__name__).iterdir() if f.name.endswith(".lua")
    ]
