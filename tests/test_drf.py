"""The DRF integration: the exception handler's problem+json, and how an endpoint is named."""

from __future__ import annotations

import json
from typing import Any

from django.test import RequestFactory
from django.urls import resolve
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.views import APIView

from ratelimits.decisions import Decision, Result, Verdict
from ratelimits.drf import RateLimitUnavailable, endpoint_name, exception_handler
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies import Check, Policy
from ratelimits.problems import CONTENT_TYPE
from ratelimits.rates import parse_rate


def denied() -> Decision:
    check = Check(Policy("p", parse_rate("1/s"), 1), Subject(SubjectKind.IP, "198.51.100.1"))
    return Decision.from_results([Result(check, False, 0, 1_000_000, 400_000)], now_us=1_700_000_000_000_000)


def context(decision: Decision | None = None) -> dict[str, Any]:
    request = RequestFactory().get("/")
    if decision is not None:
        request.ratelimit = decision  # type: ignore[attr-defined]  # what the throttle attaches
    return {"request": Request(request), "view": APIView()}


def test_throttled_by_ratelimits_becomes_problem_json() -> None:
    decision = denied()
    response = exception_handler(exceptions.Throttled(wait=0.4), context(decision))
    assert response is not None and response.status_code == 429
    assert response["Content-Type"] == CONTENT_TYPE
    assert json.loads(response.content)["violated-policies"] == ["p"]
    assert response["Retry-After"] == "1"


def test_unavailable_becomes_a_503_problem_with_whole_seconds() -> None:
    exc = RateLimitUnavailable(Decision(Verdict.UNAVAILABLE, (), retry_after_us=1_200_000, degraded=True))
    assert exc.wait == 2
    response = exception_handler(exc, context())
    assert response is not None and response.status_code == 503
    assert json.loads(response.content)["type"].endswith("#temporary-reduced-capacity")


def test_a_503_for_drfs_own_handler_follows_the_retry_after_rule_jitter_and_all(settings: Any) -> None:
    """DRF's default exception handler writes ``Retry-After`` from ``wait``: by the same rule as the
    problem responses (``headers.retry_after_seconds``), so the jitter the settings ask for is in it."""
    settings.RATELIMITS = {"HEADERS": {"RETRY_AFTER_JITTER": "3s"}}
    decision = Decision(Verdict.UNAVAILABLE, (), retry_after_us=1_200_000, degraded=True)
    waits = {RateLimitUnavailable(decision).wait for _ in range(300)}
    assert waits <= {2, 3, 4, 5} and len(waits) > 1  # never under the exact wait, and spread


def test_other_throttles_and_errors_are_left_to_drf() -> None:
    theirs = exception_handler(exceptions.Throttled(wait=3), context())  # no ratelimits decision
    assert theirs is not None and theirs.status_code == 429 and theirs["Content-Type"] != CONTENT_TYPE
    assert theirs.data == {"detail": "Request was throttled. Expected available in 3 seconds."}
    allowed = Decision(Verdict.ALLOW, ())
    assert exception_handler(exceptions.Throttled(), context(allowed))["Content-Type"] != CONTENT_TYPE
    assert exception_handler(exceptions.NotFound(), context()).status_code == 404
    assert exception_handler(ValueError("a bug"), context()) is None  # DRF lets Django handle it


class Scoped(APIView):
    throttle_scope = "reports.export"


def test_endpoint_names_are_the_scope_else_the_route_else_the_class() -> None:
    request = Request(RequestFactory().get("/v1/customers"))
    assert endpoint_name(request, Scoped()) == "reports.export"
    request._request.resolver_match = resolve("/v1/customers")
    assert endpoint_name(request, APIView()) == "customers"
    assert endpoint_name(Request(RequestFactory().get("/nowhere")), APIView()) == "APIView"
