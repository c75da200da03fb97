"""The package's layers point one way, and its imports form no circle.

Every import the package's modules make is read with ``ast``, at any depth (inside functions
too), and imports under ``if TYPE_CHECKING:`` count as well: they never run, but a module that
names a type of a layer above depends on it all the same. Importing ``a.b.c`` also runs the
packages ``a`` and ``a.b``: those count as imported too (unless the importer is inside them
already, when they have run before it).

Each folder (subpackage) lies in one layer, whole (``FOLDERS``); the modules at the package's top
each have their own (``TOP_LEVEL``).

The layers, from the bottom (a module may import its own layer and those below):

0. foundation: settings, exceptions, the named choices, rates and billing periods, the documentation's addresses,
   the webhooks' signature and one delivery attempt, the
   private helpers every layer uses (bounded memos, process-wide values, integer arithmetic); and the
   deprecated ``client``, which re-exports the client distribution (``ratelimits_client``, outside the
   package: clients/python) and imports nothing else (tests/test_client.py checks it loads no other
   module)
1. values: algorithms, identity, decisions, counters, the adaptive capacity, the metrics' recorder, the quota
   thresholds a decision shows crossed;
   policies and the settings source
2. backends: where limiter state lives, the core contract and its capabilities
3. the policy store: models, the database source, versioning, audit, usage records and their readers
4. the engine
5. HTTP: throttles, DRF, middleware, headers, problems, views, status, the OpenAPI schema; the test
   kit for a project's own suite (``testing``)
6. operator surfaces: admin, reports, commands, tasks, checks, the app config
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ratelimits"

#: Each folder (subpackage) of the package and its layer: every module in it lies in that layer.
FOLDERS: dict[str, int] = {
    "ratelimits.conf": 0,
    "ratelimits.client": 0,
    "ratelimits.policies": 1,
    "ratelimits.backends": 2,
    "ratelimits.store": 3,
    "ratelimits.usage": 3,
    "ratelimits.migrations": 3,
    "ratelimits.engine": 4,
    "ratelimits.testing": 5,
    "ratelimits.reports": 6,
    "ratelimits.templatetags": 6,
    "ratelimits.management": 6,
}

#: The modules at the package's top, each in its own layer (a folder's modules are never listed here).
TOP_LEVEL: dict[str, int] = {
    "ratelimits": 0,
    "ratelimits.exceptions": 0,
    "ratelimits._memo": 0,
    "ratelimits._numbers": 0,
    "ratelimits._process": 0,
    "ratelimits.choices": 0,
    "ratelimits.rates": 0,
    "ratelimits.periods": 0,
    "ratelimits.documentation": 0,
    "ratelimits.redis_url": 0,
    "ratelimits.webhooks": 0,
    "ratelimits.algorithms": 1,
    "ratelimits.identity": 1,
    "ratelimits.decisions": 1,
    "ratelimits.counters": 1,
    "ratelimits.shares": 1,
    "ratelimits.adaptive": 1,
    "ratelimits.thresholds": 1,
    "ratelimits.replay": 1,
    "ratelimits.metrics": 1,
    "ratelimits.models": 3,
    "ratelimits.sources": 3,
    "ratelimits.reconciler": 3,
    "ratelimits.throttles": 5,
    "ratelimits.drf": 5,
    "ratelimits.middleware": 5,
    "ratelimits.decorators": 5,
    "ratelimits.headers": 5,
    "ratelimits.problems": 5,
    "ratelimits.views": 5,
    "ratelimits.endpoints": 5,
    "ratelimits.status": 5,
    "ratelimits.openapi": 5,
    "ratelimits.admin": 6,
    "ratelimits.autocomplete": 6,
    "ratelimits.checks": 6,
    "ratelimits.apps": 6,
    "ratelimits.tasks": 6,
    "ratelimits.periodic": 6,
}

#: The only imports of the package's own modules allowed inside a function: those Django's app
#: loading demands (the models are not importable yet when the importing module is).
FUNCTION_LEVEL = {
    ("ratelimits.apps", "ratelimits.checks"),
    ("ratelimits.apps", "ratelimits.store"),
    ("ratelimits.apps", "ratelimits.store.audit"),
    ("ratelimits.apps", "ratelimits.store.notices"),
    ("ratelimits.apps", "ratelimits.usage"),
    ("ratelimits.apps", "ratelimits.usage.subjects"),
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    in_function: bool
    #: Under ``if TYPE_CHECKING:``: an annotation's dependency, never run.
    type_only: bool
    #: The source lines around the import (for the comment a function-level import needs).
    context: str


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package modules an import statement runs (own modules only)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        # "from x import y" runs x, and x.y too when y is a module.
        names = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    # The importer's own packages have run before it: importing from them runs nothing new.
    own = {importer, *ancestors(importer)}
    return [name for name in names if (name == "ratelimits" or name.startswith("ratelimits.")) and name not in own]


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str) -> list[Import]:
    source = MODULES[name].read_text()
    lines = source.splitlines()
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                context = "\n".join(lines[max(child.lineno - 3, 0) : child.lineno])
                for target in resolve(name, child):
                    found.append(Import(name, target, child.lineno, in_function, type_only, context))
            visit(
                child,
                in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                type_only or is_type_checking(child),
            )

    visit(ast.parse(source), False, False)
    return found


def folder_of(name: str) -> str | None:
    """The subpackage of the package that holds ``name`` (or is ``name``), if any."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and ".".join(parts[:2]) in FOLDERS else None


