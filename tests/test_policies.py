"""Policies from settings: validation with errors that name the field, and resolution."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.test import RequestFactory

from ratelimits.algorithms import Algorithm
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import identify
from ratelimits.policies import Policy, SettingsPolicySource
from ratelimits.rates import parse_rate

from .support.settings import merged

GOOD = {
    "TIERS": {
        "anon": {"rate": "10/s", "burst": 20},
        "free": {"rate": "10/s", "burst": 20, "quota": "1000/d"},
        "pro": {"rate": "100/s", "burst": 200, "algorithm": "sliding_window", "fail_mode": "closed"},
    },
    "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"}},
    "DIMENSIONS": {"ip": {"rate": "300/s"}, "org": {"rate": "1000/m", "burst": 100}},
    "ENDPOINTS": {
        "POST charges": {"cost": 1, "priority": "critical"},
        "reports.export": {"cost": 10, "priority": "low", "rate": "30/m", "endpoint_rate": "600/m"},
        "health": {"exempt": True},
    },
}


def source(settings: Any, **changes: Any) -> SettingsPolicySource:
    settings.RATELIMITS = merged(GOOD, changes)
    return SettingsPolicySource()


def test_good_configuration_resolves_every_dimension(settings: Any, rf: RequestFactory) -> None:
    settings.RATELIMITS = merged(GOOD, {"IDENTITY": {"ORGANIZATION_FUNC": lambda request: "acme"}})
    policies = SettingsPolicySource()
    request = rf.post("/v1/reports/export", REMOTE_ADDR="192.0.2.1")
    identity = identify(request, endpoint="reports.export", auth="sk_1")
    checks = policies.checks_for(request, identity)
    names = [(c.policy.name, c.subject.kind, c.cost) for c in checks]
    assert names == [
        ("tier:free", "api_key", 10),
        ("tier:free:quota", "api_key", 10),
        ("ip", "ip", 10),
        ("org", "org", 10),
        ("endpoint:reports.export", "api_key", 10),
        ("endpoint-all:reports.export", "endpoint", 10),
    ]
    quota = checks[1].policy
    assert quota.algorithm is Algorithm.FIXED_WINDOW and quota.rate == parse_rate("1000/d")


def test_method_specific_rule_and_default_rule(settings: Any) -> None:
    policies = source(settings)
    assert policies.endpoint_rule("charges", "post").priority == "critical"
    assert policies.endpoint_rule("charges", "GET").priority == "normal"
    assert policies.endpoint_rule("reports.export", "GET").cost == 10


def test_exempt_endpoint_has_no_checks(settings: Any, rf: RequestFactory) -> None:
    policies = source(settings)
    request = rf.get("/health", REMOTE_ADDR="192.0.2.1")
    assert policies.checks_for(request, identify(request, endpoint="health")) == []


def test_tier_func_picks_tier_and_unknown_tier_gets_the_default_with_a_logged_error(
    settings: Any, rf: RequestFactory, caplog: pytest.LogCaptureFixture
) -> None:
    policies = source(settings, POLICIES={"TIER_FUNC": lambda request, identity: "pro"})
    request = rf.get("/", REMOTE_ADDR="192.0.2.1")
    assert policies.tier_for(request, identify(request, endpoint="x", auth="k")) == "pro"
    policies = source(settings, POLICIES={"TIER_FUNC": lambda request, identity: "platinum"})
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        for _ in range(3):
            assert policies.tier_for(request, identify(request, endpoint="x", auth="k")) == "free"
            assert [c.policy.name for c in policies.checks_for(request, identify(request, endpoint="x"))] == [
                "tier:anon",
                "ip",
            ]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [  # once per loaded snapshot, not once per request
        "ratelimits: RATELIMITS['POLICIES']['TIER_FUNC'] returned 'platinum', which is not an enabled tier; "
        "the callers it names get the default tier instead",
    ]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"TIERS": {}}, r"RATELIMITS\['TIERS'\] must be a non-empty dict"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "0/s"}}}, r"TIERS'\]\['free'\]\['rate'\]: '0/s'"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "-1/m"}}}, r"\['free'\]\['rate'\]: '-1/m'"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1e3/s"}}}, r"\['free'\]\['rate'\]: '1e3/s'"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"burst": 3}}}, r"\['free'\]: 'rate' is required"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1/s", "burst": 0}}}, r"\['free'\]\['burst'\]: 0"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1/s", "burst": 1.5}}}, r"\['free'\]\['burst'\]: 1.5"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1/s", "algorithm": "leaky"}}}, r"\['algorithm'\]: 'leaky'"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1/s", "fail_mode": "maybe"}}}, r"\['fail_mode'\]: 'maybe'"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1/s", "brust": 5}}}, r"\['free'\]: unknown keys brust"),
        ({"TIERS": {**GOOD["TIERS"], "free": {"rate": "1/s", "quota": "0/d"}}}, r"\['free'\]\['quota'\]: '0/d'"),
        (
            {"POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "gold"}}},
            r"\['authenticated'\]: 'gold'",
        ),
        ({"DIMENSIONS": {"country": {"rate": "1/s"}}}, r"DIMENSIONS'\]: 'country'"),
        ({"ENDPOINTS": {"x": {"cost": 0}}}, r"ENDPOINTS'\]\['x'\]\['cost'\]: 0"),
        ({"ENDPOINTS": {"x": {"priority": "urgent"}}}, r"\['priority'\]: 'urgent'"),
        ({"ENDPOINTS": {"x": {"rate": "NaN/s"}}}, r"\['x'\]\['rate'\]: 'NaN/s'"),
        ({"ENDPOINTS": {"x": {"cost": 25}}}, r"\['x'\]\['cost'\]: 25 exceeds the capacity 20 of tier:anon"),
        ({"ENDPOINTS": {"x": {"cost": 5, "rate": "4/s"}}}, r"capacity 4 of endpoint:x"),
        ({"POLICIES": {"EXEMPT_ENDPOINTS": "health"}}, r"EXEMPT_ENDPOINTS'\] must be a list"),
    ],
)
def test_bad_configuration_names_the_field(settings: Any, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        source(settings, **changes)


def test_policy_names_cannot_carry_hash_tags() -> None:
    with pytest.raises(ConfigurationError, match="policy name"):
        Policy("tier:{x}", parse_rate("1/s"), 1)


def test_scaled_policy_keeps_at_least_one() -> None:
    policy = Policy("p", parse_rate("10/s"), 20)
    half = policy.scaled(0.5)
    assert (half.rate.limit, half.burst) == (5, 10)
    tiny = policy.scaled(0.01)
    assert (tiny.rate.limit, tiny.burst) == (1, 1)
    assert policy.scaled(1.0) is policy


def test_a_share_of_a_policy_is_made_once() -> None:
    """The degraded path scales every request's policies: the same object each time keeps the
    memos keyed by policy (the headers') from filling with copies while Redis is out."""
    policy = Policy("p", parse_rate("10/s"), 20)
    half = policy.scaled(0.5)
    assert policy.scaled(0.5) is half
    assert policy.scaled(0.25) is not half and policy.scaled(0.5, at_least=12) is not half
    assert policy.scaled(0.5, at_least=12).burst == 12
    twin = Policy("p", parse_rate("10/s"), 20)  # equal, but another object: its own entry
    assert twin.scaled(0.5) == half and twin.scaled(0.5) is not half


def test_scaled_policy_still_fits_the_cost() -> None:
    bucket = Policy("p", parse_rate("10/s"), 20).scaled(0.25, at_least=10)
    assert (bucket.rate.limit, bucket.burst, bucket.capacity) == (2, 10, 10)
    window = Policy("w", parse_rate("20/m"), 20, Algorithm.FIXED_WINDOW).scaled(0.25, at_least=10)
    assert window.capacity == 10


def test_describe_and_window() -> None:
    assert Policy("p", parse_rate("100/s"), 200).describe() == "100 / second, burst 200"
    assert Policy("p", parse_rate("100/s"), 200).window_seconds == 2
    window = Policy("q", parse_rate("5/10m"), 5, Algorithm.SLIDING_WINDOW)
    assert window.describe() == "5 / 10 minutes (sliding window)" and window.window_seconds == 600


def test_quota_only_belongs_to_tiers(settings: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"DIMENSIONS'\]\['ip'\]: unknown keys quota"):
        source(settings, DIMENSIONS={"ip": {"rate": "10/s", "quota": "100/d"}})


def test_bad_tier_name_names_the_field(settings: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"TIERS'\]\['gold plan'\]: policy name"):
        source(settings, TIERS={**GOOD["TIERS"], "gold plan": {"rate": "1/s"}})


def test_a_tier_func_returning_no_name_at_all_never_breaks_a_request(
    settings: Any, rf: RequestFactory, caplog: pytest.LogCaptureFixture
) -> None:
    policies = source(settings, POLICIES={"TIER_FUNC": lambda request, identity: ["pro"]})
    request = rf.get("/", REMOTE_ADDR="192.0.2.1")
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        assert policies.tier_for(request, identify(request, endpoint="x", auth="k")) == "free"
    assert "returned ['pro'], which is not an enabled tier" in caplog.text


def test_the_protocol_names_its_members_for_the_checks() -> None:
    from ratelimits.policies.source import _MEMBERS, PolicySource

    assert set(_MEMBERS) == {name for name in dir(PolicySource) if not name.startswith("_")}
