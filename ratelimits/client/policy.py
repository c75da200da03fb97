"""Deprecated: ``ratelimits_client.policy`` (see ``ratelimits.client``), re-exported for one release."""

from __future__ import annotations

import warnings

from ratelimits_client.policy import (
    IDEMPOTENCY_KEY,
    IDEMPOTENT_METHODS,
    LONGEST_SLEEP,
    MAX_PROBLEM_BYTES,
    AdaptiveThrottle,
    Advice,
    ClientError,
    GiveUp,
    OverloadedError,
    RateLimitedError,
    Retrier,
    RetryBudget,
    RetryError,
    RetryOptions,
    ThrottledLocally,
    Verdict,
    parse_problem,
    parse_ratelimit_reset,
    parse_retry_after,
    problem_retry_after,
    read_advice,
)

__all__ = [
    "IDEMPOTENCY_KEY",
    "IDEMPOTENT_METHODS",
    "LONGEST_SLEEP",
    "MAX_PROBLEM_BYTES",
    "AdaptiveThrottle",
    "Advice",
    "ClientError",
    "GiveUp",
    "OverloadedError",
    "RateLimitedError",
    "Retrier",
    "RetryBudget",
    "RetryError",
    "RetryOptions",
    "ThrottledLocally",
    "Verdict",
    "parse_problem",
    "parse_ratelimit_reset",
    "parse_retry_after",
    "problem_retry_after",
    "read_advice",
]

# stacklevel 2: the warning names the importing module (see ratelimits/client/__init__.py).
warnings.warn(
    "ratelimits.client.policy is deprecated: import ratelimits_client.policy instead, the same module "
    "(django-ratelimits installs it; without the app, the ratelimits-client distribution). "
    "ratelimits.client goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)
