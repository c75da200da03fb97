"""Values the store can carry: one bound for every policy, and a policy the store cannot decide hurts nobody else.

The finding: an override of ``1/366d`` with a burst of 2**31 - 1 passed the admin, ``full_clean``
and the import; every decision for its subject then failed inside the decide script (the TTL was
out of range), the subject went unlimited, and the failures opened the per-process breaker, so a
fail-closed tier of another caller got 503s. Now such a policy cannot be made, a row written
around the checks is left out when loaded, and a check the script still cannot decide (its key
holds another type) is decided by its own fail mode, without touching the breaker.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.choices import FailMode
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import Override, Tier
from ratelimits.policies.snapshot import OverrideRule, Window
from ratelimits.policies.values import Check, Origin, OriginKind, Policy, concurrency_policy, policy_from_config
from ratelimits.rates import MAX_BURST, MAX_LIMIT, MAX_PERIOD_US, MAX_REFILL_US, Rate, check_burst
from ratelimits.store.portability import PolicyImportError, export_policies, import_policies

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.clock import FakeClock
from .support.redis_server import RedisServer

#: The override the finding saved: a rate the admin accepts, and the largest burst its field holds.
HUGE = {"rate": "1/366d", "burst": 2_147_483_647}


# -- the bound, in one place ---------------------------------------------------------------------


def test_check_burst_names_the_field_and_the_reason() -> None:
    rate = Rate(1, 366 * 86_400_000_000)
    with pytest.raises(ConfigurationError, match=r"^override burst: 2147483647 is too large; .* at most 1,000,000,000"):
        check_burst(rate, HUGE["burst"], field="override burst")
    with pytest.raises(ConfigurationError, match=r"^burst: a burst of 1000 at 1/366d takes 1,003 years to refill"):
        check_burst(rate, 1000)
    with pytest.raises(ConfigurationError, match="at most 1,000,000,000"):
        check_burst(Rate(MAX_LIMIT, 1_000_000), MAX_BURST + 1)
    with pytest.raises(ConfigurationError, match="must be a positive integer"):
        check_burst(rate, 0)
    assert check_burst(Rate(1, 86_400_000_000), 36_500) == 36_500  # a century exactly
    with pytest.raises(ConfigurationError, match="years to refill"):
        check_burst(Rate(1, 86_400_000_000), 36_501)


def test_settings_refuse_a_burst_the_store_cannot_carry() -> None:
    with pytest.raises(ConfigurationError, match=r"TIERS\['gold'\]\['burst'\]: 2147483647 is too large"):
        policy_from_config("gold", HUGE, field="TIERS['gold']", default_fail_mode=FailMode.OPEN)


@pytest.mark.django_db
def test_the_models_refuse_it_by_field() -> None:
    override = Override(
        subject_kind="api_key", subject_id="ApiKey:1", reason="r", expires_at=timezone.now() + timedelta(days=1), **HUGE
    )
    with pytest.raises(ValidationError) as error:
        override.full_clean()
    assert error.value.message_dict["burst"] == ["2147483647 is too large; a burst must be at most 1,000,000,000"]
    with pytest.raises(ValidationError) as error:
        Tier(name="slow", rate="1/366d", burst=1000).full_clean()
    assert "years to refill" in error.value.message_dict["burst"][0]
    with pytest.raises(ValidationError) as error:
        Tier(name="wide", rate="10/s", concurrency=MAX_LIMIT + 1).full_clean()
    assert "at most 1,000,000,000" in error.value.message_dict["concurrency"][0]


@pytest.mark.django_db
def test_the_admin_form_refuses_it(admin_client: Client) -> None:
    add = reverse("admin:ratelimits_override_add")
    form = admin_client.get(add).context["adminform"].form
    expires = timezone.now() + timedelta(days=1)
    data = {name: "" for name in form.fields}
    data.update(
        subject_kind="api_key",
        subject_id="ApiKey:1",
        reason="the finding's override",
        expires_at_0=str(expires.date()),
        expires_at_1="12:00:00",
        enabled="on",
        **HUGE,
    )
    data.pop("expires_at", None)
    response = admin_client.post(add, data)
    assert response.status_code == 200
    assert "at most 1,000,000,000" in response.context["adminform"].form.errors["burst"][0]
    assert not Override.objects.exists()


@pytest.mark.django_db
def test_the_import_refuses_it() -> None:
    document = copy.deepcopy(export_policies())
    expires = (timezone.now() + timedelta(days=1)).isoformat()
    override = {"subject_kind": "api_key", "subject_id": "ApiKey:1", "reason": "r", "expires_at": expires, **HUGE}
    document["overrides"] = [override]
    with pytest.raises(PolicyImportError, match=r"overrides\[0\]\.burst: .*at most 1,000,000,000"):
        import_policies(document, reason="the finding's import")
    assert not Override.objects.exists()


def test_a_multiplier_scales_within_the_bounds() -> None:
    base = Policy("tier", Rate(MAX_LIMIT, 1_000_000), MAX_BURST)
    rule = OverrideRule(1, "", Window(), None, None, 10_000.0, None, False, Origin(OriginKind.OVERRIDE, "o"))
    scaled = rule.apply(base, name="tier", fail_mode=FailMode.OPEN)
    assert scaled is not None and scaled.rate.limit == MAX_LIMIT and scaled.burst == MAX_BURST
    # 1/d with a century of burst, scaled by 2.5: banker's rounding (2 and 91,250) would stretch the refill.
    slow = Policy("slow", Rate(1, 86_400_000_000), 36_500)
    rule = OverrideRule(2, "", Window(), None, None, 2.5, None, False, Origin(OriginKind.OVERRIDE, "o"))
    stretched = rule.apply(slow, name="slow", fail_mode=FailMode.OPEN)
    assert stretched is not None
    assert stretched.burst * stretched.rate.period_us <= MAX_REFILL_US * stretched.rate.limit


# -- any accepted policy decides, on both backends, alike ------------------------------------------

ALGORITHMS = [Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW, Algorithm.CONCURRENCY]


@st.composite
def accepted_policies(draw: st.DrawFn) -> tuple[Policy, int]:
    """A policy as settings, the admin or the import would accept it, anywhere in the accepted ranges, and a cost."""
    algorithm = draw(st.sampled_from(ALGORITHMS))
    limit = draw(st.one_of(st.integers(1, 100), st.integers(1, MAX_LIMIT), st.just(MAX_LIMIT)))
    if algorithm is Algorithm.CONCURRENCY:
        policy = concurrency_policy("p", limit, fail_mode=FailMode.OPEN)
    else:
        period_us = draw(st.one_of(st.integers(1, 10**7), st.integers(1, MAX_PERIOD_US), st.just(MAX_PERIOD_US)))
        most = min(MAX_BURST, MAX_REFILL_US * limit // period_us)
        assume(most >= 1)
        burst = draw(st.one_of(st.integers(1, most), st.just(most)))
        policy = Policy("p", Rate(limit, period_us), burst, algorithm)
    multiplier = draw(st.one_of(st.none(), st.floats(0.001, 10_000)))
    if multiplier is not None and not policy.holds_slots:
        origin = Origin(OriginKind.OVERRIDE, "o")
        scaled = OverrideRule(1, "", Window(), None, None, multiplier, None, False, origin).apply(
            policy, name="p", fail_mode=FailMode.OPEN
        )
        assert scaled is not None
        policy = scaled
    cost = draw(st.one_of(st.just(1), st.integers(1, policy.capacity), st.just(policy.capacity)))
    return policy, cost


@pytest.fixture(scope="module")
def store(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = make_client(redis_server.url, 2.0, 2.0)
    yield client
    client.flushall()


@hypothesis_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy_and_cost=accepted_policies(), waits=st.lists(st.integers(0, 10**15), min_size=1, max_size=4))
def test_any_accepted_policy_decides_without_error_alike(
    store: redis.Redis, policy_and_cost: tuple[Policy, int], waits: list[int]
) -> None:
    """Against the real Redis, now near the year 2026 and up to 30 years later: never an error, and
    the memory backend agrees to the microsecond."""
    policy, cost = policy_and_cost
    store.flushall()
    clock = FakeClock(1_796_000_000_000_000)
    memory, central = MemoryBackend(clock=clock), RedisBackend(store, clock=clock)
    check = Check(policy, Subject(SubjectKind.API_KEY, "ApiKey:1"), cost)
    for wait in waits:
        clock.advance(wait)
        for _ in range(3):
            expected, got = memory.decide([check]), central.decide([check])
            assert got.results == expected.results
            for decision, backend in ((expected, memory), (got, central)):
                if decision.slot is not None:
                    backend.release(decision.slot, decision.slot_keys)


# -- a row written around the checks, through the whole stack --------------------------------------


def configure(settings: Any, own_redis: RedisServer) -> None:
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "REDIS": {"URL": own_redis.url},
        "POLICIES": {"SOURCE": "database", "TIER_FUNC": "project.payments.auth.tier_of"},
        "FAILURE": {"BREAKER_MIN_CALLS": 5},
    }
    engine.reset()


@pytest.mark.django_db(transaction=True)
def test_the_findings_override_saved_around_the_checks_hurts_nobody(
    settings: Any, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    Tier.objects.create(name="metered", rate="3/m")
    Tier.objects.create(name="strict", rate="100/s", burst=100, fail_mode="closed")
    bad = ApiKeyFactory(raw="sk_bounds_bad", tier="metered")
    ApiKeyFactory(raw="sk_bounds_good", tier="strict")
    expires = timezone.now() + timedelta(days=1)
    # bulk_create skips full_clean: a row as a script or an old release might have written it.
    Override.objects.bulk_create(
        [Override(subject_kind="api_key", subject_id=f"ApiKey:{bad.pk}", reason="r", expires_at=expires, **HUGE)]
    )
    configure(settings, own_redis)
    logger = logging.getLogger("ratelimits")
    logger.addHandler(caplog.handler)
    try:
        statuses = [client_for("sk_bounds_bad", "198.51.100.1").get("/v1/customers").status_code for _ in range(10)]
        charge = client_for("sk_bounds_good", "198.51.100.2")
        good = [charge.post("/v1/charges", {"amount": 1}).status_code for _ in range(60)]
    finally:
        logger.removeHandler(caplog.handler)
    # The bad override is left out: the caller is held to its tier, not unlimited.
    assert statuses == [200] * 3 + [429] * 7
    assert good == [201] * 60
    assert engine.get_limiter().breaker.state == "closed"
    assert engine.get_limiter().degraded_count == 0
    assert any("override #" in r.getMessage() and "too large" in r.getMessage() for r in caplog.records)


# -- a check the script cannot decide: its own fail mode, no breaker, nobody else -------------------


def corrupt(own_redis: RedisServer, tier: str, value: str) -> None:
    """Put a string where ``value``'s API key holds its in-flight slots (a sorted set): a key of another type.

    (A string state of another type is no failure: ``MGET`` reads it as none, and it is overwritten.)
    """
    concurrency = next(p for p in engine.get_policy_source().snapshot().tiers[tier] if p.holds_slots)
    key = Check(concurrency, Subject(SubjectKind.API_KEY, value)).key("rl")
    own_redis.client().set(key, "not a sorted set")


@pytest.mark.django_db(transaction=True)
def test_a_check_the_store_cannot_decide_goes_by_its_fail_mode_alone(
    settings: Any, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "REDIS": {"URL": own_redis.url},
        "TIERS": {
            "open": {"rate": "100/s", "burst": 100, "concurrency": 5},
            "closed": {"rate": "100/s", "burst": 100, "concurrency": 5, "fail_mode": "closed"},
            "anon": {"rate": "100/s"},
        },
        "POLICIES": {
            "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "open"},
            "TIER_FUNC": "project.payments.auth.tier_of",
        },
        "DIMENSIONS": {"ip": {"rate": "5/m"}},
        "FAILURE": {"BREAKER_MIN_CALLS": 5},
    }
    engine.reset()
    opened = ApiKeyFactory(raw="sk_corrupt_open", tier="open")
    closed = ApiKeyFactory(raw="sk_corrupt_closed", tier="closed")
    ApiKeyFactory(raw="sk_healthy_closed", tier="closed")
    assert client_for("sk_corrupt_open", "198.51.100.1").get("/v1/customers").status_code == 200
    assert client_for("sk_corrupt_closed", "198.51.100.2").get("/v1/customers").status_code == 200
    corrupt(own_redis, "open", f"ApiKey:{opened.pk}")
    corrupt(own_redis, "closed", f"ApiKey:{closed.pk}")

    logger = logging.getLogger("ratelimits")
    logger.addHandler(caplog.handler)
    try:
        # Fails open: the broken in-flight check is left out; the tier's rate and the IP's 5/m
        # (1 spent above) still apply.
        opened_hits = [client_for("sk_corrupt_open", "198.51.100.1").get("/v1/customers") for _ in range(8)]
        # Fails closed: 503 for this caller only, with the usual contract.
        closed_hits = [client_for("sk_corrupt_closed", "198.51.100.2").get("/v1/customers") for _ in range(5)]
        healthy = [
            client_for("sk_healthy_closed", f"198.51.100.{10 + i // 5}").get("/v1/customers").status_code
            for i in range(60)
        ]
    finally:
        logger.removeHandler(caplog.handler)
    assert [hit.status_code for hit in opened_hits] == [200] * 4 + [429] * 4
    assert opened_hits[-1].json()["violated-policies"] == ["ip"]
    assert {hit.status_code for hit in closed_hits} == {503}
    assert all(int(hit["Retry-After"]) >= 1 for hit in closed_hits)
    assert healthy == [200] * 60
    limiter = engine.get_limiter()
    assert limiter.breaker.state == "closed"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "policy error" in r.getMessage()]
    assert len(errors) == 2 and all("could not decide" in message for message in errors)
    # The open caller's last three 429s came from memory (the IP's denial): no call to degrade.
    assert limiter.degraded_count == 5 + 5
