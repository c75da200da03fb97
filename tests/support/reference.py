"""docs/configuration.md's tables of every setting, spliced in from ``ratelimits.conf.reference()``.

``python -m tests.support.reference`` (``make settings-reference``) writes them; the docs test
fails while the page and the declarations differ.
"""

from __future__ import annotations

import re
from pathlib import Path

from ratelimits.conf import reference

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "configuration.md"
_BLOCK = re.compile(r"(<!-- reference:start -->\n).*?(<!-- reference:end -->)", re.DOTALL)


def spliced(text: str) -> str:
    """``text`` with the block between the reference markers written from the declarations."""
    if not _BLOCK.search(text):
        raise ValueError("docs/configuration.md has lost its <!-- reference:start/end --> markers")
    return _BLOCK.sub(lambda match: f"{match[1]}\n{reference()}\n{match[2]}", text)


if __name__ == "__main__":
    PAGE.write_text(spliced(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {PAGE}")
