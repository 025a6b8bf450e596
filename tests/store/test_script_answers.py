"""Every server-side script's answers are an enum its reader declares, read in one place
(``store.redis.replies.answer``): each script names its enum in its header, the words and codes
it can answer are exactly the enum's values, and an answer the enum lacks is a typed error,
never read as a yes or a no."""

from __future__ import annotations

import re
from enum import Enum
from importlib import import_module
from importlib.resources import files

import pytest

from bus.errors import StoreError
from store.domain.inbox import PushAnswer
from store.domain.retention import PurgeAnswer
from store.lua import lua_script
from store.redis.replies import answer

#: Scripts whose answer is data (a number, a count, a record), not a choice among outcomes.
DATA = {
    "checkpoint_load.lua": "the record's fields and bodies",
    "effect_increment.lua": "the call key's runs",
    "events_publish.lua": "how many events",
    "model_admit.lua": "how long to wait (0: admitted)",
    "model_pause.lua": "the pause's end",
    "model_settle.lua": "nothing anyone reads",
}

SCRIPTS = sorted(f.name for f in files("store.lua").iterdir() if f.name.endswith(".lua"))


def declared(name: str) -> type[Enum]:
    found = re.search(r"^-- Read as ([\w.]+)\.(\w+)", lua_script(name), re.M)
    assert found, f"{name} names no enum its answers are read as"
    kind = getattr(import_module(found[1]), found[2])
    assert issubclass(kind, Enum)
    return kind


def answered(source: str) -> set[object]:
    """The literal answers of a script: ``return <int>`` and the first word of a table
    answered or built to be answered."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("--"))
    codes = {int(n) for n in re.findall(r"\breturn (-?\d+)\b", code)}
    words = set(re.findall(r"(?:return|out =|local out =) \{'(\w+)'", code))
    return codes | words


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s not in DATA])
def test_a_script_answers_exactly_the_values_of_its_enum(name: str) -> None:
    kind = declared(name)
    assert answered(lua_script(name)) == {m.value for m in kind}, name


def test_every_script_is_read_as_an_enum_or_answers_data() -> None:
    assert set(DATA) <= set(SCRIPTS)
    for name in SCRIPTS:
        assert (name in DATA) != bool(re.search(r"^-- Read as ", lua_script(name), re.M)), name


def test_an_answer_is_read_from_a_word_a_code_or_the_head_of_a_list() -> None:
    assert answer(PushAnswer, -1, "push") is PushAnswer.NO_TURN
    assert answer(PurgeAnswer, b"1", "purge") is PurgeAnswer.PURGED
    assert answer(PurgeAnswer, [1, b"rest"], "purge") is PurgeAnswer.PURGED


@pytest.mark.parametrize("reply", [2, b"maybe", [], None, [b"yes"]])
def test_an_answer_the_enum_lacks_is_a_store_error(reply: object) -> None:
    with pytest.raises(StoreError, match="purge t1: unexpected answer"):
        answer(PurgeAnswer, reply, "purge t1")
