"""The DRF throttle: every applicable policy of a request decided in one round trip."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from .conf import ProcessWide, conf, require_app
from .decisions import Decision, Verdict
from .drf import RateLimitUnavailable, endpoint_name
from .engine import evaluate
from .engine.evaluation import aevaluate
from .exceptions import ConfigurationError
from .headers import rate_limit_headers
from .policies.source import get_policy_source
from .policies.throttle_rates import drf_rate, rate_config
from .policies.values import Policy, policy_from_config
from .rates import parse_rate

__all__ = ["AsyncRateLimitThrottle", "RateLimitThrottle", "class_policies", "view_policies"]

#: The attribute of a DRF request that holds its decision once one throttle class made it.
_DECIDED = "_ratelimits_decided"


class RateLimitThrottle(BaseThrottle):
    """Use in ``DEFAULT_THROTTLE_CLASSES`` or a view's ``throttle_classes``.

    Headers go into ``view.headers``, which DRF copies onto every response, 429s included.
    The decision is attached to the request as ``request.ratelimit``. Pair with
    ``ratelimits.drf.exception_handler`` for ``application/problem+json`` bodies.

    As with DRF's own throttles, a subclass may say more of the views it throttles:

    - ``scope = "uploads"``: they are also held to the per-caller rate of the endpoint ``uploads``
      (``REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['uploads']``, or
      ``RATELIMITS['ENDPOINTS']['uploads']['rate']``), one bucket per caller for every view
      throttled by it;
    - ``rate = "60/min"``: they are also held to that rate per caller, one bucket per caller and
      class (or scope, when it has one).

    Every ``RateLimitThrottle`` class of a view is decided together, in one round trip: the
    first of them in ``throttle_classes`` decides for all, the others read its decision (kept
    on the request).
    """

    #: The endpoint whose per-caller rate this class adds (DRF's ``scope``).
    scope: str | None = None
    #: A per-caller rate of this class's own (DRF's ``rate``): ``"60/min"``, ``"1000/day"``.
    rate: str | None = None

    def __init__(self) -> None:
        # DRF builds a throttle per request: nothing expensive belongs here.
        self.decision: Decision | None = None

    def allow_request(self, request: Request, view: Any) -> bool:
        decision = self._decided(request, view)
        if decision is None:
            decision = self.decide(request, view)
        return self._verdict(request, view, decision)

    def _decided(self, request: Request, view: Any) -> Decision | None:
        """The decision the view's first ``RateLimitThrottle`` class made for all of them, if this
        is one of the others; ``None`` for the first (or a throttle the view does not list): it decides."""
        classes = [
            c for c in getattr(view, "throttle_classes", ()) if isinstance(c, type) and issubclass(c, RateLimitThrottle)
        ]
        if type(self) not in classes[1:]:
            return None
        decision: Decision | None = getattr(request, _DECIDED, None)
        return decision

    def _verdict(self, request: Request, view: Any, decision: Decision) -> bool:
        self.decision = decision
        setattr(request, _DECIDED, decision)
        request._request.ratelimit = decision  # type: ignore[attr-defined]
        view.headers.update(rate_limit_headers(decision))
        if decision.verdict in (Verdict.UNAVAILABLE, Verdict.SHED):
            raise RateLimitUnavailable(decision)
        return decision.allowed

    def decide(self, request: Request, view: Any) -> Decision:
        """Every policy that applies to the request, decided (and consumed from) in one round trip."""
        endpoint = endpoint_name(request, view)
        extra = view_policies(view, request.method or "GET")
        _, decision = evaluate(request, endpoint=endpoint, auth=request.auth, user=request.user, caller_policies=extra)
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
        decision = self._decided(request, view)
        if decision is None:
            endpoint = endpoint_name(request, view)
            extra = view_policies(view, request.method or "GET")
            _, decision = await aevaluate(
                request, endpoint=endpoint, auth=request.auth, user=request.user, caller_policies=extra
            )
        return self._verdict(request, view, decision)


def view_policies(view: Any, method: str) -> tuple[Policy, ...]:
    """What the view's ``RateLimitThrottle`` subclasses add: each one's ``rate``, or its ``scope``'s."""
    found: list[Policy] = []
    for cls in getattr(view, "throttle_classes", ()):
        if isinstance(cls, type) and issubclass(cls, RateLimitThrottle) and (cls.scope or cls.rate):
            found.extend(class_policies(cls, method))
    return tuple(found)


def class_policies(cls: type[RateLimitThrottle], method: str = "GET") -> tuple[Policy, ...]:
    """The per-caller policy a ``RateLimitThrottle`` subclass adds (none without ``scope`` or ``rate``).

    An ``ImproperlyConfigured`` naming the class if its ``rate`` cannot be read or its ``scope``
    has no per-caller rate: as DRF refuses a scope without a rate.
    """
    if cls.rate:
        policies = _own_rates.get()
        if cls not in policies:
            policies[cls] = _own_rate(cls)
        return (policies[cls],)
    if not cls.scope:
        return ()
    policy = get_policy_source().endpoint_rule(cls.scope, method).per_caller
    if policy is None:
        raise ImproperlyConfigured(
            f"{cls.__module__}.{cls.__qualname__}.scope: {cls.scope!r} names no per-caller rate: give it one in "
            f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'][{cls.scope!r}] or "
            f"RATELIMITS['ENDPOINTS'][{cls.scope!r}]['rate']"
        )
    return (policy,)


def _own_rate(cls: type[RateLimitThrottle]) -> Policy:
    """A throttle class's ``rate`` as a policy: read as DRF reads it ("60/min"), else as ratelimits does ("5/10m")."""
    field = f"{cls.__module__}.{cls.__qualname__}.rate"
    try:
        found = drf_rate(cls.rate, field)
        config = rate_config(found) if found is not None else {"rate": cls.rate}
        return policy_from_config(
            f"throttle:{cls.scope or cls.__name__}", config, field=field, default_fail_mode=conf.failure.default_mode
        )
    except ConfigurationError:
        pass
    try:
        parse_rate(cls.rate, field=field)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    return policy_from_config(
        f"throttle:{cls.scope or cls.__name__}", cls.rate, field=field, default_fail_mode=conf.failure.default_mode
    )


#: Each throttle class's own ``rate`` as a policy, made once until the settings change (its fail mode is theirs).
_own_rates: ProcessWide[dict[type[RateLimitThrottle], Policy]] = ProcessWide(dict)


# Refused at import, where the project's URLconf imports its views: a server without the app fails
# to start, with the reason, rather than answering 500 (no check would run, no table would exist).
require_app()
