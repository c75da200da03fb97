"""``application/problem+json`` bodies and responses for 429 and both kinds of 503."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ratelimits.choices import Priority
from ratelimits.decisions import Decision, Result, Verdict
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies import Check, Policy, fleet_checks
from ratelimits.problems import CONTENT_TYPE, QUOTA_EXCEEDED, REDUCED_CAPACITY, problem_body, problem_response
from ratelimits.rates import parse_rate

KEY = Subject(SubjectKind.API_KEY, "k")
IP = Subject(SubjectKind.IP, "198.51.100.1")
FAST = Policy("fast", parse_rate("10/s"), 10)
SLOW = Policy("slow", parse_rate("100/h"), 100)


def limited() -> Decision:
    return Decision.from_results(
        [
            Result(Check(FAST, KEY), False, 0, 900_000, 100_500),
            Result(Check(SLOW, IP, 2), False, 1, 3_600_000_000, 36_000_001),
            Result(Check(Policy("ok", parse_rate("5/s"), 5), KEY), True, 4, 200_000, 0),
        ],
        now_us=1_700_000_000_000_000,
    )


def test_429_names_every_violated_policy_with_the_exact_wait() -> None:
    body = problem_body(limited())
    assert body["type"] == QUOTA_EXCEEDED and body["status"] == 429 and body["title"] == "Too many requests"
    assert body["retry_after_ms"] == 36_001  # the longest wait, rounded up to the millisecond
    assert body["detail"] == "Over 2 rate limit(s); retry in 36.001 s."
    assert body["violated-policies"] == ["fast", "slow"]  # the IETF draft's member: the names
    assert body["violations"] == [
        {
            "policy": "fast",
            "subject": "api_key",
            "limit": 10,
            "remaining": 0,
            "window_seconds": 1,
            "retry_after_ms": 101,
        },
        {
            "policy": "slow",
            "subject": "ip",
            "limit": 100,
            "remaining": 1,
            "window_seconds": 3600,
            "retry_after_ms": 36_001,
        },
    ]
    assert "violated_policies" not in body  # 0.1's name for the details


def test_503_bodies_say_which_kind_of_overload() -> None:
    shed = problem_body(Decision(Verdict.SHED, (), retry_after_us=1_000_000))  # the worker shedder: no policy
    down = problem_body(Decision(Verdict.UNAVAILABLE, (), retry_after_us=2_500_000, degraded=True))
    assert (shed["type"], shed["status"], down["type"], down["status"]) == (
        REDUCED_CAPACITY,
        503,
        REDUCED_CAPACITY,
        503,
    )
    assert shed["title"] == "Service temporarily reducing load"
    assert down["title"] == "Service temporarily unable to accept this request"
    assert shed["detail"].endswith("retry in 1 s.") and down["detail"].endswith("retry in 2.5 s.")
    assert "violated-policies" not in shed and "violated-policies" not in down
    fleet = fleet_checks(10, {Priority.LOW: 60})[Priority.LOW]
    by_fleet = Decision.from_results([Result(fleet, False, 0, 60_000_000, 1_000_000)], now_us=1)
    assert by_fleet.verdict is Verdict.SHED
    assert problem_body(by_fleet)["violated-policies"] == ["fleet"]


def test_responses_carry_status_type_retry_after_and_rate_limit_headers() -> None:
    response = problem_response(limited())
    assert response.status_code == 429
    assert response["Content-Type"] == CONTENT_TYPE
    assert response["Retry-After"] == "37"  # whole seconds, rounded up
    assert response["RateLimit-Policy"] == '"fast";q=10;w=1, "slow";q=100;w=3600, "ok";q=5;w=1'
    assert response["RateLimit"].startswith('"slow";r=1;')  # the violated policy with the longest wait
    assert json.loads(response.content)["status"] == 429
    unavailable = problem_response(Decision(Verdict.UNAVAILABLE, (), retry_after_us=1, degraded=True))
    assert (unavailable.status_code, unavailable["Retry-After"], unavailable["X-RateLimit-Degraded"]) == (503, "1", "1")


ROOT = Path(__file__).resolve().parent.parent
#: A problem body as the docs show one: type, title and status in that order, then perhaps the detail.
SHOWN = re.compile(
    r'"type":\s*"(?P<type>[^"]*)",\s*"title":\s*"(?P<title>[^"]*)",\s*"status":\s*(?P<status>\d+)'
    r'(?:,\s*"detail":\s*"(?P<detail>[^"]*)")?'
)


def shape(detail: str) -> str:
    """A detail with its figures left out: ``"Over N rate limit(s); retry in N s."``."""
    return re.sub(r"\d+(?:\.\d+)?", "N", detail)


def sent() -> dict[tuple[str, str, int], str]:
    """The type, title and status of each problem body problems.py sends (a 429, both 503s), and its detail's shape."""
    bodies = [
        problem_body(limited()),
        problem_body(Decision(Verdict.SHED, (), retry_after_us=1)),
        problem_body(Decision(Verdict.UNAVAILABLE, (), retry_after_us=1, degraded=True)),
    ]
    return {(body["type"], body["title"], body["status"]): shape(body["detail"]) for body in bodies}


def test_the_docs_show_the_problem_bodies_that_are_sent() -> None:
    """Every body the docs show has the type, title, status and detail a response has; the contract shows all."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    real = sent()
    assert len(real) == 3
    for page in pages:
        text = page.read_text()
        shown = list(SHOWN.finditer(text))
        assert len(shown) == text.count('"title"'), f"{page.name}: a title not shown as type, title, status"
        for body in shown:
            key = (body["type"], body["title"], int(body["status"]))
            assert key in real, f"{page.name} shows {key}; problems.py sends {list(real)}"
            if body["detail"] not in (None, "..."):
                assert shape(body["detail"]) == real[key], f"{page.name}: the detail of {key[1]!r}"
    contract = (ROOT / "docs" / "contract.md").read_text()
    assert {(m["type"], m["title"], int(m["status"])) for m in SHOWN.finditer(contract)} == set(real)
