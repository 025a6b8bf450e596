"""The public API: what ``actors`` exports, and the README's Python program, run verbatim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import actors
from actors.engine.shipped import scenario_path
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


def test_the_readme_program_runs(redis_url: str, tmp_path: Path) -> None:
    program = tmp_path / "hello.py"
    program.write_text(readme_program())
    env = {**os.environ, "PHASELINE_REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, str(program)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["answered", "33", "messages"]


def test_shipped_scenarios_are_found_by_name() -> None:
    assert scenario_path("tool_loop") == ROOT / "configs" / "scenarios" / "tool_loop.toml"
    assert scenario_path("my/own.toml") == Path("my/own.toml")  # a path stays a path
    with pytest.raises(ConfigError, match=r"shipped ones: .*tool_loop"):
        scenario_path("no_such_scenario")
