"""One table of resolution cases, run against both policy sources: settings and the admin's tables.

Each case describes policies once, in the settings' words; the database side writes the same
policies as rows. Both sources load them into a snapshot that one resolver reads, so for every
case both must resolve the request into exactly the same checks: policy, subject, cost, limit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.test import RequestFactory

from ratelimits import engine
from ratelimits.counters import caller_rows, subject_labels
from ratelimits.engine.evaluation import usage_of
from ratelimits.identity import identify
from ratelimits.models import EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier
from ratelimits.policies.resolver import resolve
from ratelimits.policies.values import KeptChecks
from ratelimits.rates import MAX_LIMIT
from ratelimits.store.audit import audit_context

from .support.settings import merged

pytestmark = pytest.mark.django_db

TIERS = {
    "anon": {"rate": "10/s", "burst": 20},
    "basic": {"rate": "5/s", "burst": 10, "quota": "1000/d", "concurrency": 2},
    "pro": {"rate": "100/m", "algorithm": "sliding_window"},
}
DEFAULTS = {"anonymous": "anon", "authenticated": "basic"}


@dataclass(frozen=True)
class Case:
    name: str
    expected: list[tuple[str, str, int, int]]
    #: The request: an API key (or anonymous), its organisation, the endpoint and method.
    key: bool = True
    org: str | None = None
    endpoint: str = "customers"
    method: str = "GET"
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    exempt: tuple[str, ...] = ()
    dimensions: dict[str, Any] = field(default_factory=dict)
    fleet: tuple[int, dict[str, int]] | None = None
    tier_func: str | None = None


CASES = [
    Case("anonymous callers get the anonymous tier, on their IP", [("tier:anon", "ip", 1, 20)], key=False),
    Case(
        "authenticated callers get the authenticated tier: rate, quota, one slot",
        [
            ("tier:basic", "api_key", 1, 10),
            ("tier:basic:quota", "api_key", 1, 1000),
            ("tier:basic:concurrency", "api_key", 1, 2),
        ],
    ),
    Case("TIER_FUNC places the caller", [("tier:pro", "api_key", 1, 100)], tier_func="pro"),
    Case(
        "a tier TIER_FUNC names that does not exist: the default tier",
        [
            ("tier:basic", "api_key", 1, 10),
            ("tier:basic:quota", "api_key", 1, 1000),
            ("tier:basic:concurrency", "api_key", 1, 2),
        ],
        tier_func="platinum",
    ),
    Case(
        "an endpoint's cost, its own limits per caller and for everyone",
        [
            ("tier:pro", "api_key", 10, 100),
            ("endpoint:reports.export", "api_key", 10, 30),
            ("endpoint-all:reports.export", "endpoint", 10, 600),
        ],
        tier_func="pro",
        endpoint="reports.export",
        method="POST",
        endpoints={"reports.export": {"cost": 10, "priority": "low", "rate": "30/m", "endpoint_rate": "600/m"}},
    ),
    Case(
        "a method's own rule beats the any-method rule",
        [("tier:pro", "api_key", 3, 100)],
        tier_func="pro",
        endpoint="charges",
        method="POST",
        endpoints={"POST charges": {"cost": 3}, "charges": {"cost": 2}},
    ),
    Case(
        "other methods get the any-method rule",
        [("tier:pro", "api_key", 2, 100)],
        tier_func="pro",
        endpoint="charges",
        endpoints={"POST charges": {"cost": 3}, "charges": {"cost": 2}},
    ),
    Case("an exempt endpoint has no checks", [], endpoint="health", exempt=("health",)),
    Case(
        "dimensions limit every subject of their kind the request has",
        [("tier:anon", "ip", 1, 20), ("ip", "ip", 1, 300)],
        key=False,
        org="acme",
        dimensions={"ip": "300/s", "api_key": {"rate": "50/s", "burst": 60}},
    ),
    Case(
        "...including the organisation",
        [
            ("tier:pro", "api_key", 1, 100),
            ("ip", "ip", 1, 300),
            ("org", "org", 1, 100),
        ],
        tier_func="pro",
        org="acme",
        dimensions={"ip": "300/s", "org": {"rate": "1000/m", "burst": 100}},
    ),
    Case(
        "the fleet's in-flight limit for the endpoint's priority",
        # With the tenant's cap on the fleet: half its capacity (SHEDDING['TENANT_SHARE']'s default).
        [("tier:pro", "api_key", 1, 100), ("fleet", "fleet", 1, 6), ("fleet-share", "api_key", 1, 5)],
        tier_func="pro",
        endpoint="reports.export",
        endpoints={"reports.export": {"priority": "low"}},
        fleet=(10, {"low": 60, "normal": 75, "high": 90}),
    ),
    Case(
        "critical requests are never shed, but take a fleet slot",
        [("tier:pro", "api_key", 1, 100), ("fleet", "fleet", 1, MAX_LIMIT), ("fleet-share", "api_key", 1, 5)],
        tier_func="pro",
        endpoint="charges",
        endpoints={"charges": {"priority": "critical"}},
        fleet=(10, {"low": 60, "normal": 75, "high": 90}),
    ),
]


def use_settings(settings: Any, case: Case) -> None:
    shedding = {"FLEET_CAPACITY": case.fleet[0], "THRESHOLDS": case.fleet[1]} if case.fleet else {}
    settings.RATELIMITS = merged(
        base(case),
        {"TIERS": TIERS, "POLICIES": {"DEFAULT_TIERS": DEFAULTS}, "ENDPOINTS": case.endpoints, "SHEDDING": shedding},
    )


def use_database(settings: Any, case: Case) -> None:
    settings.RATELIMITS = merged(base(case), {"POLICIES": {"SOURCE": "database"}})
    with audit_context(reason="resolution table"):
        for model in (Override, SubjectAssignment, EndpointPolicy, FleetSettings, Tier):
            for row in model.objects.all():
                row.delete()
        tiers = {
            name: Tier.objects.create(
                name=name,
                rate=config["rate"],
                burst=config.get("burst"),
                quota=config.get("quota", ""),
                concurrency=config.get("concurrency"),
                algorithm=config.get("algorithm", "token_bucket"),
            )
            for name, config in TIERS.items()
        }
        capacity, thresholds = case.fleet or (None, {"low": 60, "normal": 75, "high": 90})
        FleetSettings.objects.create(
            anonymous_tier=tiers[DEFAULTS["anonymous"]],
            authenticated_tier=tiers[DEFAULTS["authenticated"]],
            capacity=capacity,
            shed_low_percent=thresholds["low"],
            shed_normal_percent=thresholds["normal"],
            shed_high_percent=thresholds["high"],
        )
        for name, config in case.endpoints.items():
            method, _, endpoint = name.rpartition(" ")
            EndpointPolicy.objects.create(
                endpoint=endpoint,
                method=method or "ANY",
                cost=config.get("cost", 1),
                priority=config.get("priority", "normal"),
                per_caller_rate=config.get("rate", ""),
                endpoint_rate=config.get("endpoint_rate", ""),
            )


def base(case: Case) -> dict[str, Any]:
    tier = case.tier_func
    return {
        "BACKEND": "memory",
        "DIMENSIONS": case.dimensions,
        "POLICIES": {
            "EXEMPT_ENDPOINTS": list(case.exempt),
            "TIER_FUNC": (lambda request, identity: tier) if tier else None,
        },
        "IDENTITY": {"ORGANIZATION_FUNC": lambda request: case.org},
    }


@pytest.mark.parametrize("source", ["settings", "database"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_both_sources_resolve_alike(
    settings: Any, rf: RequestFactory, caplog: pytest.LogCaptureFixture, source: str, case: Case
) -> None:
    (use_settings if source == "settings" else use_database)(settings, case)
    engine.reset()
    request = rf.generic(case.method, "/", REMOTE_ADDR="198.51.100.7")
    identity = identify(request, endpoint=case.endpoint, auth="sk_case" if case.key else None)
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        checks = engine.get_policy_source().checks_for(request, identity)
    resolved = [(c.policy.name, c.subject.kind, c.cost, c.policy.capacity) for c in checks]
    assert resolved == case.expected
    unknown_tier = case.tier_func is not None and case.tier_func not in TIERS
    assert any("not an enabled tier" in r.getMessage() for r in caplog.records) is unknown_tier


def test_a_request_like_an_earlier_one_resolves_as_the_function_says_now(settings: Any, rf: RequestFactory) -> None:
    """Without assignments or overrides, a request is resolved from what decides it (the rule, the
    caller's tier, its subjects), kept by the snapshot. ``POLICIES['TIER_FUNC']`` is still asked
    every time: the same caller moved to another tier gets that tier's checks at once, and a
    caller of another organisation or address gets its own subjects."""
    placed = {"tier": "pro"}
    settings.RATELIMITS = {
        "BACKEND": "memory",
        "TIERS": TIERS,
        "POLICIES": {"DEFAULT_TIERS": DEFAULTS, "TIER_FUNC": lambda request, identity: placed["tier"]},
        "DIMENSIONS": {"org": {"rate": "50/s"}, "ip": {"rate": "70/s"}},
        "IDENTITY": {"ORGANIZATION_FUNC": lambda request: request.META.get("HTTP_X_ORG")},
    }
    engine.reset()
    source = engine.get_policy_source()

    def resolved(address: str, org: str | None = None) -> list[tuple[str, str, str]]:
        request = rf.get("/", REMOTE_ADDR=address, **({"HTTP_X_ORG": org} if org else {}))
        identity = identify(request, endpoint="customers", auth="sk_case")
        return [(c.policy.name, c.subject.kind, c.subject.value) for c in source.checks_for(request, identity)]

    first = resolved("198.51.100.7", "acme")
    assert first == [
        ("tier:pro", "api_key", "sk_case"),
        ("org", "org", "acme"),
        ("ip", "ip", "198.51.100.7"),
    ]
    assert resolved("198.51.100.7", "acme") == first
    assert source.snapshot().resolved  # kept
    placed["tier"] = "basic"
    assert [name for name, _, _ in resolved("198.51.100.7", "acme")] == [
        "tier:basic",
        "tier:basic:quota",
        "tier:basic:concurrency",
        "org",
        "ip",
    ]
    other = resolved("203.0.113.9", "globex")
    assert other[-2:] == [("org", "org", "globex"), ("ip", "ip", "203.0.113.9")]
    assert resolved("198.51.100.7") == [  # no organisation: no check of one
        ("tier:basic", "api_key", "sk_case"),
        ("tier:basic:quota", "api_key", "sk_case"),
        ("tier:basic:concurrency", "api_key", "sk_case"),
        ("ip", "ip", "198.51.100.7"),
    ]


def test_requests_that_resolve_alike_share_one_kept_list_of_checks(settings: Any, rf: RequestFactory) -> None:
    """A resolution the snapshot keeps is handed out as one object (a ``KeptChecks``), which what is
    made of it (a usage row, a backend's compiled call) is kept under: alike requests get that very
    object, another caller its own, and a new snapshot (the settings changed) new ones. What it
    says is what the pairs of :func:`resolve` say."""
    settings.RATELIMITS = {
        "BACKEND": "memory",
        "TIERS": TIERS,
        "POLICIES": {"DEFAULT_TIERS": DEFAULTS},
        "DIMENSIONS": {"ip": {"rate": "70/s"}},
    }
    engine.reset()
    source = engine.get_policy_source()

    def checks_of(address: str) -> Any:
        request = rf.get("/", REMOTE_ADDR=address)
        return source.checks_for(request, identify(request, endpoint="customers", auth="sk_case"))

    first = checks_of("198.51.100.7")
    assert type(first) is KeptChecks
    assert checks_of("198.51.100.7") is first
    other = checks_of("203.0.113.9")
    assert type(other) is KeptChecks and other is not first
    assert [c.subject.value for c in other][-1] == "203.0.113.9"
    assert list(other)[:-1] == list(first)[:-1]  # the same caller's own checks
    request = rf.get("/", REMOTE_ADDR="198.51.100.7")
    pairs = resolve(source.snapshot(), request, identify(request, endpoint="customers", auth="sk_case"))
    assert [check for check, _ in pairs] == list(first)
    settings.RATELIMITS = {**settings.RATELIMITS, "DIMENSIONS": {}}
    engine.reset()
    source = engine.get_policy_source()
    again = checks_of("198.51.100.7")
    assert again is not first and list(again) == [c for c in first if c.policy.name != "ip"]


def test_a_kept_resolutions_usage_row_is_made_once_and_dated_per_request(
    settings: Any, rf: RequestFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usage of a request whose checks the snapshot keeps is its row, made once, dated by the
    minute each request is made in (the clock moved across a minute's end between two requests),
    with its caller's label noted by each request (the labels forget what they wrote once an hour):
    what the same checks made afresh give."""
    settings.RATELIMITS = {"BACKEND": "memory", "TIERS": TIERS, "POLICIES": {"DEFAULT_TIERS": DEFAULTS}}
    engine.reset()
    request = rf.get("/", REMOTE_ADDR="198.51.100.7")
    identity = identify(request, endpoint="customers", auth="sk_case")
    kept = engine.get_policy_source().checks_for(request, identity)
    assert type(kept) is KeptChecks
    labels = subject_labels()
    start = (int(time.time() // 60) + 1) * 60 - 0.5  # half a second before a minute ends
    for minute_late in (0, 1):
        monkeypatch.setattr(time, "time", lambda at=start + 60 * minute_late: at)
        labels.take()
        usage = usage_of(identity, kept)
        assert identity.caller.digest in labels.pending  # noted by this request, from its kept row
        assert usage.minute == int(start // 60) + minute_late
        assert usage == usage_of(identity, list(kept))  # what the checks made afresh give
        assert usage.field.startswith(caller_rows(identity.caller)) and '"basic"' in usage.field


@pytest.mark.parametrize(
    "config",
    [
        {"ENDPOINTS": {"customers": {"endpoint_rate": {"rate": "20000/s", "shards": 16}}}},
        {"DIMENSIONS": {"ip": {"rate": "20000/s", "shards": 16}}},
    ],
    ids=["endpoint-wide", "dimension"],
)
def test_a_sharded_budget_is_picked_per_request_however_alike_the_requests(
    settings: Any, rf: RequestFactory, config: dict[str, Any]
) -> None:
    """What a request resolved to is not kept when it holds a shard: each request is decided by a
    shard picked at random, or one caller would get one sixteenth of the budget and one key all
    the load."""
    settings.RATELIMITS = {"BACKEND": "memory", "TIERS": TIERS, "POLICIES": {"DEFAULT_TIERS": DEFAULTS}, **config}
    engine.reset()
    source = engine.get_policy_source()
    request = rf.get("/", REMOTE_ADDR="198.51.100.7")
    identity = identify(request, endpoint="customers", auth="sk_case")
    shards = set()
    for _ in range(40):
        checks = source.checks_for(request, identity)
        shards |= {check.subject.value for check in checks if check.policy.is_shard}
    assert len(shards) > 1  # 40 picks of 16 shards all alike: 16 ** -39
    assert not source.snapshot().resolved
    assert type(checks) is list  # made for this request alone: nothing is kept under it
