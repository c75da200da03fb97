"""Django settings for ``python -m bench.shedding``: the demo project, with policies from settings.

The demo keeps its policies in the database (``DatabasePolicySource``, edited in the admin); the
load-shedding benchmark replaces them with explicit ``TIERS``/``ENDPOINTS`` so a run depends on
no admin rows. Everything that changes between runs comes from the environment, set by
``bench/shedding.py`` when it starts gunicorn:

- ``BENCH_SHEDDING_DB``: the SQLite file (a temporary one; API keys are seeded into it).
- ``BENCH_SHEDDING_REDIS_URL``: the benchmark's private Redis.
- ``BENCH_SHEDDING_FLEET_CAPACITY`` / ``BENCH_SHEDDING_WORKER_CAPACITY``: an integer, or empty
  for ``None`` (that shedder off).
- ``BENCH_SHEDDING_LOCAL``: ``0`` turns the local path's denials and ``EarlyRejectionMiddleware``
  off (the comparison phases).
- ``BENCH_SHEDDING_ADAPTIVE``: ``1`` sets ``ADAPTIVE_CAPACITY`` (its defaults): the worker
  shedder's capacity follows latency, up to ``SHEDDING['WORKER_CAPACITY']``.
- ``BENCH_SHEDDING_DOWNSTREAM``: the demo's ``DEMO_DOWNSTREAM``, as JSON (project/payments/downstream.py).
"""

from __future__ import annotations

import json
import os

from project.settings import *  # noqa: F403

DEBUG = False
SECRET_KEY = "bench-shedding-only-not-secret"


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value and value.lower() != "none" else None


#: The tier every benchmark API key is on: far above what one key sends, so no 429 is expected
#: (what is measured is 503 shedding, not per-caller limits).
BENCH_TIER = {"rate": "1000/s", "burst": 1000}

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("BENCH_SHEDDING_DB", str(BASE_DIR / "bench" / "results" / "shedding.sqlite3")),  # noqa: F405
        "OPTIONS": {
            # Two gunicorn processes write charges at once: WAL lets readers proceed during a
            # write, and writers wait for the lock (up to 20 s) instead of failing at once.
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
            "transaction_mode": "IMMEDIATE",
        },
    }
}

RATELIMITS = {
    "BACKEND": "redis",
    "REDIS": {"URL": os.environ.get("BENCH_SHEDDING_REDIS_URL", "redis://127.0.0.1:6379/0")},
    "POLICIES": {
        "SOURCE": "settings",
        "DEFAULT_TIERS": {"anonymous": "anonymous", "authenticated": "bench"},
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
    # The abusive key (bench/shedding.py's ABUSIVE_KEY) is on a tier of its own, far below its flood.
    "TIERS": {"anonymous": {"rate": "20/s", "burst": 40}, "bench": BENCH_TIER, "abusive": {"rate": "10/s"}},
    "IDENTITY": {"ORGANIZATION_FUNC": "project.payments.auth.organization_of", "API_KEY_MODEL": "payments.ApiKey"},
    # No per-IP or per-organisation backstop: every client of the benchmark is 127.0.0.1.
    "DIMENSIONS": {},
    "ENDPOINTS": {
        "POST charges": {"priority": "critical", "cost": 1},
        "customers": {"priority": "normal", "cost": 1},
        # The demo's export costs 10 with its own per-caller (30/m) and endpoint-wide (600/m)
        # limits; here it costs 1 and has none, so the flood is turned away by shedding only.
        "reports.export": {"priority": "low", "cost": 1},
    },
    "SHEDDING": {
        "FLEET_CAPACITY": _optional_int("BENCH_SHEDDING_FLEET_CAPACITY"),
        "THRESHOLDS": {"low": 60, "normal": 75, "high": 90},
        "WORKER_CAPACITY": _optional_int("BENCH_SHEDDING_WORKER_CAPACITY"),
    },
    # The demo's local path: refusals remembered (and answered before authentication by the demo's
    # EarlyRejectionMiddleware), with X-RateLimit-Local to count them. BENCH_SHEDDING_LOCAL=0 turns
    # both off, for the comparison: every refusal then goes through authentication and the store.
    "LOCAL_PATH": {"HEADER": True, "DENIALS": os.environ.get("BENCH_SHEDDING_LOCAL", "1") != "0"},
}

if os.environ.get("BENCH_SHEDDING_ADAPTIVE") == "1":
    RATELIMITS["SHEDDING"]["ADAPTIVE"] = True
if os.environ.get("BENCH_SHEDDING_DOWNSTREAM"):
    DEMO_DOWNSTREAM = json.loads(os.environ["BENCH_SHEDDING_DOWNSTREAM"])

if os.environ.get("BENCH_SHEDDING_LOCAL", "1") == "0":
    MIDDLEWARE = [m for m in MIDDLEWARE if m != "ratelimits.middleware.EarlyRejectionMiddleware"]  # noqa: F405

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Each line stamped with its Unix time: the adaptive scenario places capacity moves against the step.
    "formatters": {"stamped": {"format": "%(created).3f %(process)d %(levelname)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "stamped"}},
    # A degraded decision (warning) or a release left to expiry (info): the run counts them.
    "loggers": {"ratelimits": {"handlers": ["console"], "level": "INFO"}},
}
