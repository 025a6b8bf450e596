"""The layers of the tree, enforced: every import of every module (top level or inside a
function) is read with ``ast`` and checked against the rules of docs/ARCHITECTURE.md."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package (path prefix) -> import prefixes it must not use.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "bus": ("store", "actors", "ray", "redis"),
    "store": ("actors", "ray"),
    "actors/turn": ("ray", "redis", "actors.engine", "actors.cluster", "actors.harness",
                    "actors.cli"),
    "actors/engine": ("ray", "actors.cluster", "actors.harness", "actors.cli"),
    "actors/cluster": ("actors.harness", "actors.cli"),
    "actors/harness": ("actors.cli",),
    "actors/examples": ("ray", "redis", "actors.cluster", "actors.harness", "actors.cli"),
}  # fmt: skip


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def modules(prefix: str) -> list[Path]:
    return sorted((ROOT / prefix).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_imports_only_what_is_below_it(package: str) -> None:
    broken = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules(package)
        for name in sorted(imports_of(path))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[package])
    ]
    assert not broken, "\n".join(broken)


def test_every_module_of_actors_is_in_a_layer() -> None:
    top = sorted(p.name for p in (ROOT / "actors").glob("*.py"))
    assert top == ["__init__.py"]
    subpackages = {p.name for p in (ROOT / "actors").iterdir() if (p / "__init__.py").exists()}
    assert subpackages == {"turn", "engine", "cluster", "harness", "examples", "cli"}


@pytest.mark.parametrize(("package", "banned"), [("actors.turn", ("ray", "redis")),
                                                 ("actors.engine", ("ray",)),
                                                 ("bus", ("ray", "redis"))])  # fmt: skip
def test_importing_a_layer_loads_nothing_it_must_not_use(
    package: str, banned: tuple[str, ...]
) -> None:
    """Transitively: the modules a layer pulls in (through ``store``, say) stay clean too."""
    names = [
        f"{package}.{p.stem}" if p.stem != "__init__" else package
        for p in modules(package.replace(".", "/"))
    ]
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(banned)!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{package} loads {done.stdout.strip()}"


def test_the_rules_catch_a_breach(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    import ray\n    from redis.asyncio import Redis\n")
    assert imports_of(bad) == {"ray", "redis.asyncio"}