def layer(name: str) -> int:
    folder = folder_of(name)
    if folder is not None:
        return FOLDERS[folder]
    assert name in TOP_LEVEL, (
        f"{name} has no layer: add it to TOP_LEVEL (or its folder to FOLDERS) in {Path(__file__).name}"
    )
    return TOP_LEVEL[name]


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.cache
def edges() -> dict[str, set[str]]:
    """Module -> the package modules importing it runs: its targets, and their packages."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        own = {name, *ancestors(name)}
        for found in imports_of(name):
            graph[name].add(found.target)
            graph[name].update(p for p in ancestors(found.target) if p not in own)
    return graph


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer(name)


def test_every_module_lies_in_its_folders_layer() -> None:
    """No module of a folder is given a layer of its own, and every folder has one layer for all."""
    folders = {module_name(path.parent / "__init__.py") for path in PACKAGE.glob("*/__init__.py")}
    assert folders == set(FOLDERS), "each folder of the package is listed in FOLDERS, and only those"
    assert [name for name in TOP_LEVEL if folder_of(name) is not None or name not in MODULES] == []
    for name in MODULES:
        folder = folder_of(name)
        assert folder is not None or name.count(".") <= 1, name
        if folder is not None:
            assert layer(name) == FOLDERS[folder]


def test_type_checking_imports_are_read() -> None:
    """The walk sees an import only annotations use, as a dependency like any other."""
    typed = {found.target for found in imports_of("ratelimits.backends.base") if found.type_only}
    assert "ratelimits.decisions" in typed
    assert "ratelimits.decisions" in edges()["ratelimits.backends.base"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_reaches_up_a_layer(name: str) -> None:
    upward = [
        f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
        for target in sorted(edges()[name])
        if layer(target) > layer(name)
    ]
    assert upward == []


def test_the_imports_form_no_circle() -> None:
    graph = edges()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert circles == []


def test_own_imports_inside_functions_are_the_few_app_loading_needs() -> None:
    inside = [found for name in MODULES for found in imports_of(name) if found.in_function and not found.type_only]
    assert {(found.importer, found.target) for found in inside} == FUNCTION_LEVEL
    for found in inside:
        assert "#" in found.context, f"{found.importer}:{found.line} must say why it imports inside a function"


def test_the_graph_is_read_at_all() -> None:
    """The walk itself can fail: it sees the imports the engine is known to make."""
    graph = edges()
    assert {"ratelimits.backends", "ratelimits.backends.memory", "ratelimits.decisions"} <= graph[
        "ratelimits.engine.limiter"
    ]
    assert "ratelimits.engine" in graph["ratelimits.throttles"]
    assert "ratelimits.policies" in graph["ratelimits.backends.redis"]  # the package runs before its module


def test_the_architecture_pages_module_map_lists_every_module_in_its_layer() -> None:
    """docs/architecture.md's map (``make module-map``) names each module with the layer it is in."""
    from .support.module_map import PAGE, listed, rows

    on_page = listed(PAGE.read_text(encoding="utf-8"))
    expected = {module: str(number) for number, _, module, _, _ in rows()}
    assert on_page == expected, "docs/architecture.md's module map is out of date: run `make module-map`"
