"""Rate-limit headers of a decision: which policy they describe, in which style, and Retry-After."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratelimits.algorithms import Algorithm
from ratelimits.choices import Priority
from ratelimits.decisions import Decision, Result
from ratelimits.headers import rate_limit_headers, retry_after_seconds
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies import Check, Policy, concurrency_policy, fleet_checks
from ratelimits.rates import parse_rate

NOW_US = 1_700_000_000_250_000
KEY = Subject(SubjectKind.API_KEY, "k")
SECOND = Policy("per-second", parse_rate("10/s"), 20)
DAY = Policy("per-day", parse_rate("1000/d"), 1000, Algorithm.FIXED_WINDOW)


def result(policy: Policy, *, allowed: bool = True, remaining: int, reset_us: int = 0, retry_us: int = 0) -> Result:
    subject = Subject(SubjectKind.FLEET, "in-flight") if policy.algorithm is Algorithm.FLEET else KEY
    return Result(Check(policy, subject), allowed, remaining, reset_us, retry_us)


def decide(*results: Result, degraded: bool = False) -> Decision:
    return Decision.from_results(results, now_us=NOW_US, degraded=degraded)


def test_an_admitted_request_describes_the_policy_closest_to_its_limit() -> None:
    decision = decide(
        result(SECOND, remaining=15, reset_us=500_000), result(DAY, remaining=100, reset_us=3_600_000_000)
    )
    headers = rate_limit_headers(decision)
    # 100 of 1000 left is closer to the limit than 15 of 20.
    assert headers["RateLimit-Policy"] == '"per-day";q=1000;w=86400'
    assert headers["RateLimit"] == '"per-day";r=100;t=3600'
    assert headers["X-RateLimit-Limit"] == "1000"
    assert headers["X-RateLimit-Remaining"] == "100"
    assert headers["X-RateLimit-Used"] == "900"
    assert headers["X-RateLimit-Resource"] == "per-day"
    assert headers["X-RateLimit-Reset"] == str(-(-(NOW_US + 3_600_000_000) // 1_000_000))
    assert "X-RateLimit-Degraded" not in headers and "X-RateLimit-Shadow" not in headers


def test_a_denied_request_describes_the_violated_policy_with_the_longest_wait() -> None:
    decision = decide(
        result(SECOND, allowed=False, remaining=0, reset_us=2_000_000, retry_us=100_000),
        result(DAY, allowed=False, remaining=0, reset_us=7_200_000_000, retry_us=7_200_000_000),
    )
    assert rate_limit_headers(decision)["RateLimit-Policy"] == '"per-day";q=1000;w=86400'
    assert retry_after_seconds(decision) == 7200


def test_slots_are_described_only_when_they_deny_and_the_fleet_never() -> None:
    slots = concurrency_policy("in-flight", 2, fail_mode="open")
    fleet = fleet_checks(10, {Priority.LOW: 60})[Priority.LOW].policy
    full = decide(
        result(SECOND, remaining=19, reset_us=100_000), result(slots, remaining=0), result(fleet, remaining=0)
    )
    assert rate_limit_headers(full)["RateLimit-Policy"] == '"per-second";q=20;w=2'
    denied = decide(result(SECOND, remaining=19), result(slots, allowed=False, remaining=0, retry_us=1_000_000))
    headers = rate_limit_headers(denied)
    assert headers["RateLimit-Policy"] == '"in-flight";q=2;qu="concurrent-requests"'
    assert headers["RateLimit"] == '"in-flight";r=0'  # no reset: slots come back when requests finish
    shed = decide(result(SECOND, remaining=19), result(fleet, allowed=False, remaining=0, retry_us=1_000_000))
    assert rate_limit_headers(shed)["RateLimit-Policy"] == '"per-second";q=20;w=2'


def test_degraded_and_shadow_decisions_say_so() -> None:
    trial = Policy("trial", parse_rate("1/s"), 1, shadow=True)
    decision = decide(result(SECOND, remaining=3), result(trial, allowed=False, remaining=0, retry_us=5), degraded=True)
    headers = rate_limit_headers(decision)
    assert headers["X-RateLimit-Degraded"] == "1"
    assert headers["X-RateLimit-Shadow"] == '"trial"'
    assert headers["RateLimit-Policy"] == '"per-second";q=20;w=2'  # a shadow policy is never described


@pytest.mark.parametrize(
    ("style", "present", "absent"),
    [
        ("ietf", ["RateLimit", "RateLimit-Policy"], ["X-RateLimit-Limit"]),
        ("github", ["X-RateLimit-Limit", "X-RateLimit-Reset"], ["RateLimit"]),
        ("none", [], ["RateLimit", "X-RateLimit-Limit"]),
    ],
)
def test_header_styles(settings: Any, style: str, present: list[str], absent: list[str]) -> None:
    settings.RATELIMITS = {"HEADERS": style}
    headers = rate_limit_headers(decide(result(SECOND, remaining=3)))
    assert all(name in headers for name in present) and not any(name in headers for name in absent)


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    def wait(us: int) -> int:
        return retry_after_seconds(decide(result(SECOND, allowed=False, remaining=0, retry_us=us)))

    assert [wait(1), wait(999_999), wait(1_000_000), wait(1_000_001)] == [1, 1, 1, 2]


def test_jitter_only_ever_adds(settings: Any) -> None:
    settings.RATELIMITS = {"RETRY_AFTER_JITTER": "3s"}
    decision = decide(result(SECOND, allowed=False, remaining=0, retry_us=2_000_000))
    seen = {retry_after_seconds(decision) for _ in range(300)}
    assert seen <= {2, 3, 4, 5} and len(seen) > 1  # never less than the exact wait, and it varies


def closest_by_definition(decision: Decision) -> Result | None:
    """What the docstring of ``Decision.closest`` says, written the plain way."""
    violated = [r for r in decision.violated if r.check.policy.algorithm is not Algorithm.FLEET]
    if violated:
        return max(violated, key=lambda r: r.retry_us)
    candidates = [r for r in decision.results if not r.check.policy.shadow and not r.check.policy.holds_slots]
    return min(candidates, key=lambda r: (r.remaining / r.limit, r.reset_us)) if candidates else None


POLICIES = [
    SECOND,
    DAY,
    Policy("shadowed", parse_rate("5/s"), 5, shadow=True),
    concurrency_policy("in-flight", 3, fail_mode="open"),
    fleet_checks(10, {Priority.LOW: 60})[Priority.LOW].policy,
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(POLICIES),
            st.booleans(),
            st.integers(0, 20),
            st.integers(0, 3),
            st.integers(1, 3),
        ),
        max_size=6,
    )
)
def test_the_closest_result_is_the_one_its_definition_names(rows: list[tuple[Policy, bool, int, int, int]]) -> None:
    """Ties included (small ranges make them common): the same object, so the first of equals."""
    results = [
        result(p, allowed=allowed, remaining=min(left, p.capacity), reset_us=reset, retry_us=0 if allowed else retry)
        for p, allowed, left, reset, retry in rows
    ]
    decision = decide(*results)
    assert decision.closest is closest_by_definition(decision)
