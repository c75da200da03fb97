"""The DRF throttle: every applicable policy of a request decided in one round trip."""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from .decisions import Decision, Verdict
from .drf import RateLimitUnavailable, endpoint_name
from .engine import evaluate
from .engine.evaluation import aevaluate
from .headers import rate_limit_headers

__all__ = ["AsyncRateLimitThrottle", "RateLimitThrottle"]


class RateLimitThrottle(BaseThrottle):
    """Use in ``DEFAULT_THROTTLE_CLASSES`` or a view's ``throttle_classes``.

    Headers go into ``view.headers``, which DRF copies onto every response, 429s included.
    The decision is attached to the request as ``request.ratelimit``. Pair with
    ``ratelimits.drf.exception_handler`` for ``application/problem+json`` bodies.
    """

    def __init__(self) -> None:
        # DRF builds a throttle per request: nothing expensive belongs here.
        self.decision: Decision | None = None

    def allow_request(self, request: Request, view: Any) -> bool:
        return self._verdict(request, view, self.decide(request, view))

    def _verdict(self, request: Request, view: Any, decision: Decision) -> bool:
        self.decision = decision
        request._request.ratelimit = decision  # type: ignore[attr-defined]
        view.headers.update(rate_limit_headers(decision))
        if decision.verdict in (Verdict.UNAVAILABLE, Verdict.SHED):
            raise RateLimitUnavailable(decision)
        return decision.allowed

    def decide(self, request: Request, view: Any) -> Decision:
        """Every policy that applies to the request, decided (and consumed from) in one round trip."""
        _, decision = evaluate(request, endpoint=endpoint_name(request, view), auth=request.auth, user=request.user)
        return decision

    def wait(self) -> float | None:
        """Seconds until the request would be admitted (exact, not rounded); ``None`` if allowed."""
        if self.decision is None or self.decision.allowed:
            return None
        return self.decision.retry_after_us / 1_000_000


class AsyncRateLimitThrottle(RateLimitThrottle):
    """:class:`RateLimitThrottle` for async DRF views: adrf's ``APIView`` awaits its ``allow_request``.

    The decision is made on the event loop (:func:`~ratelimits.engine.evaluation.aevaluate`). Use
    it in an adrf view's ``throttle_classes`` (docs/async.md); a sync DRF view keeps
    :class:`RateLimitThrottle`.
    """

    async def allow_request(self, request: Request, view: Any) -> bool:  # type: ignore[override]
        endpoint = endpoint_name(request, view)
        _, decision = await aevaluate(request, endpoint=endpoint, auth=request.auth, user=request.user)
        return self._verdict(request, view, decision)
