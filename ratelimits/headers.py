"""Rate-limit response headers: IETF ``RateLimit``/``RateLimit-Policy`` and GitHub's ``X-RateLimit-*``."""

from __future__ import annotations

import math
import random

from .conf import conf
from .decisions import Decision

__all__ = ["rate_limit_headers", "retry_after_seconds"]

US = 1_000_000


def rate_limit_headers(decision: Decision) -> dict[str, str]:
    """Headers describing the policy closest to its limit, in the configured style(s).

    IETF syntax follows draft-ietf-httpapi-ratelimit-headers-10/11: ``RateLimit-Policy``
    gives the quota ``q`` over a window of ``w`` seconds, ``RateLimit`` the remaining
    quota ``r`` and the seconds ``t`` until it is fully restored.
    """
    style = conf.headers
    headers: dict[str, str] = {}
    if decision.degraded:
        headers["X-RateLimit-Degraded"] = "1"
    shadow = decision.shadow_violated
    if shadow:
        # What shadow policies would have done, for operators trying a new limit out.
        headers["X-RateLimit-Shadow"] = ", ".join(f'"{r.policy_name}"' for r in shadow)
    closest = decision.closest
    if closest is None or style == "none":
        return headers
    name = closest.policy_name
    # Slots have no window: they come back when requests finish, not at a time we could name.
    in_flight = closest.check.policy.holds_slots
    reset_us = 0 if in_flight else closest.reset_us
    if style in ("ietf", "both"):
        if in_flight:
            headers["RateLimit-Policy"] = f'"{name}";q={closest.limit};qu="concurrent-requests"'
            headers["RateLimit"] = f'"{name}";r={closest.remaining}'
        else:
            headers["RateLimit-Policy"] = f'"{name}";q={closest.limit};w={closest.check.policy.window_seconds}'
            headers["RateLimit"] = f'"{name}";r={closest.remaining};t={math.ceil(reset_us / US)}'
    if style in ("github", "both"):
        headers["X-RateLimit-Limit"] = str(closest.limit)
        headers["X-RateLimit-Remaining"] = str(closest.remaining)
        headers["X-RateLimit-Reset"] = str(math.ceil((decision.now_us + reset_us) / US))
        headers["X-RateLimit-Used"] = str(closest.used)
        headers["X-RateLimit-Resource"] = name
    return headers


def retry_after_seconds(decision: Decision) -> int:
    """``Retry-After`` in whole seconds: the exact wait plus optional jitter, rounded up, at least 1.

    Jitter only ever adds, so a client that obeys the header is never early.
    """
    jitter = conf.retry_after_jitter_us
    wait_us = decision.retry_after_us + (random.randint(0, jitter) if jitter else 0)
    return max(math.ceil(wait_us / US), 1)
