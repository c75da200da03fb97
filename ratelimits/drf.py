"""DRF integration: the exception handler that renders 429/503 as problem+json, and helpers."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from rest_framework import exceptions
from rest_framework.request import Request

from .decisions import Decision
from .headers import retry_after_seconds
from .problems import body_timeout_response
from .problems import problem_response as decision_response

__all__ = ["RateLimitUnavailable", "RequestBodyTimeout", "endpoint_name", "exception_handler", "problem_response"]


class RequestBodyTimeout(exceptions.APIException):
    """408: the request's body did not arrive within ``SHEDDING['BODY_TIMEOUT']``; nothing was taken for it."""

    status_code = 408
    default_detail = "Request body not received in time."
    default_code = "request_body_timeout"

    def __init__(self, received: int, expected: int, timeout: float) -> None:
        super().__init__()
        self.received, self.expected, self.timeout = received, expected, timeout


class RateLimitUnavailable(exceptions.APIException):
    """503: the limiter cannot decide and a policy fails closed."""

    status_code = 503
    default_detail = "Service temporarily unavailable."
    default_code = "ratelimit_unavailable"

    def __init__(self, decision: Decision) -> None:
        super().__init__()
        self.decision = decision
        # Retry-After as DRF's own exception handler writes it: by the rule every writer follows.
        self.wait = retry_after_seconds(decision)


def problem_response(exc: Exception, context: dict[str, Any]) -> HttpResponse | None:
    """The ``application/problem+json`` 429 or 503 for a denial of ratelimits; ``None`` for anything else.

    For a project with an exception handler of its own: call it first there, and fall through to
    the project's handling when it returns ``None``::

        def exception_handler(exc, context):
            response = ratelimits.drf.problem_response(exc, context)
            if response is None:
                response = my_project_handler(exc, context)
            return response

    A ``Throttled`` raised by another throttle (no ratelimits decision on the request) is not ours.
    """
    if isinstance(exc, RateLimitUnavailable):
        return decision_response(exc.decision)
    if isinstance(exc, RequestBodyTimeout):
        return body_timeout_response(exc.received, exc.expected, exc.timeout)
    if isinstance(exc, exceptions.Throttled):
        request = context.get("request")
        decision = getattr(request, "ratelimit", None) if request is not None else None
        if isinstance(decision, Decision) and not decision.allowed:
            return decision_response(decision)
    return None


def exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse | None:
    """DRF's handler, except that rate-limit denials become ``application/problem+json``.

    Set ``REST_FRAMEWORK["EXCEPTION_HANDLER"] = "ratelimits.drf.exception_handler"``, or call
    :func:`problem_response` from a handler of your own.
    """
    response = problem_response(exc, context)
    if response is not None:
        return response
    # Imported here: rest_framework.views reads DEFAULT_THROTTLE_CLASSES at import time, which
    # imports ratelimits.throttles, which imports this module.
    from rest_framework.views import exception_handler as drf_exception_handler

    return drf_exception_handler(exc, context)


def endpoint_name(request: Request, view: Any) -> str:
    """The view's ``throttle_scope``, else its route name, else its class name."""
    scope = getattr(view, "throttle_scope", None)
    if scope:
        return str(scope)
    match = getattr(request, "resolver_match", None)
    if match is not None and match.view_name:
        return str(match.view_name)
    return type(view).__name__
