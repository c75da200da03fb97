"""Rate-limit headers of a decision: which policies they describe, in which style, and Retry-After.

Every ``RateLimit-Policy`` and ``RateLimit`` these tests look at is read with an RFC 9651 parser
(``http_sfv``), not by comparing text only: what a client's parser makes of them is the contract.
"""

from __future__ import annotations

import base64
import hashlib
import math
import operator
from fractions import Fraction
from typing import Any

import http_sfv
import pytest
from django.test import override_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from ratelimits.algorithms import Algorithm
from ratelimits.choices import Priority
from ratelimits.decisions import Decision, Result
from ratelimits.headers import SF_INTEGER_MAX, rate_limit_headers, retry_after_seconds
from ratelimits.identity import Subject, SubjectKind, subject_of
from ratelimits.policies import Check, Policy, check_for, concurrency_policy, fleet_checks
from ratelimits.rates import MAX_BURST, MAX_LIMIT, MAX_PERIOD_US, MAX_REFILL_US, UNITS_US, Rate, parse_rate

NOW_US = 1_700_000_000_250_000
KEY = Subject(SubjectKind.API_KEY, "k")
SECOND = Policy("per-second", parse_rate("10/s"), 20)
DAY = Policy("per-day", parse_rate("1000/d"), 1000, Algorithm.FIXED_WINDOW)
SLOTS = concurrency_policy("in-flight", 2, fail_mode="open")
FLEET = fleet_checks(10, {Priority.LOW: 60})[Priority.LOW].policy
SHARDED = Policy("endpoint-all:search", parse_rate("100/s"), 100, shards=4)

Params = dict[str, Any]


def result(
    policy: Policy,
    *,
    allowed: bool = True,
    remaining: int,
    reset_us: int = 0,
    retry_us: int = 0,
    subject: Subject = KEY,
) -> Result:
    if policy.algorithm is Algorithm.FLEET:
        subject = Subject(SubjectKind.FLEET, "in-flight")
    check = check_for(policy, subject, 1) if policy.shards > 1 else Check(policy, subject)
    return Result(check, allowed, remaining, reset_us, retry_us)


def decide(*results: Result, degraded: bool = False) -> Decision:
    return Decision.from_results(results, now_us=NOW_US, degraded=degraded)


def parsed(field: str) -> list[tuple[str, Params]]:
    """A List field as an RFC 9651 parser reads it: each member's value and parameters."""
    members = http_sfv.List()
    members.parse(field.encode("ascii"))
    return [(member.value, dict(member.params)) for member in members]


def listed(headers: dict[str, str]) -> list[str]:
    """The names of the policies ``RateLimit-Policy`` lists."""
    return [name for name, _ in parsed(headers["RateLimit-Policy"])]


def named(headers: dict[str, str]) -> tuple[str, Params]:
    """The one policy ``RateLimit`` names, and its parameters."""
    [item] = parsed(headers["RateLimit"])
    return item


