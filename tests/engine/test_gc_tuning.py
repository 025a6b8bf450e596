"""The garbage-collector setting of the processes that run turns (``[host] gc_threshold``)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from actors.engine.gc_tuning import DEFAULT_GC_THRESHOLD, gc_tuned
from actors.engine.settings.config import load_settings
from bus.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_a_tuned_block_raises_the_young_threshold_and_restores_it() -> None:
    before = gc.get_threshold()
    with gc_tuned(20_000):
        assert gc.get_threshold() == (20_000, *before[1:])
    assert gc.get_threshold() == before
    with gc_tuned(0):  # 0: Python's own setting, untouched
        assert gc.get_threshold() == before


def test_the_setting_is_read_from_the_config_and_checked(tmp_path: Path) -> None:
    assert load_settings(ROOT / "configs" / "default.toml").host.gc_threshold == 20_000
    assert load_settings(None).host.gc_threshold == DEFAULT_GC_THRESHOLD
    bad = tmp_path / "bad.toml"
    bad.write_text("[host]\ngc_threshold = -1\n")
    with pytest.raises(ConfigError, match="gc_threshold"):
        load_settings(bad)
