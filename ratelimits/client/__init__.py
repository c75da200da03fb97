"""Deprecated: the client is ``ratelimits_client`` now, the ``ratelimits-client`` distribution's package.

This app's wheel carries ``ratelimits_client`` (clients/python/src), so ``import ratelimits_client``
works wherever ``ratelimits`` does; a process without the app installs ``ratelimits-client``, which
needs neither Django nor redis-py. This module re-exports it (the same objects) for one release, and
warns on import; it goes in the next. docs/client.md has the client.
"""

from __future__ import annotations

import warnings
from typing import Any

import ratelimits_client
from ratelimits_client import (
    IDEMPOTENCY_KEY,
    IDEMPOTENT_METHODS,
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
    async_httpx_transport,
    httpx_transport,
    read_advice,
    session,
)

__all__ = [
    "IDEMPOTENCY_KEY",
    "IDEMPOTENT_METHODS",
    "AdaptiveThrottle",
    "Advice",
    "AsyncRetryTransport",
    "ClientError",
    "GiveUp",
    "OverloadedError",
    "RateLimitedError",
    "Retrier",
    "RetryAdapter",
    "RetryBudget",
    "RetryError",
    "RetryOptions",
    "RetryTransport",
    "ThrottledLocally",
    "Verdict",
    "async_httpx_transport",
    "httpx_transport",
    "read_advice",
    "session",
]

# stacklevel 2: the warning names the module that imported this one (the import system's frames
# are skipped), where the import to change is.
warnings.warn(
    "ratelimits.client is deprecated: import ratelimits_client instead, the same client "
    "(`from ratelimits_client import session`). django-ratelimits installs it; without the app, "
    "install the ratelimits-client distribution, which needs neither Django nor redis-py. "
    "ratelimits.client goes in the next release.",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    """The adapter classes, from ``ratelimits_client`` when first named (each needs its own optional library)."""
    if name in ("RetryAdapter", "RetryTransport", "AsyncRetryTransport"):
        return getattr(ratelimits_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
