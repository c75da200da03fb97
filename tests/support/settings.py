"""``RATELIMITS`` for one test: the suite's settings with some settings changed, namespaces merged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ratelimits.conf import NAMESPACES


def merged(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` written over it: a namespace (``REDIS``, ``POLICIES``...) given in
    both keeps the base's settings the changes do not name; any other value is replaced whole."""
    result = dict(base)
    for key, value in changes.items():
        inner = result.get(key)
        if key in NAMESPACES and isinstance(inner, Mapping) and isinstance(value, Mapping):
            result[key] = {**inner, **value}
        else:
            result[key] = value
    return result