def test_an_admitted_request_lists_every_policy_and_names_the_closest() -> None:
    decision = decide(
        result(SECOND, remaining=15, reset_us=500_000), result(DAY, remaining=100, reset_us=3_600_000_000)
    )
    headers = rate_limit_headers(decision)
    assert headers["RateLimit-Policy"] == '"per-second";q=20;w=2, "per-day";q=1000;w=86400'
    assert parsed(headers["RateLimit-Policy"]) == [
        ("per-second", {"q": 20, "w": 2}),
        ("per-day", {"q": 1000, "w": 86400}),
    ]
    # 100 of 1000 left is closer to the limit than 15 of 20.
    assert headers["RateLimit"] == '"per-day";r=100;t=3600'
    assert named(headers) == ("per-day", {"r": 100, "t": 3600})
    assert headers["X-RateLimit-Limit"] == "1000"
    assert headers["X-RateLimit-Remaining"] == "100"
    assert headers["X-RateLimit-Used"] == "900"
    assert headers["X-RateLimit-Resource"] == "per-day"
    assert headers["X-RateLimit-Reset"] == str(-(-(NOW_US + 3_600_000_000) // 1_000_000))
    assert "X-RateLimit-Degraded" not in headers and "X-RateLimit-Shadow" not in headers


def test_a_denied_request_names_the_violated_policy_with_the_longest_wait() -> None:
    decision = decide(
        result(SECOND, allowed=False, remaining=0, reset_us=2_000_000, retry_us=100_000),
        result(DAY, allowed=False, remaining=0, reset_us=7_200_000_000, retry_us=7_200_000_000),
    )
    headers = rate_limit_headers(decision)
    assert listed(headers) == ["per-second", "per-day"]
    assert named(headers) == ("per-day", {"r": 0, "t": 7200})
    assert retry_after_seconds(decision) == 7200


def test_a_refused_requests_t_is_its_wait_not_the_time_until_the_bucket_is_full() -> None:
    """A drained 10/s bucket of 20 refills in 2 s but admits again in 0.1 s: ``t`` says when this
    request could pass, as ``Retry-After`` does (a client reading only ``RateLimit`` waits that)."""
    decision = decide(result(SECOND, allowed=False, remaining=0, reset_us=2_000_000, retry_us=100_000))
    headers = rate_limit_headers(decision)
    assert named(headers) == ("per-second", {"r": 0, "t": 1})
    assert headers["X-RateLimit-Reset"] == str(-(-(NOW_US + 100_000) // 1_000_000))
    assert retry_after_seconds(decision) == 1
    slow = decide(result(SECOND, allowed=False, remaining=0, reset_us=2_000_000, retry_us=1_300_000))
    assert named(rate_limit_headers(slow)) == ("per-second", {"r": 0, "t": 2})


def test_slots_are_listed_named_only_when_they_deny_and_the_fleet_never() -> None:
    full = rate_limit_headers(
        decide(result(SECOND, remaining=19, reset_us=100_000), result(SLOTS, remaining=0), result(FLEET, remaining=0))
    )
    assert full["RateLimit-Policy"] == '"per-second";q=20;w=2, "in-flight";q=2;qu="concurrent-requests"'
    assert named(full)[0] == "per-second"
    denied = rate_limit_headers(
        decide(result(SECOND, remaining=19), result(SLOTS, allowed=False, remaining=0, retry_us=1_000_000))
    )
    assert denied["RateLimit"] == '"in-flight";r=0'  # no reset: slots come back when requests finish
    assert listed(denied) == ["per-second", "in-flight"]
    shed = rate_limit_headers(
        decide(result(SECOND, remaining=19), result(FLEET, allowed=False, remaining=0, retry_us=1_000_000))
    )
    assert shed["RateLimit-Policy"] == '"per-second";q=20;w=2'
    assert named(shed)[0] == "per-second"


def test_degraded_and_shadow_decisions_say_so() -> None:
    trial = Policy("trial", parse_rate("1/s"), 1, shadow=True)
    decision = decide(result(SECOND, remaining=3), result(trial, allowed=False, remaining=0, retry_us=5), degraded=True)
    headers = rate_limit_headers(decision)
    assert headers["X-RateLimit-Degraded"] == "1"
    assert headers["X-RateLimit-Shadow"] == '"trial"'
    assert headers["RateLimit-Policy"] == '"per-second";q=20;w=2'  # a shadow policy is never described


def test_closest_describes_only_the_closest_policy(settings: Any) -> None:
    settings.RATELIMITS = {"HEADERS": {"POLICIES": "closest"}}
    admitted = decide(result(SECOND, remaining=15, reset_us=500_000), result(DAY, remaining=100, reset_us=10**9))
    assert rate_limit_headers(admitted)["RateLimit-Policy"] == '"per-day";q=1000;w=86400'
    full = decide(
        result(SECOND, remaining=19, reset_us=100_000), result(SLOTS, remaining=0), result(FLEET, remaining=0)
    )
    assert rate_limit_headers(full)["RateLimit-Policy"] == '"per-second";q=20;w=2'
    denied = decide(result(SECOND, remaining=19), result(SLOTS, allowed=False, remaining=0, retry_us=1_000_000))
    assert rate_limit_headers(denied)["RateLimit-Policy"] == '"in-flight";q=2;qu="concurrent-requests"'


def test_a_policy_checked_for_two_subjects_is_listed_once() -> None:
    ip = subject_of(SubjectKind.IP, "192.0.2.1")
    decision = decide(result(SECOND, remaining=3), result(DAY, remaining=999), result(SECOND, remaining=9, subject=ip))
    assert listed(rate_limit_headers(decision)) == ["per-second", "per-day"]


def keyed_hash(subject: Subject) -> bytes:
    """The keyed hash that names ``subject`` in key names (:attr:`Subject.digest`), as bytes."""
    return base64.urlsafe_b64decode(subject.digest)


def test_the_partition_key_is_the_keyed_hash_of_each_checks_subject(settings: Any) -> None:
    settings.RATELIMITS = {"HEADERS": {"PARTITION_KEY": True}}
    caller = subject_of(SubjectKind.API_KEY, "ApiKey:7")
    endpoint = subject_of(SubjectKind.ENDPOINT, "search")
    everyone = Policy("endpoint-all", parse_rate("100/s"), 100)
    headers = rate_limit_headers(
        decide(
            result(SECOND, remaining=3, subject=caller),
            result(DAY, remaining=999, subject=caller),
            result(SLOTS, remaining=1, subject=caller),
            result(everyone, remaining=99, subject=endpoint),
        )
    )
    keys = {name: params["pk"] for name, params in parsed(headers["RateLimit-Policy"])}
    assert keys == {
        "per-second": keyed_hash(caller),
        "per-day": keyed_hash(caller),
        "in-flight": keyed_hash(caller),
        "endpoint-all": keyed_hash(endpoint),
    }
    assert keyed_hash(caller) != keyed_hash(endpoint) and len(keyed_hash(caller)) == 12
    assert named(headers) == ("per-second", {"r": 3, "t": 0, "pk": keyed_hash(caller)})
    assert b"ApiKey" not in b"".join(keys.values()) and "ApiKey" not in headers["RateLimit-Policy"]


def test_the_partition_key_is_keyed_with_the_hash_key_not_a_plain_hash_of_the_subject() -> None:
    seen = []
    for hash_key in ("one secret", "another secret"):
        with override_settings(RATELIMITS={"HEADERS": {"PARTITION_KEY": True}, "IDENTITY": {"HASH_KEY": hash_key}}):
            subject = subject_of(SubjectKind.IP, "192.0.2.9")
            seen.append(named(rate_limit_headers(decide(result(SECOND, remaining=3, subject=subject))))[1]["pk"])
    unkeyed = hashlib.blake2b(b"ip\x00192.0.2.9", digest_size=12).digest()
    assert seen[0] != seen[1] and unkeyed not in seen
    assert hashlib.sha256(b"192.0.2.9").digest()[:12] not in seen


def test_a_sharded_policy_gives_the_whole_subjects_partition_key(settings: Any) -> None:
    settings.RATELIMITS = {"HEADERS": {"PARTITION_KEY": True}}
    endpoint = subject_of(SubjectKind.ENDPOINT, "search")
    shards, keys = set(), set()
    for _ in range(64):  # check_for picks one of the 4 shards at random: all of them, in all likelihood
        one = result(SHARDED, remaining=20, subject=endpoint)
        shards.add(one.check.subject)
        keys.add(named(rate_limit_headers(decide(one)))[1]["pk"])
    assert len(shards) > 1 and endpoint not in shards
    assert keys == {keyed_hash(endpoint)}


def test_the_partition_key_follows_the_setting_both_ways() -> None:
    decision = decide(result(SECOND, remaining=15), result(DAY, remaining=100))
    for partition_key, policies in [(False, "all"), (True, "all"), (True, "closest"), (False, "all")]:
        with override_settings(RATELIMITS={"HEADERS": {"PARTITION_KEY": partition_key, "POLICIES": policies}}):
            headers = rate_limit_headers(decision)
        items = parsed(headers["RateLimit-Policy"])
        assert len(items) == (2 if policies == "all" else 1)
        assert all(("pk" in params) is partition_key for _, params in [*items, named(headers)])


def test_the_github_headers_are_the_same_whatever_the_new_options() -> None:
    decision = decide(result(SECOND, remaining=15, reset_us=500_000), result(DAY, remaining=100, reset_us=10**9))
    seen = []
    for extra in ({"POLICIES": "closest"}, {"POLICIES": "all", "PARTITION_KEY": True}):
        with override_settings(RATELIMITS={"HEADERS": {"STYLE": "github", **extra}}):
            seen.append(rate_limit_headers(decision))
    assert seen[0] == seen[1] and "RateLimit-Policy" not in seen[0] and seen[0]["X-RateLimit-Resource"] == "per-day"


@pytest.mark.parametrize(
    ("style", "present", "absent"),
    [
        ("ietf", ["RateLimit", "RateLimit-Policy"], ["X-RateLimit-Limit"]),
        ("github", ["X-RateLimit-Limit", "X-RateLimit-Reset"], ["RateLimit"]),
        ("none", [], ["RateLimit", "X-RateLimit-Limit"]),
    ],
)
def test_header_styles(settings: Any, style: str, present: list[str], absent: list[str]) -> None:
    settings.RATELIMITS = {"HEADERS": {"STYLE": style}}
    headers = rate_limit_headers(decide(result(SECOND, remaining=3)))
    assert all(name in headers for name in present) and not any(name in headers for name in absent)


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    def wait(us: int) -> int:
        return retry_after_seconds(decide(result(SECOND, allowed=False, remaining=0, retry_us=us)))

    assert [wait(1), wait(999_999), wait(1_000_000), wait(1_000_001)] == [1, 1, 1, 2]


def test_jitter_only_ever_adds(settings: Any) -> None:
    settings.RATELIMITS = {"HEADERS": {"RETRY_AFTER_JITTER": "3s"}}
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
    SLOTS,
    FLEET,
    SHARDED,
]
#: A row of a generated decision: policy, allowed, remaining, reset, retry, subject.
Row = tuple[Policy, bool, int, int, int, Subject]
SUBJECTS = [KEY, subject_of(SubjectKind.IP, "2001:db8::/64"), subject_of(SubjectKind.ENDPOINT, "search")]
ROWS = st.lists(
    st.tuples(
        st.sampled_from(POLICIES),
        st.booleans(),
        st.integers(0, 20),
        st.integers(0, 3),
        st.integers(1, 3),
        st.sampled_from(SUBJECTS),
    ),
    max_size=6,
)


def results_of(rows: list[Row]) -> list[Result]:
    return [
        result(
            p,
            allowed=allowed,
            remaining=min(left, p.capacity),
            reset_us=reset,
            retry_us=0 if allowed else retry,
            subject=subject,
        )
        for p, allowed, left, reset, retry, subject in rows
    ]


@settings(max_examples=300, deadline=None)
@given(ROWS)
def test_the_closest_result_is_the_one_its_definition_names(
    rows: list[Row],
) -> None:
    """Ties included (small ranges make them common): the same object, so the first of equals."""
    decision = decide(*results_of(rows))
    assert decision.closest is closest_by_definition(decision)


@settings(max_examples=300, deadline=None)
@given(ROWS, st.sampled_from(["ietf", "both"]), st.sampled_from(["all", "closest"]), st.booleans())
def test_every_decision_has_headers_a_structured_field_parser_reads_as_described(
    rows: list[Row], style: str, policies: str, partition_key: bool
) -> None:
    decision = decide(*results_of(rows))
    options = {"HEADERS": {"POLICIES": policies, "PARTITION_KEY": partition_key}}
    with override_settings(RATELIMITS=options):
        headers = rate_limit_headers(decision)
    closest = decision.closest
    if closest is None:
        assert "RateLimit" not in headers and "RateLimit-Policy" not in headers
        return
    enforced = [
        r for r in decision.results if not r.check.policy.shadow and r.check.policy.algorithm is not Algorithm.FLEET
    ]
    expected = list(dict.fromkeys(r.policy_name for r in enforced)) if policies == "all" else [closest.policy_name]
    items = parsed(headers["RateLimit-Policy"])
    assert [name for name, _ in items] == expected
    for name, params in items:
        assert isinstance(params.pop("q"), int) and (params.pop("pk", None) is not None) is partition_key
        if name == SLOTS.name:
            assert params == {"qu": "concurrent-requests"}
        else:
            assert set(params) == {"w"} and params["w"] >= 1
    name, params = named(headers)
    assert name == closest.policy_name and params["r"] == closest.remaining
    assert ("t" in params) is not closest.check.policy.holds_slots
    if partition_key:
        assert len(params["pk"]) == 12


# -- RateLimit-Policy states each policy's rate ---------------------------------------------------

US = 1_000_000


def advertised(policy: Policy) -> tuple[int, int]:
    """``q`` and ``w`` of the policy's ``RateLimit-Policy`` item, as a client's parser reads them."""
    [(name, params)] = parsed(rate_limit_headers(decide(result(policy, remaining=policy.capacity)))["RateLimit-Policy"])
    assert name == policy.name and set(params) == {"q", "w"}
    return params["q"], params["w"]


def per_second(policy: Policy) -> Fraction:
    """The policy's rate in requests a second, exactly."""
    return Fraction(policy.rate.limit * US, policy.rate.period_us)


@pytest.mark.parametrize(
    ("rate", "burst", "algorithm", "quota", "window"),
    [
        ("10/s", 20, Algorithm.TOKEN_BUCKET, 20, 2),  # a whole-second refill: the burst over it, as before
        ("2/s", 5, Algorithm.TOKEN_BUCKET, 6, 3),  # refills in 2.5 s; was q=5;w=3, 1.67 a second
        ("100/s", 10, Algorithm.TOKEN_BUCKET, 100, 1),  # refills in 0.1 s; was q=10;w=1, a tenth of the rate
        ("1/1500ms", 1, Algorithm.TOKEN_BUCKET, 2, 3),
        ("2/500ms", 2, Algorithm.TOKEN_BUCKET, 4, 1),
        ("7/h", 10, Algorithm.TOKEN_BUCKET, 14, 7200),  # refills in 85.7 minutes: 14 in two hours
        ("3/1500ms", 3, Algorithm.FIXED_WINDOW, 4, 2),
        ("5/10m", 5, Algorithm.SLIDING_WINDOW, 5, 600),
        ("1000/d", 1000, Algorithm.FIXED_WINDOW, 1000, 86400),
    ],
)
def test_rate_limit_policy_states_the_policys_rate_exactly(
    rate: str, burst: int, algorithm: Algorithm, quota: int, window: int
) -> None:
    policy = Policy("p", parse_rate(rate), burst, algorithm)
    assert advertised(policy) == (quota, window)
    assert Fraction(quota, window) == per_second(policy)


def test_a_rate_no_short_window_states_is_within_half_a_request() -> None:
    """1/1001ms is 1000/1001 a second: exact only over 1001 s, past the bound of 120 s."""
    policy = Policy("p", parse_rate("1/1001ms"), 1)
    quota, window = advertised(policy)
    assert (quota, window) == (120, 120)
    assert abs(quota - per_second(policy) * window) <= Fraction(1, 2)


#: Any period a Rate takes, and whole numbers of the units rates are written in (whole seconds
#: and longer must always be stated exactly).
PERIODS = st.one_of(
    st.integers(1, MAX_PERIOD_US),
    st.builds(operator.mul, st.integers(1, 1000), st.sampled_from(sorted(set(UNITS_US.values())))).filter(
        lambda period: period <= MAX_PERIOD_US
    ),
)


@st.composite
def refilling_policies(draw: st.DrawFn) -> Policy:
    """Any policy that refills with time, within the bounds every policy is checked against."""
    limit = draw(st.one_of(st.integers(1, 100), st.integers(1, MAX_LIMIT)))
    period = draw(PERIODS)
    most = min(MAX_BURST, MAX_REFILL_US * limit // period)  # what check_burst accepts
    burst = draw(st.one_of(st.integers(1, min(most, 100)), st.integers(1, most)))
    algorithm = draw(st.sampled_from([Algorithm.TOKEN_BUCKET, Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW]))
    return Policy("p", Rate(limit, period), burst, algorithm)


@settings(max_examples=1000, deadline=None)
@given(refilling_policies())
def test_q_over_w_is_the_policys_rate_exactly_or_within_the_documented_bound(policy: Policy) -> None:
    """docs/contract.md: ``w`` is the smallest whole number of seconds, no shorter than the time
    the policy grants its capacity in, over which its rate grants a whole number ``q``; past the
    bound (twice the longest of that time, the period and a minute), the bound, and ``q`` within
    half a request of the rate over it."""
    quota, window = advertised(policy)
    rate = per_second(policy)
    shortest = max(math.ceil(policy.capacity / rate), 1)
    assert 1 <= window <= SF_INTEGER_MAX and 1 <= quota <= SF_INTEGER_MAX
    if quota == SF_INTEGER_MAX:  # a rate of trillions a second: no Integer of the field states it
        assert rate * window >= SF_INTEGER_MAX
        return
    # Never a quota below the capacity: RateLimit's r (at most the capacity) never exceeds q.
    assert window >= shortest and quota >= policy.capacity
    if Fraction(quota, window) == rate:
        # The smallest such window: rate x w is whole exactly when w is a multiple of the rate's denominator.
        assert window % rate.denominator == 0 and window - rate.denominator < shortest
        return
    bound = 2 * max(shortest, math.ceil(Fraction(policy.rate.period_us, US)), 60)
    assert policy.rate.period_us % US != 0, "a period of whole seconds is always stated exactly"
    assert window == bound and math.ceil(Fraction(shortest, rate.denominator)) * rate.denominator > bound
    assert abs(quota - rate * window) <= Fraction(1, 2)
