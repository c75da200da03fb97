"""Priority load shedding: the fleet's in-flight limits per class (Redis) and the worker shedder (no Redis).

Real threads hold requests inside views until the test opens a gate, so the number in flight
is exact when the test looks. Every wait is bounded; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from rest_framework.response import Response
from rest_framework.test import APIClient

from project.payments.models import Charge
from project.payments.views import ReportExport
from ratelimits import engine

from .factories import ApiKeyFactory
from .support import clients
from .support.bursts import Burst, in_flight
from .support.gate import Gate
from .support.redis_server import RedisServer
from .support.settings import merged

REDUCED_CAPACITY = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"


def client_for(raw: str | None = None, ip: str = "198.51.100.90") -> APIClient:
    return clients.client_for(raw, ip)  # every caller here from one address unless told otherwise


def assert_shed(response: Any) -> dict[str, Any]:
    """A 503 shed response: problem+json, temporary-reduced-capacity, Retry-After."""
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(response.content)
    assert body["status"] == 503
    assert body["type"] == REDUCED_CAPACITY
    assert 0 < body["retry_after_ms"] <= 1000
    assert response["Retry-After"] == "1"
    return body


# -- e. fleet shedding ---------------------------------------------------------------------------

CAPACITY = 10
LOW_LIMIT = 6  # 60 % of 10: low priority is shed from 6 requests in flight
EXPORTERS = 12
EXPORT_COST = 10
BURST = 100


@pytest.fixture
def fleet(settings: Any, use_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, gate: Gate) -> Gate:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            # A slow refill (36 s per token): token counts read later in the test are exact.
            "TIERS": {"free": {"rate": "100/h", "burst": BURST}, "anon": {"rate": "1000/s", "burst": 1000}},
            "POLICIES": {
                "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
                "TIER_FUNC": "project.payments.auth.tier_of",
            },
            "SHEDDING": {"FLEET_CAPACITY": CAPACITY, "THRESHOLDS": {"low": 60, "normal": 75, "high": 90}},
            "ENDPOINTS": {
                "reports.export": {"cost": EXPORT_COST, "priority": "low"},
                "charges": {"priority": "critical"},
                "customers": {"priority": "normal"},
            },
        },
    )
    engine.reset()
    # The export is slow: here it stays in flight until the test opens the gate.
    export = ReportExport.post

    def held_export(self: ReportExport, request: Any) -> Response:
        if not gate.pass_through():
            return Response({"detail": "the gate never opened"}, status=504)
        return export(self, request)

    monkeypatch.setattr(ReportExport, "post", held_export)
    monkeypatch.setattr(ReportExport, "duration", 0)
    return gate


def fleet_in_flight(priority: str = "low") -> int:
    check = engine.get_policy_source().snapshot().fleet[priority]
    return in_flight(engine.get_limiter().backend, check)


def tier_tokens(raw: str) -> int:
    """The caller's tier tokens for an export, as GET /v1/rate_limit reports them (a peek)."""
    body = client_for(raw).get("/v1/rate_limit?endpoint=reports.export").json()
    return int(next(r["remaining"] for r in body["resources"] if r["policy"] == "tier:free"))


