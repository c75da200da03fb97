"""The same engine for plain Django views: the middlewares, and the decorator behind ``@throttle``.

Each works for sync and async views alike. Under ASGI the middlewares run async, and an async
view's decision is made on the event loop (:func:`~ratelimits.engine.evaluation.aevaluate`);
under WSGI they run sync, as Django runs any view. The per-view decorators are in
:mod:`ratelimits.decorators`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

from .conf import require_app
from .decisions import Decision
from .engine import evaluate
from .engine.bodies import BodyNotReceived
from .engine.evaluation import aevaluate, early_refusals, endpoint_of, refuse_early
from .engine.failed_auth import get_failed_authentication
from .engine.holding import note_response, note_status
from .headers import rate_limit_headers
from .problems import body_timeout_response, problem_response

__all__ = [
    "EarlyRejectionMiddleware",
    "FailedAuthenticationMiddleware",
    "RateLimitMiddleware",
    "ratelimit",
    "ratelimit_exempt",
    "throttling",
]

View = TypeVar("View", bound=Callable[..., Any])


def _limit(request: HttpRequest, endpoint: str) -> HttpResponse | None:
    """Decide ``request``; return the 429/503 response if denied (408 if its body never came), else ``None``."""
    try:
        _, decision = evaluate(request, endpoint=endpoint, user=getattr(request, "user", None))
    except BodyNotReceived as exc:
        return body_timeout_response(exc.received, exc.expected, exc.timeout)
    return _decided(request, decision)


async def _alimit(request: HttpRequest, endpoint: str) -> HttpResponse | None:
    """:func:`_limit` on the event loop."""
    _, decision = await aevaluate(request, endpoint=endpoint, user=await _auser(request))
    return _decided(request, decision)


async def _auser(request: HttpRequest) -> Any:
    # request.user is a lazy object that queries the session's user when read: on the event loop
    # that must be Django's auser(), which queries without blocking it.
    auser = getattr(request, "auser", None)
    return await auser() if auser is not None else getattr(request, "user", None)


def _decided(request: HttpRequest, decision: Decision) -> HttpResponse | None:
    request.ratelimit = decision  # type: ignore[attr-defined]
    return None if decision.allowed else problem_response(decision)


def _add_headers(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    decision = getattr(request, "ratelimit", None)
    if isinstance(decision, Decision) and decision.allowed:
        _set_headers(response, decision)
        if decision.spent:  # its endpoint charges by outcome, or trues its cost up
            note_status(request, response.status_code)
    return response


def _failed(request: HttpRequest) -> None:
    """The view raised: Django answers 500, which the request's settlement must know."""
    decision = getattr(request, "ratelimit", None)
    if isinstance(decision, Decision) and decision.spent:
        note_status(request, 500)


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


class _EitherMode:
    """A middleware Django runs sync or async, as the handler around it runs: ``is_async`` says which."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        require_app()  # made as the server starts: one without the app fails there, saying why
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:  # each middleware answers in both modes
        raise NotImplementedError


class RateLimitMiddleware(_EitherMode):
    """Limit every plain Django view (DRF views are left to the throttle).

    Views opt out with :func:`ratelimit_exempt` or ``RATELIMITS['POLICIES']['EXEMPT_ENDPOINTS']``.
    """

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        super().__init__(get_response)
        if self.is_async:
            # Django calls process_view as what it is: a coroutine function here, decided on the loop.
            self.process_view = self._aprocess_view  # type: ignore[method-assign, assignment]

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return _add_headers(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        return _add_headers(request, await self.get_response(request))

    def process_view(
        self, request: HttpRequest, view_func: Callable[..., Any], view_args: Any, view_kwargs: Any
    ) -> HttpResponse | None:
        if not _limited_here(request, view_func):
            return None
        return _limit(request, _endpoint(request, view_func))

    async def _aprocess_view(
        self, request: HttpRequest, view_func: Callable[..., Any], view_args: Any, view_kwargs: Any
    ) -> HttpResponse | None:
        if not _limited_here(request, view_func):
            return None
        return await _alimit(request, _endpoint(request, view_func))


def _limited_here(request: HttpRequest, view_func: Callable[..., Any]) -> bool:
    """Whether :class:`RateLimitMiddleware` decides this view: not exempt, not DRF's, not decided yet."""
    if getattr(view_func, "ratelimit_exempt", False) or _is_drf_view(view_func):
        return False
    return not isinstance(getattr(request, "ratelimit", None), Decision)  # else: the decorator decided it


