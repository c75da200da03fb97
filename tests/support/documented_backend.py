"""The core-only backend docs/backends.md documents, built from the page's own code block.

So the suite tests what a reader copies: ``tests.support.documented_backend.DictBackend`` is the
class the page shows, and a project's settings can name it by that path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


def example_source() -> str:
    """The page's Python block that defines ``DictBackend``."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.DOTALL)
    (source,) = [block for block in blocks if "class DictBackend(" in block]
    return str(source)


_namespace: dict[str, Any] = {"__name__": __name__}
exec(compile(example_source(), str(PAGE), "exec"), _namespace)
DictBackend = _namespace["DictBackend"]
DictBackend.__module__ = __name__
