"""Rate-limit response headers: IETF ``RateLimit``/``RateLimit-Policy`` and GitHub's ``X-RateLimit-*``."""

from __future__ import annotations

import math
import random
from typing import NamedTuple

from .conf import conf
from .decisions import Decision
from .identity import remember
from .policies.values import Policy

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
    if decision.local is not None and conf.local_path.header:
        headers["X-RateLimit-Local"] = decision.local
    shadow = decision.shadow_violated
    if shadow:
        # What shadow policies would have done, for operators trying a new limit out.
        headers["X-RateLimit-Shadow"] = ", ".join(f'"{r.policy_name}"' for r in shadow)
    closest = decision.closest
    if closest is None or style == "none":
        return headers
    policy = closest.check.policy
    static = _static_parts(policy)
    remaining = closest.remaining
    # Slots have no window: they come back when requests finish, not at a time we could name.
    reset_us = 0 if policy.holds_slots else closest.reset_us
    if style != "github":  # "ietf" or "both"
        headers["RateLimit-Policy"] = static.policy
        if policy.holds_slots:
            headers["RateLimit"] = f"{static.quoted};r={remaining}"
        else:
            headers["RateLimit"] = f"{static.quoted};r={remaining};t={-(-reset_us // US)}"
    if style != "ietf":  # "github" or "both"
        headers["X-RateLimit-Limit"] = static.limit
        headers["X-RateLimit-Remaining"] = str(remaining)
        headers["X-RateLimit-Reset"] = str(-(-(decision.now_us + reset_us) // US))
        headers["X-RateLimit-Used"] = str(max(policy.capacity - remaining, 0))
        headers["X-RateLimit-Resource"] = policy.name
    return headers


class _Static(NamedTuple):
    """What a policy's headers say whatever the request: built once per policy."""

    quoted: str
    policy: str
    limit: str


#: Policy id -> (policy, its parts). An entry holds its policy, so the id stays its own.
_parts: dict[int, tuple[Policy, _Static]] = {}


def _static_parts(policy: Policy) -> _Static:
    try:
        return _parts[id(policy)][1]
    except KeyError:
        pass
    quoted = f'"{policy.name}"'
    if policy.holds_slots:
        described = f'{quoted};q={policy.capacity};qu="concurrent-requests"'
    else:
        described = f"{quoted};q={policy.capacity};w={policy.window_seconds}"
    static = _Static(quoted, described, str(policy.capacity))
    remember(_parts, id(policy), (policy, static))
    return static


def retry_after_seconds(decision: Decision) -> int:
    """``Retry-After`` in whole seconds: the exact wait plus optional jitter, rounded up, at least 1.

    Jitter only ever adds, so a client that obeys the header is never early.
    """
    jitter = conf.retry_after_jitter_us
    wait_us = decision.retry_after_us + (random.randint(0, jitter) if jitter else 0)
    return max(math.ceil(wait_us / US), 1)
