"""Clients that retry 429 and 503 as django-ratelimits' contract asks: no earlier than advised, jittered, budgeted.

The ``ratelimits-client`` distribution: plain Python, it depends on nothing (no Django, no
redis-py). requests and httpx are optional (the ``requests`` and ``httpx`` extras) and each is
imported only when its client is asked for, so either works without the other. The project's
docs/client.md has the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ratelimits_client.policy import (
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
    read_advice,
)

if TYPE_CHECKING:
    import httpx
    import requests

    from ratelimits_client._httpx import AsyncRetryTransport, RetryTransport
    from ratelimits_client._requests import RetryAdapter

__version__ = "0.1.0"

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


def session(options: RetryOptions | None = None, /, **overrides: Any) -> requests.Session:
    """A ``requests.Session`` that retries 429 and 503 (``overrides`` are :class:`RetryOptions` fields)."""
    # Optional dependency: only this client needs requests.
    from ratelimits_client._requests import session as make

    return make(options, **overrides)


def httpx_transport(
    options: RetryOptions | None = None, /, *, transport: httpx.BaseTransport | None = None, **overrides: Any
) -> RetryTransport:
    """A sync httpx transport that retries 429 and 503, wrapping ``transport`` (an ``HTTPTransport``)."""
    # Optional dependency: only the httpx clients need httpx.
    from ratelimits_client._httpx import httpx_transport as make

    return make(options, transport=transport, **overrides)


def async_httpx_transport(
    options: RetryOptions | None = None, /, *, transport: httpx.AsyncBaseTransport | None = None, **overrides: Any
) -> AsyncRetryTransport:
    """An async httpx transport that retries 429 and 503, wrapping ``transport`` (an ``AsyncHTTPTransport``)."""
    # Optional dependency: only the httpx clients need httpx.
    from ratelimits_client._httpx import async_httpx_transport as make

    return make(options, transport=transport, **overrides)


def __getattr__(name: str) -> Any:
    """The adapter classes, imported when first named (each needs its own optional library)."""
    if name == "RetryAdapter":
        # Optional dependency: requests.
        from ratelimits_client._requests import RetryAdapter

        return RetryAdapter
    if name in ("RetryTransport", "AsyncRetryTransport"):
        # Optional dependency: httpx.
        from ratelimits_client import _httpx

        return getattr(_httpx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
