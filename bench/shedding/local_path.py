"""Issue 12's scenario: closed-loop floods, and what a request refused before authentication costs.

With both shedders on, after the flood scenario's phases on the same server:

- ``exports32-on``, ``abusive32-on``: charges beside 32 kept-open connections of exports, or of
  one abusive API key (tier ``abusive``, 10/s) asking ``GET /v1/customers``;
- ``cpu-idle``, then ``cpu-admitted``, ``cpu-early-429``, ``cpu-early-503``: no charges, one kind
  of request each (admitted GETs, the abusive key's 429s from memory, exports mostly shed), and
  gunicorn's CPU per request less what it uses idle.

Then gunicorn again without the local path (``BENCH_SHEDDING_LOCAL=0``: no denial cache, no
``EarlyRejectionMiddleware``): ``abusive32-central`` and ``cpu-429-central``, for comparison.

Targets: critical p99 during each 32-connection flood <= 3 x unloaded; a request refused before
authentication costs <= 15 % of an admitted request's CPU.
"""

from __future__ import annotations

from typing import Any

from .configuration import SHEDDING_ON, Configuration

CONFIGURATIONS = (
    Configuration(
        "on",
        SHEDDING_ON,
        (
            ("exports32-on", "exports32"),
            ("abusive32-on", "abusive32"),
            ("cpu-idle", None),
            ("cpu-admitted", "cpu-admitted"),
            ("cpu-early-429", "cpu-early-429"),
            ("cpu-early-503", "cpu-early-503"),
        ),
    ),
    # The same abusive flood, and its refusals' CPU, without the local path (every 429
    # authenticated and decided by the store, as before issue 12).
    Configuration(
        "on-central",
        {**SHEDDING_ON, "BENCH_SHEDDING_LOCAL": "0"},
        (("abusive32-central", "abusive32"), ("cpu-idle-central", None), ("cpu-429-central", "cpu-early-429")),
    ),
)


def targets(phases: dict[str, Any], unloaded_p99: float | None) -> dict[str, Any]:
    """Issue 12's: critical p99 <= 3 x unloaded under 32 connections of exports, and of one abusive key;
    a request refused before authentication (429 from memory, 503 from the worker shedder) costs the
    workers <= 15 % of an admitted request's CPU.

    Each cpu- phase sends one kind of request; its CPU per request is gunicorn's CPU over every
    request sent. The early-503 phase's exports are mostly shed, the rest admitted (and costlier):
    its figure is an upper bound of a shed request's.
    """
    floods = {}
    for name in ("exports32-on", "abusive32-on"):
        latency = phases[name]["critical"]["latency_all"]
        p99 = latency["p99_ms"] if latency else None
        ratio = round(p99 / unloaded_p99, 2) if p99 is not None and unloaded_p99 else None
        floods[name] = {
            "critical_p99_ms": p99,
            "ratio": ratio,
            "met": ratio is not None and ratio <= 3.0,
            "critical_success_rate": phases[name]["critical"]["success_rate"],
        }
    admitted = phases["cpu-admitted"]["normal"].get("gunicorn_cpu_us_per_request")
    cpu = {}
    for name, klass in (("cpu-early-429", "abusive"), ("cpu-early-503", "low")):
        per = phases[name][klass].get("gunicorn_cpu_us_per_request")
        share = round(per / admitted, 3) if per is not None and admitted else None
        cpu[name] = {"cpu_us_per_request": per, "share_of_admitted": share, "met": share is not None and share <= 0.15}
    central = phases.get("cpu-429-central", {}).get("abusive", {}).get("gunicorn_cpu_us_per_request")
    abusive_central = (phases.get("abusive32-central", {}).get("critical") or {}).get("latency_all") or {}
    return {
        "local_path_floods": floods,
        "admitted_cpu_us_per_request": admitted,
        "early_refusal_cpu": cpu,
        # Without the local path, for comparison: a 429's CPU, and the abusive flood's critical p99.
        "central_429_cpu_us_per_request": central,
        "abusive_central_critical_p99_ms": abusive_central.get("p99_ms"),
    }