class FailedAuthenticationMiddleware(_EitherMode):
    """Limit failed authentication per client IP and credential prefix (``IDENTITY['FAILED_AUTH']``).

    Put it first in ``MIDDLEWARE``, before the session and authentication middleware: a client
    over the limit is then answered 429 before anything reads a session or looks a key up. A
    401 counts as a failure when the request presented an ``Authorization`` header; it carries
    the limit's headers, and once the limit is spent it becomes the 429 itself, so at most the
    burst of failures per subject ever reach a 401. Without ``IDENTITY['FAILED_AUTH']`` it does
    nothing.
    """

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        limit = get_failed_authentication()
        if limit is None:
            return self.get_response(request)
        refused = limit.refused(request)
        if refused is not None:
            return problem_response(refused)
        response = self.get_response(request)
        if response.status_code != 401:
            return response
        return _after_failure(response, limit.failed(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        limit = get_failed_authentication()
        if limit is None:
            return await self.get_response(request)  # type: ignore[no-any-return]
        refused = limit.refused(request)
        if refused is not None:
            return problem_response(refused)
        response: HttpResponse = await self.get_response(request)
        if response.status_code != 401:
            return response
        return _after_failure(response, await limit.afailed(request))


def _after_failure(response: HttpResponse, decision: Decision | None) -> HttpResponse:
    """A 401's response once its failure is counted: the 429 once the limit is spent, else with its headers."""
    if decision is None:
        return response
    if not decision.allowed:
        return problem_response(decision)
    _set_headers(response, decision)
    return response


class EarlyRejectionMiddleware(_EitherMode):
    """Refuse, before sessions, authentication and the view, what this worker knows it would refuse.

    Put it first in ``MIDDLEWARE``. Two kinds of request are answered here, with the same 503 or
    429 the throttle (or :class:`RateLimitMiddleware`) would give:

    - one the worker shedder would shed now (``SHEDDING['WORKER_CAPACITY']``), by the priority of
      the endpoint its path was limited as;
    - one whose ``Authorization`` header was refused on that endpoint by a denial that has not
      ended (the exact denial cache, ``LOCAL_PATH``), looked up by its keyed hash: no database.

    On the way out it tells the adaptive capacity (``SHEDDING['ADAPTIVE']``) the view's status and
    latency: a 5xx counts as an error there.

    Only paths the engine has limited are looked at, under the very endpoint it limited them as:
    an exempt view, a view without the throttle, the admin or a health check is never refused
    here. A credential is remembered only once it authenticated and was refused; an unknown or
    invalid one always takes the normal path (its 401). The ``Authorization`` header is assumed
    to be what authenticates the API key (a header shared by many keys, a gateway's, would let one
    key's denial refuse the others). Only denials every request with that credential on that
    endpoint meets count: the API key's, its user's, the endpoint's; not the client address's or
    the organisation's. ``POLICIES['TIER_FUNC']`` and ``IDENTITY['ORGANIZATION_FUNC']`` are assumed
    to depend on the credential, not on other headers.
    """

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        refused = _refused_early(request)
        if refused is not None:
            return refused
        response = self.get_response(request)
        # On the way out, before the body is sent: the view's latency and status, for the adaptive capacity.
        note_response(request, response.status_code, streaming=response.streaming)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        refused = _refused_early(request)  # from memory: nothing to wait for
        if refused is not None:
            return refused
        response: HttpResponse = await self.get_response(request)
        note_response(request, response.status_code, streaming=response.streaming)
        return response


def _refused_early(request: HttpRequest) -> HttpResponse | None:
    """The 503 or 429 :class:`EarlyRejectionMiddleware` answers ``request`` with, if this worker knows it."""
    if not early_refusals():
        return None
    endpoint = endpoint_of(request)
    decision = refuse_early(request, endpoint) if endpoint is not None else None
    if decision is None:
        return None
    request.ratelimit = decision  # type: ignore[attr-defined]
    response = problem_response(decision)
    # Not logged by django.request as every other 4xx is: a flood refused here would cost a log
    # line a request, more than refusing it. Usage counts it instead.
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def ratelimit(scope: str | None = None) -> Callable[[View], View]:
    """Deprecated: ``ratelimits.decorators.throttle(endpoint=...)``, the same decorator under its new name."""
    warnings.warn(
        "ratelimits.middleware.ratelimit(scope=...) is deprecated: use ratelimits.decorators.throttle(endpoint=...), "
        "the same decorator (ratelimits.decorators.ratelimit is django-ratelimit's: a limit on a key of its own)",
        DeprecationWarning,
        stacklevel=2,
    )
    return throttling(scope)


def throttling(scope: str | None = None) -> Callable[[View], View]:
    """Limit one plain view, sync or async, with the whole engine, as :class:`RateLimitMiddleware` would;
    ``scope`` names it in ``RATELIMITS['ENDPOINTS']`` (default: route name). ``ratelimits.decorators.throttle``."""

    def decorate(view: View) -> View:
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def awrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
                if not isinstance(getattr(request, "ratelimit", None), Decision):
                    denied = await _alimit(request, scope or _endpoint(request, view))
                    if denied is not None:
                        return denied
                try:
                    response = await view(request, *args, **kwargs)
                except Exception:
                    _failed(request)
                    raise
                return _add_headers(request, response)

            awrapper.ratelimit_scope = scope  # type: ignore[attr-defined]
            return awrapper  # type: ignore[return-value]

        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not isinstance(getattr(request, "ratelimit", None), Decision):
                denied = _limit(request, scope or _endpoint(request, view))
                if denied is not None:
                    return denied
            try:
                response = view(request, *args, **kwargs)
            except Exception:
                _failed(request)
                raise
            return _add_headers(request, response)

        wrapper.ratelimit_scope = scope  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def ratelimit_exempt(view: View) -> View:
    """Mark a plain view as never limited by :class:`RateLimitMiddleware`."""
    view.ratelimit_exempt = True  # type: ignore[attr-defined]
    return view
