"""The DRF throttle: every applicable policy of a request decided in one round trip."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from ._process import ProcessWide
from .conf import conf, require_app
from .decisions import Decision, Verdict
from .drf import RateLimitUnavailable, RequestBodyTimeout, endpoint_name
from .engine import evaluate
from .engine.bodies import BodyNotReceived
from .engine.evaluation import aevaluate
from .exceptions import ConfigurationError
from .headers import advised_wait_us, rate_limit_headers
from .policies.source import PolicySource
from .policies.throttle_rates import drf_rate, rate_config
from .policies.values import Policy, policy_from_config

__all__ = ["AsyncRateLimitThrottle", "RateLimitThrottle", "class_policies", "throttles_of"]

logger = logging.getLogger("ratelimits")

#: The verdicts DRF answers 503 for, not 429.
_UNAVAILABLE = frozenset((Verdict.UNAVAILABLE, Verdict.SHED))
#: The attribute of a DRF request that holds its decision once one throttle class made it.
_DECIDED = "_ratelimits_decided"
#: The attribute of a DRF request that holds its view's ``RateLimitThrottle`` classes once asked.
_CLASSES = "_ratelimits_classes"


class _Decided(NamedTuple):
    """A decision one throttle made for every ``RateLimitThrottle`` class of a view (kept on the request)."""

    by: RateLimitThrottle
    decision: Decision


class RateLimitThrottle(BaseThrottle):
    """Use in ``DEFAULT_THROTTLE_CLASSES`` or a view's ``throttle_classes``.

    Headers go into ``view.headers``, which DRF copies onto every response, 429s included.
    The decision is attached to the request as ``request.ratelimit``. Pair with
    ``ratelimits.drf.exception_handler`` for ``application/problem+json`` bodies.

    As with DRF's own throttles, a subclass may name a limit of its own, and then limits that, not
    the caller's tier (which applies where ``RateLimitThrottle`` itself is listed too; the
    project's dimensions, endpoint rules and fleet limit apply to every request):

    - ``scope = "uploads"``: the per-caller rate of the endpoint ``uploads``
      (``REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['uploads']``, or
      ``RATELIMITS['ENDPOINTS']['uploads']['rate']``), one bucket per caller for every view
      throttled by it;
    - ``rate = "60/min"``: that rate per caller, one bucket per caller and class (or scope, when it
      has one).

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
        decision = self._decided(request)
        if decision is None:
            decision = self.decide(request, view)
            setattr(request, _DECIDED, _Decided(self, decision))
        return self._verdict(request, view, decision)

    def _decided(self, request: Request) -> Decision | None:
        """The decision another throttle of the view made for all its ``RateLimitThrottle``
        classes, this one's among them; ``None`` if none did: this one decides."""
        # Read from the instance's own attributes: a DRF Request looks a name it lacks up on
        # Django's request too, and fails twice (about 1.5 µs), as it does for every request here.
        kept = vars(request)
        decided: _Decided | None = kept.get(_DECIDED)
        if decided is None or decided.by is self or type(self) not in kept.get(_CLASSES, ()):
            return None
        return decided.decision

    def _verdict(self, request: Request, view: Any, decision: Decision) -> bool:
        self.decision = decision
        request._request.ratelimit = decision  # type: ignore[attr-defined]
        view.headers.update(rate_limit_headers(decision))
        if decision.verdict in _UNAVAILABLE:
            raise RateLimitUnavailable(decision)
        return decision.allowed

    def decide(self, request: Request, view: Any) -> Decision:
        """Every policy that applies to the request, decided (and consumed from) in one round trip."""
        classes = _with(type(self), _classes(request, view))
        try:
            _, decision = evaluate(
                request,
                endpoint=endpoint_name(request, view),
                auth=request.auth,
                user=request.user,
                caller_policies=_ClassPolicies.of(classes),
                tiers=_charges_tier(classes),
            )
        except BodyNotReceived as exc:
            raise RequestBodyTimeout(exc.received, exc.expected, exc.timeout) from None
        return decision

    def wait(self) -> float | None:
        """Seconds until the request would be admitted (exact, not rounded, plus the jitter the
        settings ask for: ``headers.advised_wait_us``); ``None`` if allowed. DRF's own exception
        handler writes ``Retry-After`` from it, rounded up, as ours does."""
        if self.decision is None or self.decision.allowed:
            return None
        return advised_wait_us(self.decision) / 1_000_000


#: The classes of a view throttled by ``RateLimitThrottle`` alone, the usual case.
_PLAIN: tuple[type[RateLimitThrottle], ...] = (RateLimitThrottle,)


class AsyncRateLimitThrottle(RateLimitThrottle):
    """:class:`RateLimitThrottle` for async DRF views: adrf's ``APIView`` awaits its ``allow_request``.

    The decision is made on the event loop (:func:`~ratelimits.engine.evaluation.aevaluate`). Use
    it in an adrf view's ``throttle_classes`` (docs/async.md); a sync DRF view keeps
    :class:`RateLimitThrottle`.
    """

    async def allow_request(self, request: Request, view: Any) -> bool:  # type: ignore[override]
        decision = self._decided(request)
        if decision is None:
            classes = _with(type(self), _classes(request, view))
            _, decision = await aevaluate(
                request,
                endpoint=endpoint_name(request, view),
                auth=request.auth,
                user=request.user,
                caller_policies=_ClassPolicies.of(classes),
                tiers=_charges_tier(classes),
            )
            setattr(request, _DECIDED, _Decided(self, decision))
        return self._verdict(request, view, decision)


