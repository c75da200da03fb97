"""``application/problem+json`` bodies (RFC 9457) for 429 and 503 responses."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpResponse

from ._numbers import ceil_div
from .decisions import Decision, Verdict
from .headers import rate_limit_headers, retry_after_seconds

__all__ = ["CONTENT_TYPE", "body_timeout_body", "body_timeout_response", "problem_body", "problem_response"]

CONTENT_TYPE = "application/problem+json"
# Problem types registered by the IETF RateLimit headers draft.
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
REDUCED_CAPACITY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"


#: The two ways a request gets a 503: the platform sheds load, or a fail-closed policy cannot be decided.
_UNAVAILABLE = {
    Verdict.SHED: (
        "Service temporarily reducing load",
        "The service is busy and sheds this endpoint's priority class first",
    ),
    Verdict.UNAVAILABLE: (
        "Service temporarily unable to accept this request",
        "Rate limiting is unavailable and this endpoint fails closed",
    ),
}


def problem_body(decision: Decision) -> dict[str, Any]:
    """The problem document for a denied decision: every violated policy and the exact wait.

    ``violated-policies`` is the IETF RateLimit draft's member: the names of the violated
    policies. ``violations`` says, for each, the subject it limits, what is left and its wait.
    """
    seconds = decision.retry_after_ms / 1000
    violated = decision.violated
    names = {"violated-policies": [r.policy_name for r in violated]} if violated else {}
    if decision.verdict in _UNAVAILABLE:
        title, detail = _UNAVAILABLE[decision.verdict]
        return {
            "type": REDUCED_CAPACITY,
            "title": title,
            "status": 503,
            "detail": f"{detail}; retry in {seconds:g} s.",
            "retry_after_ms": decision.retry_after_ms,
            **names,
        }
    return {
        "type": QUOTA_EXCEEDED,
        "title": "Too many requests",
        "status": 429,
        "detail": f"Over {len(violated)} rate limit(s); retry in {seconds:g} s.",
        "retry_after_ms": decision.retry_after_ms,
        **names,
        "violations": [
            {
                "policy": r.policy_name,
                "subject": r.check.subject.kind,
                "limit": r.limit,
                "remaining": r.remaining,
                "window_seconds": r.check.policy.window_seconds,
                "retry_after_ms": ceil_div(r.retry_us, 1000),
            }
            for r in violated
        ],
    }


def problem_response(decision: Decision) -> HttpResponse:
    """A complete 429 or 503 response: problem body, ``Retry-After`` and rate-limit headers."""
    status = 429 if decision.verdict is Verdict.LIMITED else 503
    response = HttpResponse(json.dumps(problem_body(decision)), status=status, content_type=CONTENT_TYPE)
    for name, value in rate_limit_headers(decision).items():
        response[name] = value
    response["Retry-After"] = str(retry_after_seconds(decision))
    return response


def body_timeout_body(received: int, expected: int, timeout: float) -> dict[str, Any]:
    """The problem document for a request whose body did not arrive in time (408)."""
    return {
        "title": "Request body not received in time",
        "status": 408,
        "detail": f"{received} of {expected} bytes of the request body arrived in {timeout:g} s; send it again.",
    }


def body_timeout_response(received: int, expected: int, timeout: float) -> HttpResponse:
    """A complete 408. (No ``Connection: close``, a hop-by-hop header WSGI servers refuse from an
    application: the read side of the connection is shut already, so the server closes it.)"""
    body = body_timeout_body(received, expected, timeout)
    return HttpResponse(json.dumps(body), status=408, content_type=CONTENT_TYPE)
