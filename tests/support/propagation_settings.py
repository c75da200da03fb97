"""The demo project's settings for the worker processes of ``test_propagation.py``.

Exactly ``project.settings`` (database and Redis from ``DATABASE_URL`` and ``REDIS_URL``),
except that workers poll the policy tables every second while Redis is unreachable, so the
fallback can be shown within a bounded test.
"""

from project.settings import *  # noqa: F403
from project.settings import RATELIMITS as _DEMO_RATELIMITS

from .settings import merged

POLICY_POLL_INTERVAL_S = 1.0

RATELIMITS = merged(_DEMO_RATELIMITS, {"POLICIES": {"POLL_INTERVAL": f"{POLICY_POLL_INTERVAL_S:g}s"}})
