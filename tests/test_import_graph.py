"""The import graph: adapters depend on the core, never the reverse, and no module circles,
not even through imports made only for type checking."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = "mersal"
ADAPTERS = ("mersal_rabbitmq", "mersal_sqlalchemy")


def modules() -> dict[str, Path]:
    """Every shipped module by dotted name (Alembic's scripts are loaded by Alembic, not us)."""
    found = {}
    for package in (CORE, *ADAPTERS):
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = modules()


def imported(name: str, path: Path) -> set[str]:
    """The shipped modules `name` imports (at any depth, for type checking too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(package, node.level, node.module)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
            targets.update(submodules)
            if len(submodules) < len(node.names):
                targets.add(base)
    return {shipped for target in targets if (shipped := owner(target)) and shipped != name}


def absolute(package: str, level: int, module: str | None) -> str:
    """The absolute name of a (possibly relative) `from ... import`."""
    if not level:
        return module or ""
    parts = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*parts, *([module] if module else [])])


def owner(target: str) -> str | None:
    """The shipped module that `target` is or lies in, if any."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


@functools.cache
def graph() -> dict[str, set[str]]:
    """What each shipped module imports: parsed when a test first asks, not at collection."""
    return {name: imported(name, path) for name, path in MODULES.items()}


def circles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph()[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in graph():
        if module not in index:
            visit(module)
    return found


def test_the_graph_sees_the_imports() -> None:
    assert "mersal.app" in graph()["mersal"]
    assert "mersal.errors" in graph()["mersal_rabbitmq.transport"]
    assert graph()["mersal.errors"] == set()


def test_the_core_imports_no_adapter() -> None:
    reaching = {
        module: sorted(target for target in targets if target.startswith(ADAPTERS))
        for module, targets in graph().items()
        if module == CORE or module.startswith(f"{CORE}.")
    }
    assert {module: found for module, found in reaching.items() if found} == {}


def test_adapters_do_not_import_each_other() -> None:
    for adapter in ADAPTERS:
        others = tuple(other for other in ADAPTERS if other != adapter)
        crossing = {
            module: sorted(target for target in targets if target.startswith(others))
            for module, targets in graph().items()
            if module.startswith(adapter)
        }
        assert {module: found for module, found in crossing.items() if found} == {}


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles() == []


def test_the_app_imports_the_parts_and_no_part_imports_the_app() -> None:
    below = {module for module in graph()["mersal.app"] if module.startswith(f"{CORE}.")}
    assert {"mersal.receiving", "mersal.sending", "mersal.requests", "mersal.settings"} <= below
    assert sorted(module for module in below if "mersal.app" in graph()[module]) == []
