"""Every check says truthfully where it came from, with either policy source.

The finding: when ``POLICIES['TIER_FUNC']`` placed a caller on *free*, the effective-policy page
said "default tier for authenticated callers", while the fleet's default was *standard*: the page
that exists to answer "why was this customer limited?" named the wrong reason. Now each origin
names what placed the check: the function (and the tier it returned), a subject assignment, an
override, the default for anonymous or authenticated callers (and where that default is set), a
setting. A table of cases, each run against the settings source and the database source set up
alike; ``GET /v1/rate_limit`` gives each check's origin kind too.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import RequestFactory
from django.utils import timezone

from project.payments.models import ApiKey
from ratelimits import engine
from ratelimits.identity import identify
from ratelimits.models import FleetSettings, Override, SubjectAssignment, Tier

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.settings import merged

pytestmark = pytest.mark.django_db

TIERS = {"anon": "10/s", "member": "20/s", "gold": "50/s"}
COMMON = {
    "POLICIES": {"TIER_FUNC": "project.payments.auth.tier_of"},
    "DIMENSIONS": {"ip": {"rate": "300/m", "burst": 300}},
}
DEFAULTS = "RATELIMITS['POLICIES']['DEFAULT_TIERS']"


@pytest.fixture(params=["settings", "database"])
def source(request: pytest.FixtureRequest, settings: Any) -> str:
    """Anonymous callers on ``anon``, authenticated ones on ``member`` by default; ``gold`` there to be placed on."""
    if request.param == "settings":
        tiers = {name: {"rate": rate, "burst": 1000} for name, rate in TIERS.items()}
        policies = {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "member"}}
        settings.RATELIMITS = merged(merged(settings.RATELIMITS, COMMON), {"TIERS": tiers, "POLICIES": policies})
    else:
        rows = {name: Tier.objects.create(name=name, rate=rate, burst=1000) for name, rate in TIERS.items()}
        FleetSettings.objects.update_or_create(
            pk=1, defaults={"anonymous_tier": rows["anon"], "authenticated_tier": rows["member"]}
        )
        settings.RATELIMITS = merged(merged(settings.RATELIMITS, COMMON), {"POLICIES": {"SOURCE": "database"}})
    engine.reset()
    return str(request.param)


def origins(key: ApiKey | None = None) -> dict[str, tuple[str, str]]:
    """``{policy name: (origin in words, origin kind)}`` for a request from ``key`` (anonymous without)."""
    request = RequestFactory().get("/", REMOTE_ADDR="198.51.100.60")
    request.auth = key  # type: ignore[attr-defined]  # what DRF's authentication sets: TIER_FUNC reads it
    identity = identify(request, endpoint="customers", auth=key, user=None)
    explained = engine.get_policy_source().explain(request, identity)
    return {e.check.policy.name: (e.origin, str(e.kind)) for e in explained}


#: (case, what the settings source says, what the database source says) of the caller's tier check.
DEFAULT_CASES = [
    (
        "anonymous",
        ("tier:anon", f"default tier for anonymous callers ({DEFAULTS})", "settings"),
        ("tier:anon", "default tier for anonymous callers (fleet settings)", "tier"),
    ),
    (
        "authenticated",
        ("tier:member", f"default tier for authenticated callers ({DEFAULTS})", "settings"),
        ("tier:member", "default tier for authenticated callers (fleet settings)", "tier"),
    ),
    (
        "placed by TIER_FUNC",
        ("tier:gold", "RATELIMITS['POLICIES']['TIER_FUNC'] returned 'gold'", "settings"),
        ("tier:gold", "RATELIMITS['POLICIES']['TIER_FUNC'] returned 'gold'", "tier"),
    ),
]


@pytest.mark.parametrize(("case", "from_settings", "from_database"), DEFAULT_CASES, ids=[c[0] for c in DEFAULT_CASES])
def test_each_tier_check_names_what_placed_the_caller(
    source: str, case: str, from_settings: tuple[str, str, str], from_database: tuple[str, str, str]
) -> None:
    key = None if case == "anonymous" else ApiKeyFactory(tier="gold" if "TIER_FUNC" in case else "")
    name, detail, kind = from_settings if source == "settings" else from_database
    found = origins(key)
    assert found[name] == (detail, kind)
    # A static backstop is a setting with either source.
    assert found["ip"] == ("RATELIMITS['DIMENSIONS']['ip']", "settings")


def test_assignments_and_overrides_name_their_rows(source: str) -> None:
    if source == "settings":
        pytest.skip("assignments and overrides are rows of the admin's tables")
    assigned, overridden = ApiKeyFactory(tier="gold"), ApiKeyFactory(tier="gold")
    assignment = SubjectAssignment.objects.create(
        subject_kind="api_key", subject_id=f"ApiKey:{assigned.pk}", tier=Tier.objects.get(name="member")
    )
    override = Override.objects.create(
        subject_kind="api_key",
        subject_id=f"ApiKey:{overridden.pk}",
        rate="5/s",
        burst=5,
        reason="incident 12",
        expires_at=timezone.now() + timedelta(days=1),
    )
    engine.reset()
    # An assignment wins over TIER_FUNC's tier, and says so.
    assert origins(assigned)["tier:member"] == (f"assignment #{assignment.pk} (member)", "assignment")
    # A general override keeps the tier's check, with its own limits: named for the override.
    assert origins(overridden)["tier:gold"] == (f"override #{override.pk}: incident 12", "override")


def test_the_status_api_gives_each_checks_origin_kind(source: str) -> None:
    ApiKeyFactory(raw="sk_origins_gold", tier="gold")
    resources = client_for("sk_origins_gold").get("/v1/rate_limit", {"endpoint": "customers"}).json()["resources"]
    kinds = {r["policy"]: r["origin"] for r in resources}
    assert kinds["tier:gold"] == ("settings" if source == "settings" else "tier")
    assert kinds["ip"] == "settings"