def throttles_of(view: Any) -> tuple[type[RateLimitThrottle], ...]:
    """The ``RateLimitThrottle`` classes DRF runs for ``view``, in its order (``get_throttles()``,
    which a view may override, else ``throttle_classes``).

    A view that does not override ``get_throttles`` is read from its ``throttle_classes``, which
    DRF's own ``get_throttles`` instantiates one of each: not a second set of throttles a request.
    """
    get_throttles = getattr(view, "get_throttles", None)
    if not callable(get_throttles) or getattr(type(view), "get_throttles", None) is _drf_get_throttles():
        found = getattr(view, "throttle_classes", ())
    else:
        found = [type(t) for t in get_throttles()]
    return tuple(c for c in found if isinstance(c, type) and issubclass(c, RateLimitThrottle))


@functools.cache
def _drf_get_throttles() -> Any:
    """DRF's ``APIView.get_throttles``. Imported on first use: ``rest_framework.views`` reads
    ``DEFAULT_THROTTLE_CLASSES`` at import time, which imports this module."""
    from rest_framework.views import APIView

    return APIView.get_throttles


def _classes(request: Request, view: Any) -> tuple[type[RateLimitThrottle], ...]:
    """:func:`throttles_of` the request's view, asked once per request: a ``get_throttles()`` may be costly."""
    found: tuple[type[RateLimitThrottle], ...] | None = vars(request).get(_CLASSES)
    if found is None:
        found = throttles_of(view)
        setattr(request, _CLASSES, found)
    return found


def _with(
    cls: type[RateLimitThrottle], classes: tuple[type[RateLimitThrottle], ...]
) -> tuple[type[RateLimitThrottle], ...]:
    return classes if cls in classes else (cls, *classes)


def _charges_tier(classes: tuple[type[RateLimitThrottle], ...]) -> bool:
    """Whether the caller's tier applies: a class that names no ``scope`` or ``rate`` of its own
    (``RateLimitThrottle`` itself) is among them. One that does limits what it names, not the
    tier, as DRF's ``UserRateThrottle`` subclass with a ``scope`` limits its scope alone."""
    if classes == _PLAIN:  # every view throttled by RateLimitThrottle alone: asked on each request
        return True
    return any(not (cls.scope or cls.rate) for cls in classes)


class _ClassPolicies:
    """What a view's throttle classes add, resolved by the engine against its policy source, once
    the request is to be decided (after the switch, off the event loop if the source must load)."""

    __slots__ = ("classes",)

    def __init__(self, classes: tuple[type[RateLimitThrottle], ...]) -> None:
        self.classes = classes

    @classmethod
    def of(cls, classes: tuple[type[RateLimitThrottle], ...]) -> _ClassPolicies | None:
        """What ``classes`` add; ``None`` if none names a ``scope`` or ``rate`` (the engine then asks nothing)."""
        if classes == _PLAIN or not any(c.rate or c.scope for c in classes):
            return None
        return cls(classes)

    def __call__(self, source: PolicySource, method: str) -> list[Policy]:
        found: list[Policy] = []
        for cls in self.classes:
            if cls.rate or cls.scope:
                try:
                    found.extend(class_policies(cls, source, method))
                except ImproperlyConfigured as exc:
                    _report(cls, exc)  # the checks refused it at start (E007); never a 500 here
        return found


def class_policies(cls: type[RateLimitThrottle], source: PolicySource, method: str = "GET") -> tuple[Policy, ...]:
    """The per-caller policy a ``RateLimitThrottle`` subclass adds (none without ``scope`` or
    ``rate``, or for an exempt ``scope``).

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
    rule = source.endpoint_rule(cls.scope, method)
    if rule.exempt:
        return ()  # POLICIES['EXEMPT_ENDPOINTS'] names the scope: nothing limits it
    policy = rule.per_caller
    if policy is None:
        raise ImproperlyConfigured(
            f"{_name(cls)}.scope: {cls.scope!r} names no per-caller rate: give it one in "
            f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'][{cls.scope!r}] or "
            f"RATELIMITS['ENDPOINTS'][{cls.scope!r}]['rate']"
        )
    return (policy,)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: Throttle classes whose scope or rate was refused on a request, each logged once (until the settings change).
_reported: ProcessWide[set[type]] = ProcessWide(set)


def _report(cls: type, error: Exception) -> None:
    reported = _reported.get()
    if cls not in reported:
        reported.add(cls)
        logger.error("ratelimits: %s; the views it throttles are decided without it", error)


def _own_rate(cls: type[RateLimitThrottle]) -> Policy:
    """A throttle class's ``rate`` as a policy: read as DRF reads it ("60/min"), else as ratelimits does ("5/10m")."""
    field = f"{_name(cls)}.rate"
    name = "throttle:" + (cls.scope or re.sub(r"[^A-Za-z0-9_.]+", ".", _name(cls)))[:180]
    try:
        found = drf_rate(cls.rate, field)
        config: Any = rate_config(found) if found is not None else cls.rate
    except ConfigurationError:
        config = cls.rate  # not DRF's form: read as ratelimits reads a rate ("5/10m")
    try:
        return policy_from_config(name, config, field=field, default_fail_mode=conf.failure.default_mode)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(str(exc)) from None


#: Each throttle class's own ``rate`` as a policy, made once until the settings change (its fail mode is theirs).
_own_rates: ProcessWide[dict[type[RateLimitThrottle], Policy]] = ProcessWide(dict)


# Refused at import, where the project's URLconf imports its views: a server without the app fails
# to start, with the reason, rather than answering 500 (no check would run, no table would exist).
require_app()