@pytest.mark.django_db(transaction=True)  # the request threads read the API keys on their own connections
def test_flood_of_low_priority_exports_is_shed_while_critical_charges_succeed(fleet: Gate) -> None:
    exporters = [f"sk_export_{i:02d}" for i in range(EXPORTERS)]
    for raw in exporters:
        ApiKeyFactory(raw=raw, tier="free")
    ApiKeyFactory(raw="sk_charger", tier="free")
    ApiKeyFactory(raw="sk_export_late", tier="free")
    assert all(tier_tokens(raw) == BURST for raw in exporters)

    flood = Burst()
    for raw in exporters:
        flood.start(raw, lambda raw=raw: client_for(raw).post("/v1/reports/export"))
    settled = fleet.wait_for(lambda g: g.inside == LOW_LIMIT, 10) and flood.wait_answered(EXPORTERS - LOW_LIMIT, 10)
    assert settled, f"{fleet.inside} exports in flight, answered: {flood.statuses()} {flood.errors}"
    assert not flood.errors, flood.errors
    # Saturated at the low threshold: exactly 6 exports in flight, every other one shed.
    assert fleet.inside == LOW_LIMIT and fleet.entered == LOW_LIMIT
    assert flood.statuses() == [503] * (EXPORTERS - LOW_LIMIT)
    for answer in flood.answers:
        assert_shed(answer.response)
    assert fleet_in_flight() == LOW_LIMIT
    shed = sorted(flood.by_label())
    admitted = sorted(set(exporters) - set(shed))

    # Critical charges keep succeeding on the saturated fleet (each takes a fleet slot too).
    charger = client_for("sk_charger")
    charges = [charger.post("/v1/charges", {"amount": 100 + i, "currency": "eur"}, format="json") for i in range(10)]
    assert [r.status_code for r in charges] == [201] * 10
    assert Charge.objects.filter(owner__prefix="sk_charger"[:12]).count() == 10
    # Normal priority is shed only from 75 % (7 in flight): it still gets in.
    assert charger.get("/v1/customers").status_code == 200
    # Low priority is still shed while the flood holds the fleet.
    assert_shed(client_for("sk_export_late").post("/v1/reports/export"))
    assert fleet_in_flight() == LOW_LIMIT

    # Shed requests consumed nothing: their callers' tokens are untouched; admitted ones paid.
    assert {raw: tier_tokens(raw) for raw in shed} == dict.fromkeys(shed, BURST)
    assert tier_tokens("sk_export_late") == BURST
    assert {raw: tier_tokens(raw) for raw in admitted} == dict.fromkeys(admitted, BURST - EXPORT_COST)

    fleet.open()
    flood.join()
    answers = flood.by_label()
    assert [answers[raw].status for raw in admitted] == [200] * LOW_LIMIT
    assert all(answers[raw].json() == {"rows": 0, "format": "csv"} for raw in admitted)
    assert fleet_in_flight() == 0  # every export's slot came back when its response was closed
    # Capacity back: low priority is admitted again.
    late = client_for("sk_export_late").post("/v1/reports/export")
    assert late.status_code == 200
    assert fleet_in_flight() == 0
    print(f"\nfleet: {LOW_LIMIT} exports in flight, {len(shed) + 1} shed with 503, 10 charges 201 meanwhile")


# -- g. 429 beats 503 ----------------------------------------------------------------------------


@pytest.fixture
def small_fleet(settings: Any, use_redis: RedisServer, gate: Gate) -> Gate:
    """A fleet of 2 where low priority is shed from 1 request in flight; anonymous callers by IP."""
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"anon": {"rate": "1/h", "burst": 1}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}},
            "SHEDDING": {"FLEET_CAPACITY": 2, "THRESHOLDS": {"low": 50, "normal": 100, "high": 100}},
            "ENDPOINTS": {"GET gated": {"priority": "low"}, "POST gated": {"priority": "critical"}},
        },
    )
    engine.reset()
    return gate


def test_caller_over_its_own_limit_on_a_shed_class_gets_429(small_fleet: Gate) -> None:
    gate = small_fleet
    holder, spent, fresh = (client_for(ip=f"198.51.100.{n}") for n in (71, 72, 73))
    assert spent.get("/t/ping").status_code == 200  # its only token, on a class that is not shed

    burst = Burst()
    burst.start("holder", lambda: holder.get("/t/gated"))
    assert gate.wait_inside(1, 10), burst.errors
    assert fleet_in_flight() == 1  # the low class is now full

    over = spent.get("/t/gated")  # over its own limit AND on a shed class
    assert over.status_code == 429
    body = json.loads(over.content)
    assert body["type"].endswith("#quota-exceeded")
    assert "tier:anon" in [v["policy"] for v in body["violations"]]
    assert int(over["Retry-After"]) > 1  # the caller's own wait (~1 h), not the shedder's 1 s

    assert_shed(fresh.get("/t/gated"))  # a caller with tokens left is shed instead...
    assert fresh.get("/t/ping").status_code == 200  # ...and kept its token for when it is admitted
    assert fresh.get("/t/ping").status_code == 429

    gate.open()
    burst.join()
    assert burst.statuses() == [200]
    assert fleet_in_flight() == 0


