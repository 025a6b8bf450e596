"""One source per default: the settings a deployment reads, the engine's and the loop's own
values, and ``configs/default.toml`` agree, so a default changed in one place cannot leave
another behind."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from pydantic import BaseModel

from actors.engine.settings.config import Settings
from actors.engine.settings.engine_settings import EngineSettings
from actors.turn.settings import LoopSettings
from store.domain.retention import Retention
from store.redis.durability import Durability

DEFAULT_TOML = Path(__file__).resolve().parents[2] / "configs" / "default.toml"

#: The engine alone keeps the store's own defaults for these (any server, fakeredis too, gives
#: ``ack``; nothing expires unless asked); a deployment's come from ``[redis]``/``[retention]``.
ENGINE_ALONE = {"durability": Durability(), "retention": Retention()}


def test_the_loops_defaults_are_the_deployments() -> None:
    assert LoopSettings() == Settings().loop_settings()


def test_the_engines_defaults_are_the_deployments_but_two_named_ones() -> None:
    alone, deployed = EngineSettings(), EngineSettings.of(Settings())
    for field in dataclasses.fields(EngineSettings):
        if field.name in ENGINE_ALONE:
            assert getattr(alone, field.name) == ENGINE_ALONE[field.name]
        else:
            assert getattr(alone, field.name) == getattr(deployed, field.name), field.name


def test_default_toml_names_every_setting_at_its_default() -> None:
    text = DEFAULT_TOML.read_text()
    assert Settings.model_validate(tomllib.loads(text)) == Settings()
    sections = {
        name: info.annotation
        for name, info in Settings.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
    }
    assert sections.keys() == Settings.model_fields.keys()  # every setting is in a section
    for section, model in sections.items():
        body = re.search(rf"(?ms)^\[{section}\]\n(.*?)(?=^\[|\Z)", text)
        assert body is not None, f"[{section}] missing from {DEFAULT_TOML.name}"
        for key in model.model_fields:  # set, or shown commented out where it has no value
            assert re.search(rf"(?m)^#? ?{key} =", body.group(1)), f"[{section}] {key}"
