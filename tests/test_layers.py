"""The layers of the tree, enforced: every import of every module (top level or inside a
function) is read with ``ast`` and checked against the rules of docs/ARCHITECTURE.md (its
"The layers")."""

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
    "store/redis": ("actors", "ray", "store.write", "store.domain", "store.views"),
    "actors/turn": ("ray", "redis", "actors.engine", "actors.cluster", "actors.harness",
                    "actors.console", "actors.cli"),
    "actors/engine": ("ray", "actors.cluster", "actors.harness", "actors.console", "actors.cli"),
    "actors/cluster": ("actors.harness", "actors.console", "actors.cli"),
    "actors/harness": ("actors.console", "actors.cli"),
    "actors/console": ("actors.harness", "actors.cli"),
    "actors/examples": ("ray", "redis", "actors.cluster", "actors.harness", "actors.console",
                        "actors.cli"),
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
    assert subpackages == {"turn", "engine", "cluster", "harness", "console", "examples", "cli"}


@pytest.mark.parametrize(("package", "banned"), [("actors.turn", ("ray", "redis")),
                                                 ("actors.engine", ("ray",)),
                                                 ("bus", ("ray", "redis"))])  # fmt: skip
def test_importing_a_layer_loads_nothing_it_must_not_use(
    package: str, banned: tuple[str, ...]
) -> None:
    """Transitively: the modules a layer pulls in (through ``store``, say) stay clean too."""
    names = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in modules(package.replace(".", "/"))
    ]
    loaded = loaded_by(names, set(banned))
    assert loaded == [], f"{package} loads {loaded}"


def loaded_by(names: list[str], packages: set[str]) -> list[str]:
    """Which of ``packages`` a fresh interpreter has loaded after importing the modules
    ``names``."""
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {packages!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return list(ast.literal_eval(done.stdout.strip()))


#: The modules whose classes Ray starts a process for (each such process imports its module).
ACTOR_MODULES = [f"actors.cluster.{m}" for m in ("turn_actor", "checkpoint_actor", "supervisor",
                                                  "watchdog_actor", "recovery_actor",
                                                  "tool_workers")]  # fmt: skip


def test_an_actor_process_imports_no_sdk_its_agents_may_not_use() -> None:
    """Every actor process pays its imports at start, in every deployment and every test that
    starts one: the MCP SDK alone took 0.4 s of CPU a process (a deployment's start 8.0-8.6 s
    against 4.0-4.2 s without it, on this 2-core machine). The SDKs of optional features load
    where they are used."""
    sdks = {"mcp", "mcp_types", "openai", "starlette", "uvicorn", "jinja2", "matplotlib", "rich"}
    loaded = loaded_by(ACTOR_MODULES, sdks)
    assert loaded == [], f"an actor process loads {loaded}"


def test_the_rules_catch_a_breach(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    import ray\n    from redis.asyncio import Redis\n")
    assert imports_of(bad) == {"ray", "redis.asyncio"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (anywhere in it, type-checking blocks
    included: a cycle there is still two modules that must be read together)."""
    paths = [p for pkg in ("bus", "store", "actors") for p in modules(pkg)]
    names = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        targets = set()
        for name in imports_of(path):
            while name and name not in names:  # "from pkg.mod import x" where x is a name
                name = name.rpartition(".")[0]
            if name:
                targets.add(name)
        graph[_module_name(path)] = targets - {_module_name(path)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_modules_import_each_other() -> None:
    # a package's __init__ re-exporting its modules is not a circle of the design
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in import_graph().items()}
    assert cycles(graph) == []


def test_the_cycle_check_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_scripts_use_the_package_not_the_tests() -> None:
    """A measuring script runs from an install too: what it needs (the scripted endpoint, the
    HTTP agents) is in the package, never in ``tests/``."""
    leaning = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "scripts").iterdir())
        if path.is_file()
        and ("tests.support" in (text := path.read_text()) or "tests/support" in text)
    ]
    assert not leaning, leaning


def test_no_module_is_over_500_lines() -> None:
    """A module a newcomer opens holds one concept; past 500 lines it holds several."""
    long = [
        f"{path.relative_to(ROOT)}: {n}"
        for package in ("bus", "store", "actors")
        for path in modules(package)
        if (n := len(path.read_text().splitlines())) > 500
    ]
    assert not long, long
