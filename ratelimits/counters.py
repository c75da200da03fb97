"""Usage counters: what one decision adds to its minute's counters, and how their fields are named.

The decide call increments, in the same round trip, one hash per minute whose fields are
``<subject, organisation, tier, endpoint><metric>``: allowed, limited (429), shed (503), degraded
(decided without the store) and tokens spent beyond one per allowed request. The drain
(:mod:`ratelimits.usage`) moves closed minutes into ``UsageRecord`` rows.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import NamedTuple

__all__ = ["ALLOWED", "DEGRADED", "EXTRA_TOKENS", "LIMITED", "METRICS", "SHED", "Usage", "parse_field", "usage_for"]

#: The metric suffixes of a counter field.
ALLOWED, LIMITED, SHED, DEGRADED, EXTRA_TOKENS = "a", "l", "s", "d", "x"
#: Field suffix -> UsageRecord column. Tokens are counted as the allowed requests (one each) plus
#: ``x``, the tokens beyond one that costlier requests spent: one counter less on the hot path.
METRICS = {ALLOWED: "allowed", LIMITED: "throttled", SHED: "shed", DEGRADED: "degraded", EXTRA_TOKENS: "tokens"}


class Usage(NamedTuple):
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
