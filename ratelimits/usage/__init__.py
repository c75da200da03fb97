"""Usage: what callers did, drained from the decisions' own counters into the database.

- :mod:`.records`: the exactly-once drain into ``UsageRecord`` rows, roll-ups and retention.
- :mod:`.subjects`: the labels of the digests the counters name subjects by, written by the workers.
- :mod:`.live` and :mod:`.readers`: the minutes not drained yet, and the one reading of usage
  every reader shares (the admin's report, ``GET /v1/usage``, ``today``).

What a decision counts, and how the counters' fields are named, is :mod:`ratelimits.counters`:
the store's side, which needs no database. How often the drain and the upkeep run is
:mod:`ratelimits.periodic`; what reads usage for people (the admin's report, the daily digest) is
:mod:`ratelimits.reports`, a layer above.
"""

from typing import Any

from .readers import today_usage
from .records import drain, purge, rollup
from .subjects import purge as purge_labels

__all__ = ["drain", "maintain", "purge", "purge_labels", "rollup", "today_usage"]


def maintain() -> dict[str, Any]:
    """Roll minutes up into hours and days, then purge old minute rows and the labels no counter names any more."""
    return {"rolled_up": rollup(), "purged": purge(), "labels_purged": purge_labels()}