def test_critical_requests_are_never_shed_but_take_fleet_capacity(small_fleet: Gate) -> None:
    gate = small_fleet
    burst = Burst()
    for n in range(3):  # beyond the fleet's capacity of 2: critical is never shed
        burst.start(f"critical{n}", lambda n=n: client_for(ip=f"198.51.100.{80 + n}").post("/t/gated"))
    assert gate.wait_inside(3, 10), burst.errors
    assert fleet_in_flight("critical") == 3
    # They hold fleet slots like any request: the low class, empty itself, is shed because of them.
    assert_shed(client_for(ip="198.51.100.89").get("/t/gated"))
    gate.open()
    burst.join()
    assert burst.statuses() == [200] * 3
    assert fleet_in_flight("critical") == 0
    assert client_for(ip="198.51.100.89").get("/t/gated").status_code == 200  # its token was kept


@pytest.fixture
def shared_fleet(settings: Any, use_redis: RedisServer, gate: Gate) -> Gate:
    """A fleet of 4 that sheds nothing before it is full; one tenant may hold half of it."""
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"anon": {"rate": "1000/s", "burst": 1000}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}},
            "SHEDDING": {
                "FLEET_CAPACITY": 4,
                "TENANT_SHARE": 50,
                "THRESHOLDS": {"low": 100, "normal": 100, "high": 100},
            },
            "ENDPOINTS": {"POST gated": {"priority": "normal"}},
        },
    )
    engine.reset()
    return gate


def test_one_tenant_holds_at_most_its_share_of_the_fleet_and_is_limited_not_shed(shared_fleet: Gate) -> None:
    gate = shared_fleet
    hog, other = "198.51.100.61", "198.51.100.62"
    burst = Burst()
    for n in range(2):
        burst.start(f"hog{n}", lambda: client_for(ip=hog).post("/t/gated"))
    assert gate.wait_inside(2, 10), burst.errors
    # Its share is full: its next request is its own 429 (concurrency), with the slots' retry.
    over = client_for(ip=hog).post("/t/gated")
    assert over.status_code == 429, over.content
    body = json.loads(over.content)
    assert [v["policy"] for v in body["violations"]] == ["fleet-share"]
    assert over["Retry-After"] == "1"
    # Another tenant still has the rest of the fleet: admitted, not shed.
    burst.start("other", lambda: client_for(ip=other).post("/t/gated"))
    assert gate.wait_inside(3, 10), burst.errors
    assert fleet_in_flight("normal") == 3
    gate.open()
    burst.join()
    assert burst.statuses() == [200] * 3
    assert fleet_in_flight("normal") == 0
    assert client_for(ip=hog).post("/t/gated").status_code == 200  # its slots came back with its responses


# -- f. the worker shedder, with Redis gone ------------------------------------------------------

WORKER_CAPACITY = 4  # low shed from 2 in flight (60 %), normal and high from 3 (75 %, 90 %)


