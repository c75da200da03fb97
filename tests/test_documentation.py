"""The addresses the package gives its readers (``ratelimits.documentation``) name pages and anchors that exist."""

from __future__ import annotations

import ast
from pathlib import Path

from ratelimits import documentation

from .support.processes import REPO

PACKAGE = REPO / "ratelimits"


def pointers() -> list[tuple[str, int, list[str]]]:
    """Every ``documentation.page(...)`` call in the package: its file, line and arguments."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "page"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "documentation"
            ):
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                arguments = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
                assert len(arguments) == len(node.args) and not node.keywords, f"{where}: give the page as literals"
                found.append((where, node.lineno, arguments))
    return found


def test_every_page_and_section_the_package_names_is_in_the_built_site(built_site: Path) -> None:
    found = pointers()
    assert len(found) >= 3  # the messages converted so far: a global tier's quota, twice, and async checks
    for where, _, arguments in found:
        name, *section = arguments
        html = built_site / f"{name}.html"
        assert (REPO / "docs" / f"{name}.md").is_file() and html.is_file(), f"{where}: no page {name!r}"
        if section:
            assert f'id="{section[0]}"' in html.read_text(encoding="utf-8"), f"{where}: {name} has no #{section[0]}"


def test_an_address_is_the_published_page_at_its_anchor() -> None:
    assert documentation.page("regions", "not-supported") == f"{documentation.SITE}regions.html#not-supported"
    assert documentation.page("contract") == f"{documentation.SITE}contract.html"
    assert documentation.SITE.startswith("https://") and documentation.SITE.endswith("/")
