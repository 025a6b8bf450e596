"""The public API: what ``actors`` exports, and the README's Python program, run verbatim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import actors
from actors.engine.settings.shipped import scenario_path
from bus.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def readme_program() -> str:
    text = (ROOT / "README.md").read_text()
    marker = "<!-- the program below is run verbatim by tests/test_public_api.py -->"
    found = re.search(re.escape(marker) + r"\n```python\n(.*?)```", text, re.S)
    assert found, "the README's Python program is missing"
    return found.group(1)


def test_every_export_resolves_and_is_listed() -> None:
    assert len(set(actors.__all__)) == len(actors.__all__)  # ruff (RUF022) keeps it sorted
    for name in actors.__all__:
        assert getattr(actors, name) is not None, name
    assert issubclass(actors.StoreUnavailable, actors.StoreError)
    assert issubclass(actors.StaleOwner, actors.PhaselineError)


def test_the_readme_program_runs_from_an_empty_directory(tmp_path: Path) -> None:
    """Outside the checkout, with no Redis URL anywhere: the program finds (here: starts) the
    embedded server every CLI verb uses, and the shipped scenario by its name. It used to need
    ``$PHASELINE_REDIS_URL`` and the checkout's ``configs/`` as its working directory."""
    program = tmp_path / "hello.py"
    program.write_text(readme_program())
    env = {k: v for k, v in os.environ.items() if k != "PHASELINE_REDIS_URL"}
    env["PHASELINE_DATA_DIR"] = str(tmp_path / "redis")  # a server of its own, started by it
    done = subprocess.run(
        [sys.executable, str(program)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["answered", "33", "messages"]
    assert not (tmp_path / "redis" / "url").exists() or _stopped(tmp_path / "redis")


def _stopped(data_dir: Path) -> bool:
    """The embedded server the program started was stopped with its deployment."""
    url = (data_dir / "url").read_text().strip()
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError:
        return True
    return False


def test_shipped_scenarios_are_found_by_name() -> None:
    assert scenario_path("tool_loop") == ROOT / "configs" / "scenarios" / "tool_loop.toml"
    assert scenario_path("my/own.toml") == Path("my/own.toml")  # a path stays a path
    with pytest.raises(ConfigError, match=r"shipped ones: .*tool_loop"):
        scenario_path("no_such_scenario")
