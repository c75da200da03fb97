"""docs/architecture.md's module map: every module of the package, its layer, what it is for, its lines.

``python -m tests.support.module_map`` (``make module-map``) writes it from the modules themselves:
the layer from ``tests/test_layers.py``'s tables, what a module is for from its docstring's first
line, and its lines as they stand. ``tests/test_layers.py`` fails while a module is missing from
the map or sits in another layer there; the line counts are as of the last run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_layers import MODULES, folder_of, layer

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "architecture.md"
_BLOCK = re.compile(r"(<!-- module-map:start -->\n).*?(<!-- module-map:end -->)", re.DOTALL)
#: Each layer's name, as the page's layer table gives it.
LAYER_NAMES = ("foundation", "values", "backends", "policy store", "engine", "HTTP", "operator surfaces")


def purpose(path: Path) -> str:
    """The first line of a module's docstring (what it is for), its markup kept."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return doc.strip().split("\n")[0].replace("|", "\\|")


def rows() -> list[tuple[int, str, str, str, int]]:
    """(layer, folder, module, what for, lines) of every module but the migrations, by layer and place."""
    found = []
    for name, path in MODULES.items():
        if name.startswith("ratelimits.migrations."):
            continue
        folder = folder_of(name)
        shown = name.removeprefix("ratelimits.") if name != "ratelimits" else "ratelimits"
        where = folder.removeprefix("ratelimits.") + "/" if folder is not None else ""
        lines = len(path.read_text(encoding="utf-8").splitlines())
        found.append((layer(name), where, shown, purpose(path), lines))
    return sorted(found, key=lambda row: (row[0], row[1], row[2]))


def table() -> str:
    out = ["| layer | folder | module | what it is for | lines |", "|---|---|---|---|---:|"]
    for number, folder, module, what, lines in rows():
        out.append(f"| {number} {LAYER_NAMES[number]} | {folder or '(top)'} | `{module}` | {what} | {lines:,} |")
    return "\n".join(out)


def spliced(text: str) -> str:
    if not _BLOCK.search(text):
        raise ValueError("docs/architecture.md has lost its <!-- module-map:start/end --> markers")
    return _BLOCK.sub(lambda match: f"{match[1]}\n{table()}\n\n{match[2]}", text)


def listed(text: str) -> dict[str, str]:
    """Module -> the layer the page's map gives it."""
    return {m[2]: m[1] for m in re.finditer(r"^\| (\d) [^|]+ \| [^|]+ \| `([^`]+)` \|", text, flags=re.MULTILINE)}


if __name__ == "__main__":
    PAGE.write_text(spliced(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {PAGE}")
