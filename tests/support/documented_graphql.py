"""The GraphQL endpoint docs/charging.md shows, built from the page's own code block.

So the suite runs what a reader copies: ``tests/views.py`` routes ``graphql`` at ``/t/graphql``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parents[2] / "docs" / "charging.md"


def example_source(marker: str) -> str:
    """The page's Python block that holds ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.DOTALL)
    (source,) = [block for block in blocks if marker in block]
    return str(source)


def _run(marker: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": __name__}
    exec(compile(example_source(marker), str(PAGE), "exec"), namespace)
    return namespace


graphql = _run("def graphql(")["graphql"]
#: The page's settings for it: ``RATELIMITS``.
SETTINGS: dict[str, Any] = _run('RATELIMITS = {"ENDPOINTS": {"graphql"')["RATELIMITS"]
