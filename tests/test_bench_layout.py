"""bench/ stands on its own: it imports nothing of the tests, and its imports form no circle.

Every import of every module under ``bench/`` is read with ``ast``, at any depth (inside
functions too, as ``bench`` imports much after Django is set up). What bench needs to start
servers and processes is in ``bench/support``, which imports no other part of bench.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(BENCH.rglob("*.py"))}


def imported(name: str) -> set[str]:
    """The absolute names ``name``'s module imports; ``from a import b`` names ``a.b`` when that is a module."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules() else source)
    return found


def test_the_bench_modules_are_found() -> None:
    expected = {"bench", "bench.__main__", "bench.support", "bench.support.redis_server"}
    assert expected | {"bench.shedding", "bench.shedding.__main__", "bench.shedding.flood"} <= set(modules())


def test_no_bench_module_imports_the_tests() -> None:
    found = {
        (name, target)
        for name in modules()
        for target in imported(name)
        if target == "tests" or target.startswith("tests.")
    }
    assert found == set()


def test_no_bench_module_runs_under_the_tests_settings() -> None:
    """The scripts that set Django up from a module name bench's own (``bench.support.django_settings``)."""
    named = {
        name
        for name, path in modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value == "tests.settings"
    }
    assert named == set()


def test_bench_support_imports_no_other_part_of_bench() -> None:
    found = {
        (name, target)
        for name in modules()
        if name.startswith("bench.support")
        for target in imported(name)
        if target.startswith("bench") and not target.startswith("bench.support")
    }
    assert found == set()


def test_the_bench_imports_form_no_circle() -> None:
    graph = {name: sorted(target for target in imported(name) if target in modules()) for name in modules()}
    circles: list[list[str]] = []
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = "open"
        path.append(name)
        for target in graph[name]:
            if state.get(target) == "open":
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name)
    assert circles == []
