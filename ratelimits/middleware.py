"""The same engine for plain Django views: a middleware and a per-view decorator."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from django.http import HttpRequest, HttpResponse

from .decisions import Decision
from .engine import evaluate
from .engine.evaluation import early_refusals, endpoint_of, note_response, refuse_early
from .engine.failed_auth import get_failed_authentication
from .headers import rate_limit_headers
from .problems import problem_response

__all__ = [
    "EarlyRejectionMiddleware",
    "FailedAuthenticationMiddleware",
    "RateLimitMiddleware",
    "ratelimit",
    "ratelimit_exempt",
]

View = TypeVar("View", bound=Callable[..., Any])


def _limit(request: HttpRequest, endpoint: str) -> HttpResponse | None:
    """Decide ``request``; return the 429/503 response if denied, else ``None``."""
    user = getattr(request, "user", None)
    _, decision = evaluate(request, endpoint=endpoint, user=user)
    request.ratelimit = decision  # type: ignore[attr-defined]
    return None if decision.allowed else problem_response(decision)


def _add_headers(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    decision = getattr(request, "ratelimit", None)
    if isinstance(decision, Decision) and decision.allowed:
        _set_headers(response, decision)
    return response


def _set_headers(response: HttpResponse, decision: Decision) -> None:
    """The decision's rate-limit headers, where the view set none of its own."""
    for name, value in rate_limit_headers(decision).items():
        response.setdefault(name, value)


def _endpoint(request: HttpRequest, view_func: Callable[..., Any]) -> str:
    scope = getattr(view_func, "ratelimit_scope", None)
    if scope:
        return str(scope)
    match = request.resolver_match
    if match is not None and match.view_name:
        return str(match.view_name)
    return getattr(view_func, "__qualname__", "view")


def _is_drf_view(view_func: Callable[..., Any]) -> bool:
    # DRF views run RateLimitThrottle themselves; limiting them here too would charge twice.
    cls = getattr(view_func, "cls", None)
    return cls is not None and any(base.__module__.startswith("rest_framework.") for base in cls.__mro__)


class RateLimitMiddleware:
    """Limit every plain Django view (DRF views are left to the throttle).

    Views opt out with :func:`ratelimit_exempt` or ``RATELIMITS['EXEMPT_ENDPOINTS']``.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return _add_headers(request, self.get_response(request))

    def process_view(
        self, request: HttpRequest, view_func: Callable[..., Any], view_args: Any, view_kwargs: Any
    ) -> HttpResponse | None:
        if getattr(view_func, "ratelimit_exempt", False) or _is_drf_view(view_func):
            return None
        if isinstance(getattr(request, "ratelimit", None), Decision):
            return None  # already decided by the decorator
        return _limit(request, _endpoint(request, view_func))


class FailedAuthenticationMiddleware:
    """Limit failed authentication per client IP and credential prefix (``RATELIMITS['FAILED_AUTH']``).

    Put it first in ``MIDDLEWARE``, before the session and authentication middleware: a client
    over the limit is then answered 429 before anything reads a session or looks a key up. A
    401 counts as a failure when the request presented an ``Authorization`` header; it carries
    the limit's headers, and once the limit is spent it becomes the 429 itself, so at most the
    burst of failures per subject ever reach a 401. Without ``FAILED_AUTH`` it does nothing.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = get_failed_authentication()
        if limit is None:
            return self.get_response(request)
        refused = limit.refused(request)
        if refused is not None:
            return problem_response(refused)
        response = self.get_response(request)
        if response.status_code != 401:
            return response
        decision = limit.failed(request)
        if decision is None:
            return response
        if not decision.allowed:
            return problem_response(decision)
        _set_headers(response, decision)
        return response


class EarlyRejectionMiddleware:
    """Refuse, before sessions, authentication and the view, what this worker knows it would refuse.

    Put it first in ``MIDDLEWARE``. Two kinds of request are answered here, with the same 503 or
    429 the throttle (or :class:`RateLimitMiddleware`) would give:

    - one the worker shedder would shed now (``WORKER_CAPACITY``), by the priority of the endpoint
      its path was limited as;
    - one whose ``Authorization`` header was refused on that endpoint by a denial that has not
      ended (the exact denial cache, ``LOCAL_PATH``), looked up by its keyed hash: no database.

    On the way out it tells the adaptive capacity (``ADAPTIVE_CAPACITY``) the view's status and
    latency: a 5xx counts as an error there.

    Only paths the engine has limited are looked at, under the very endpoint it limited them as:
    an exempt view, a view without the throttle, the admin or a health check is never refused
    here. A credential is remembered only once it authenticated and was refused; an unknown or
    invalid one always takes the normal path (its 401). The ``Authorization`` header is assumed
    to be what authenticates the API key (a header shared by many keys, a gateway's, would let one
    key's denial refuse the others). Only denials every request with that credential on that
    endpoint meets count: the API key's, its user's, the endpoint's; not the client address's or
    the organisation's. ``TIER_FUNC`` and ``ORGANIZATION_FUNC`` are assumed to depend on the
    credential, not on other headers.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if early_refusals():
            endpoint = endpoint_of(request)
            decision = refuse_early(request, endpoint) if endpoint is not None else None
            if decision is not None:
                request.ratelimit = decision  # type: ignore[attr-defined]
                response = problem_response(decision)
                # Not logged by django.request as every other 4xx is: a flood refused here would
                # cost a log line a request, more than refusing it. Usage counts it instead.
                response._has_been_logged = True  # type: ignore[attr-defined]
                return response
        response = self.get_response(request)
        # On the way out, before the body is sent: the view's latency and status, for the adaptive capacity.
        note_response(request, response.status_code, streaming=response.streaming)
        return response


def ratelimit(scope: str | None = None) -> Callable[[View], View]:
    """Limit one plain view; ``scope`` names it in ``RATELIMITS['ENDPOINTS']`` (default: route name)."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not isinstance(getattr(request, "ratelimit", None), Decision):
                denied = _limit(request, scope or _endpoint(request, view))
                if denied is not None:
                    return denied
            return _add_headers(request, view(request, *args, **kwargs))

        wrapper.ratelimit_scope = scope  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def ratelimit_exempt(view: View) -> View:
    """Mark a plain view as never limited by :class:`RateLimitMiddleware`."""
    view.ratelimit_exempt = True  # type: ignore[attr-defined]
    return view
