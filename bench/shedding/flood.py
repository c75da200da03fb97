"""The flood: critical charges beside slow low-priority exports, shedding off, then on.

1. ``unloaded``: charges only, shedding off: the baseline.
2. ``flood-off``: charges and the export flood (one export a second from each of 64 keys).
3. ``unloaded-on``: charges only, shedding on: what the shedders cost when nothing is shed.
4. ``flood-on``: phase 2 with both shedders on.
5. With ``--fleet-only``: ``flood-fleet``, phase 2 with the fleet shedder alone (for information).

Targets, in ``flood-on``: critical success >= 99 %, critical p99 <= 2 x that of ``unloaded``.
"""

from __future__ import annotations

from typing import Any

from ..load import FLEET_CAPACITY
from .configuration import SHEDDING_ON, Configuration

CONFIGURATIONS = (
    Configuration("off", {}, (("unloaded", None), ("flood-off", "periodic"))),
    Configuration("on", SHEDDING_ON, (("unloaded-on", None), ("flood-on", "periodic"))),
)
#: Informative: the fleet shedder without the worker shedder (one host, gthread workers).
FLEET_ONLY = (
    Configuration("fleet", {"BENCH_SHEDDING_FLEET_CAPACITY": str(FLEET_CAPACITY)}, (("flood-fleet", "periodic"),)),
)


def targets(phases: dict[str, Any]) -> dict[str, Any]:
    """With shedding on under the flood: critical success >= 99 %, critical p99 <= 2 x unloaded p99.

    p99 over every answered critical request (2xx or not); the baseline is phase 1 (unloaded,
    shedding off). The ratio to the unloaded run with shedding on is reported as well.
    """
    flood = phases["flood-on"]["critical"]
    base = phases["unloaded"]["critical"]["latency_all"]
    base_on = phases["unloaded-on"]["critical"]["latency_all"]
    p99 = flood["latency_all"]["p99_ms"] if flood["latency_all"] else None
    success = flood["success_rate"]
    ratio = round(p99 / base["p99_ms"], 2) if p99 is not None and base else None
    return {
        "critical_success_rate": success,
        "critical_success_met": success is not None and success >= 0.99,
        "critical_p99_ms": p99,
        "unloaded_p99_ms": base["p99_ms"] if base else None,
        "p99_ratio": ratio,
        "p99_met": ratio is not None and ratio <= 2.0,
        "unloaded_on_p99_ms": base_on["p99_ms"] if base_on else None,
        "p99_ratio_to_unloaded_on": round(p99 / base_on["p99_ms"], 2) if p99 is not None and base_on else None,
        "flood_off_critical_success_rate": phases["flood-off"]["critical"]["success_rate"],
        "flood_off_critical_p99_ms": (phases["flood-off"]["critical"]["latency_all"] or {}).get("p99_ms"),
    }
