"""Usage counting: per-minute counters written by the decision itself, drained into the database.

The decide script increments, in the same round trip, one hash per minute whose fields are
``<subject, organisation, tier, endpoint><metric>``: allowed, limited (429), shed (503),
degraded (decided without the store) and tokens spent. A drain moves closed minutes into
``UsageRecord`` rows exactly once, whatever crashes, retries or duplicate deliveries happen.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["METRICS", "Usage", "usage_for"]

#: Field suffix -> UsageRecord column.
METRICS = {"a": "allowed", "l": "throttled", "s": "shed", "d": "degraded", "t": "tokens"}


@dataclass(frozen=True, slots=True)
class Usage:
    """Where one request's usage is counted: the minute and the field prefix of its subject."""

    minute: int
    field: str
    tokens: int


def usage_for(kind: str, value: str, organization: str, tier: str, endpoint: str, tokens: int) -> Usage:
    """The usage of one request made now (minutes since the epoch on this process's clock)."""
    return Usage(int(time.time() // 60), _field(kind, value, organization, tier, endpoint), tokens)


@lru_cache(maxsize=65_536)
def _field(kind: str, value: str, organization: str, tier: str, endpoint: str) -> str:
    # JSON, because organisations and endpoints are the host's strings: no separator is safe.
    return json.dumps([kind, value, organization, tier, endpoint], separators=(",", ":"))


def parse_field(field: str) -> tuple[tuple[str, str, str, str, str], str] | None:
    """``(subject kind, id, organisation, tier, endpoint), metric column`` of a counter field."""
    metric = METRICS.get(field[-1:])
    if metric is None:
        return None
    try:
        parts = json.loads(field[:-1])
    except ValueError:
        return None
    if not isinstance(parts, list) or len(parts) != 5 or not all(isinstance(p, str) for p in parts):
        return None
    return (parts[0], parts[1], parts[2], parts[3], parts[4]), metric


def tier_of(names: Sequence[str]) -> str:
    """The tier named by a request's policies (``tier:<name>``), or ``""``."""
    for name in names:
        if name.startswith("tier:"):
            return name.split(":", 2)[1]
    return ""