@pytest.fixture
def killed_redis(settings: Any, own_redis: RedisServer) -> Iterator[RedisServer]:
    """RATELIMITS on a redis-server of this test's own, which the test kills (stopped by PID after)."""
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "REDIS": {"URL": own_redis.url, "SOCKET_TIMEOUT": "100ms", "CONNECT_TIMEOUT": "100ms"},
        "FAILURE": {"DEFAULT_MODE": "open"},
        "TIERS": {"anon": {"rate": "1000/s", "burst": 1000}},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}},
        "SHEDDING": {"WORKER_CAPACITY": WORKER_CAPACITY, "THRESHOLDS": {"low": 60, "normal": 75, "high": 90}},
        "ENDPOINTS": {"GET gated": {"priority": "low"}, "POST gated": {"priority": "critical"}},
    }
    engine.reset()
    yield own_redis


def test_worker_shedder_sheds_low_priority_without_redis(killed_redis: RedisServer, gate: Gate) -> None:
    client = client_for()
    assert client.get("/t/ping").status_code == 200  # Redis up: an ordinary, undegraded request
    shedder = engine.get_worker_shedder()
    assert shedder is not None and shedder.in_flight == 0

    killed_redis.kill()
    assert killed_redis.process is not None and killed_redis.process.poll() is not None

    held = Burst()
    for i in range(2):
        held.start(f"low{i}", lambda: client_for().get("/t/gated"))
    assert gate.wait_inside(2, 10), held.errors
    assert shedder.in_flight == 2

    # Low priority beyond its threshold: shed by this worker alone (Redis is not asked).
    for _ in range(3):
        body = assert_shed(client.get("/t/gated"))
        assert "sheds this endpoint's priority class" in body["detail"]
    # Critical requests still pass, even beyond the worker's capacity...
    for i in range(3):
        held.start(f"critical{i}", lambda: client_for().post("/t/gated"))
    assert gate.wait_inside(5, 10), held.errors
    assert shedder.in_flight == 5
    # ...while normal priority (75 %: 3 in flight) is shed as well now.
    assert_shed(client.get("/t/ping"))
    assert shedder.in_flight == 5  # shed requests are never counted in

    gate.open()
    held.join()
    assert held.statuses() == [200] * 5
    assert all(a.response["X-RateLimit-Degraded"] == "1" for a in held.answers)  # admitted without Redis
    assert shedder.in_flight == 0
    # Nothing in flight: low priority gets in again, still without Redis.
    after = client.get("/t/gated")
    assert after.status_code == 200 and after["X-RateLimit-Degraded"] == "1"
    assert shedder.in_flight == 0
    assert engine.get_limiter().breaker.state == "open"


class TierLookupFailed(Exception):
    """What the ``POLICIES['TIER_FUNC']`` below raises: the host's own bug, after the shedder counted the request in."""


def failing_tier_func(request: Any, identity: Any) -> str:
    raise TierLookupFailed("the tier lookup failed")


def test_worker_in_flight_count_survives_a_failing_request(killed_redis: RedisServer, settings: Any) -> None:
    """A request that fails after the shedder counted it in is counted out again."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"TIER_FUNC": failing_tier_func}})
    engine.reset()
    shedder = engine.get_worker_shedder()
    assert shedder is not None
    client = client_for()
    for _ in range(WORKER_CAPACITY + 1):
        with pytest.raises(TierLookupFailed, match="the tier lookup failed"):
            client.get("/t/ping")
        assert shedder.in_flight == 0


def test_worker_shedder_counts_out_admitted_and_limited_requests(killed_redis: RedisServer, settings: Any) -> None:
    """Admitted and rate-limited (429) requests all leave the in-flight count at zero (Redis up)."""
    settings.RATELIMITS = {**settings.RATELIMITS, "TIERS": {"anon": {"rate": "5/h", "burst": 5}}}
    engine.reset()
    shedder = engine.get_worker_shedder()
    assert shedder is not None
    client = client_for()
    statuses = []
    for _ in range(3 * WORKER_CAPACITY):
        statuses.append(client.get("/t/ping").status_code)
        assert shedder.in_flight == 0
    assert statuses == [200] * 5 + [429] * (3 * WORKER_CAPACITY - 5)  # never shed: one at a time
