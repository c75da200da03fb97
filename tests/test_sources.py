"""DatabasePolicySource: resolution from the admin's tables, expiry, shadow, reloads and zero queries."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from project.payments.models import ApiKey
from ratelimits import engine
from ratelimits._process import ProcessWide
from ratelimits.backends.memory import MemoryBackend
from ratelimits.decisions import Decision, Verdict
from ratelimits.identity import identify
from ratelimits.models import Override, PolicyVersion, Tier
from ratelimits.policies import Explained
from ratelimits.policies import source as policy_source
from ratelimits.store.database import DatabasePolicySource
from ratelimits.store.versioning import bump_policy_version

from .factories import (
    ApiKeyFactory,
    EndpointPolicyFactory,
    FleetSettingsFactory,
    OverrideFactory,
    SubjectAssignmentFactory,
    TierFactory,
    UserFactory,
)
from .support.clients import client_for
from .support.settings import merged

pytestmark = pytest.mark.django_db

DB_SOURCE = "database"
CaptureCallbacks = Callable[..., Any]
Configure = Callable[..., DatabasePolicySource]


@pytest.fixture
def configure(settings: Any) -> Configure:
    """Switch RATELIMITS to the database source (plus ``extra`` keys); returns the process's source."""

    def apply(**extra: Any) -> DatabasePolicySource:
        with_database = {
            "POLICIES": {"SOURCE": DB_SOURCE},
            "IDENTITY": {"ORGANIZATION_FUNC": "project.payments.auth.organization_of"},
        }
        settings.RATELIMITS = merged(merged(settings.RATELIMITS, with_database), extra)
        source = engine.get_policy_source()
        assert isinstance(source, DatabasePolicySource)
        return source

    return apply


@pytest.fixture
def source(configure: Configure) -> DatabasePolicySource:
    return configure()


def explain(
    source: DatabasePolicySource,
    *,
    key: ApiKey | None = None,
    user: Any = None,
    ip: str = "198.51.100.1",
    endpoint: str = "customers",
    method: str = "GET",
    now: Any = None,
) -> list[Explained]:
    """What the source says for a request from ``key``/``user``/``ip`` to ``endpoint``."""
    request = RequestFactory().generic(method, "/", REMOTE_ADDR=ip)
    request.auth = key  # type: ignore[attr-defined]  # what DRF's authentication sets: POLICIES['TIER_FUNC'] reads it
    identity = identify(request, endpoint=endpoint, auth=key, user=user)
    return source.explain(request, identity, now=now)


def checks(explained: list[Explained]) -> set[tuple[str, str]]:
    """``{(policy name, subject kind)}``."""
    return {(e.check.policy.name, e.check.subject.kind) for e in explained}


def by_name(explained: list[Explained]) -> dict[str, Explained]:
    return {e.check.policy.name: e for e in explained}


def limits(explained: Explained) -> tuple[str, int, int]:
    """``("100/s", burst, cost)`` of one check."""
    check = explained.check
    return str(check.policy.rate), check.policy.burst, check.cost


def key_subject(key: ApiKey) -> str:
    return f"ApiKey:{key.pk}"  # ratelimits.identity.default_api_key


def tier(name: str) -> Tier:
    return Tier.objects.get(name=name)


# -- which tier ----------------------------------------------------------------------------------


def test_fleet_default_tiers(source: DatabasePolicySource) -> None:
    anonymous = explain(source)
    assert checks(anonymous) == {("tier:anonymous", "ip")}
    assert anonymous[0].origin == "default tier for anonymous callers (fleet settings)"
    assert limits(anonymous[0]) == ("10/s", 20, 1)
    # No POLICIES['TIER_FUNC']: the key's own field is ignored.
    keyed = explain(source, key=ApiKeyFactory(tier="enterprise"))
    assert checks(keyed) == {("tier:standard", "api_key")}
    assert keyed[0].origin == "default tier for authenticated callers (fleet settings)"
    assert checks(explain(source, user=UserFactory())) == {("tier:standard", "user")}


def test_fleet_settings_change_is_picked_up(
    source: DatabasePolicySource, django_capture_on_commit_callbacks: CaptureCallbacks
) -> None:
    key = ApiKeyFactory()
    assert checks(explain(source, key=key)) == {("tier:standard", "api_key")}
    with django_capture_on_commit_callbacks(execute=True):
        FleetSettingsFactory(authenticated_tier=tier("enterprise"), anonymous_tier=tier("free"))
    assert checks(explain(source, key=key)) == {("tier:enterprise", "api_key")}
    assert checks(explain(source)) == {("tier:free", "ip"), ("tier:free:quota", "ip")}


def test_without_fleet_tiers_the_settings_defaults_apply_if_they_name_a_tier(configure: Configure) -> None:
    FleetSettingsFactory(anonymous_tier=None, authenticated_tier=None)
    source = configure(POLICIES={"DEFAULT_TIERS": {"anonymous": "free", "authenticated": "no-such-tier"}})
    assert checks(explain(source)) == {("tier:free", "ip"), ("tier:free:quota", "ip")}
    assert explain(source, key=ApiKeyFactory()) == []  # nothing known to place it in


def test_tier_func_places_callers_without_an_assignment(configure: Configure) -> None:
    source = configure(POLICIES={"TIER_FUNC": "project.payments.auth.tier_of"})
    TierFactory(name="retired", rate="1/s", enabled=False)
    explained = explain(source, key=ApiKeyFactory(tier="enterprise"))
    assert checks(explained) == {("tier:enterprise", "api_key")}
    # Named for what placed it, not the default it stands in for (the finding: "default tier" said of free).
    assert explained[0].origin == "RATELIMITS['POLICIES']['TIER_FUNC'] returned 'enterprise'"
    assert explained[0].kind == "tier"  # edited in the tiers table
    assert limits(explained[0]) == ("1000/s", 2000, 1)
    # A name the tables do not know, or a disabled tier: the fleet default instead.
    assert checks(explain(source, key=ApiKeyFactory(tier="no-such-tier"))) == {("tier:standard", "api_key")}
    assert checks(explain(source, key=ApiKeyFactory(tier="retired"))) == {("tier:standard", "api_key")}
    assert checks(explain(source)) == {("tier:anonymous", "ip")}  # tier_of: None for anonymous callers


def test_api_key_assignment_beats_tier_func(configure: Configure) -> None:
    source = configure(POLICIES={"TIER_FUNC": "project.payments.auth.tier_of"})
    key = ApiKeyFactory(tier="free")
    assignment = SubjectAssignmentFactory(subject_id=key_subject(key), tier=tier("enterprise"))
    SubjectAssignmentFactory(subject_id="ApiKey:999999999", tier=tier("anonymous"))  # someone else's
    explained = explain(source, key=key)
    assert checks(explained) == {("tier:enterprise", "api_key")}
    assert explained[0].origin == f"assignment #{assignment.pk} (enterprise)"


def test_user_assignment(source: DatabasePolicySource) -> None:
    user = UserFactory()
    SubjectAssignmentFactory(subject_kind="user", subject_id=str(user.pk), tier=tier("free"))
    explained = by_name(explain(source, user=user))
    assert set(explained) == {"tier:free", "tier:free:quota"}
    assert limits(explained["tier:free:quota"]) == ("100000/d", 100000, 1)
    assert {e.check.subject.kind for e in explained.values()} == {"user"}
    assert checks(explain(source, user=UserFactory())) == {("tier:standard", "user")}


def test_organisation_assignment_limits_the_organisation_as_a_whole(source: DatabasePolicySource) -> None:
    SubjectAssignmentFactory(subject_kind="org", subject_id="acme", tier=tier("enterprise"))
    explained = explain(source, key=ApiKeyFactory(organization="acme"))
    assert checks(explained) == {("tier:enterprise", "org"), ("tier:standard", "api_key")}
    assert checks(explain(source, key=ApiKeyFactory(organization="globex"))) == {("tier:standard", "api_key")}


def test_ip_networks_longest_prefix_wins(source: DatabasePolicySource) -> None:
    wide = SubjectAssignmentFactory(subject_kind="ip", subject_id="203.0.113.0/24", tier=tier("standard"))
    narrow = SubjectAssignmentFactory(subject_kind="ip", subject_id="203.0.113.0/28", tier=tier("enterprise"))
    widest = SubjectAssignmentFactory(subject_kind="ip", subject_id="203.0.0.0/16", tier=tier("free"))
    v6 = SubjectAssignmentFactory(subject_kind="ip", subject_id="2001:db8::/32", tier=tier("enterprise"))
    cases = {
        "203.0.113.7": ("tier:enterprise", narrow),
        "203.0.113.200": ("tier:standard", wide),
        "203.0.5.5": ("tier:free", widest),
        "2001:db8:1:2::5": ("tier:enterprise", v6),
    }
    for ip, (name, assignment) in cases.items():
        found = by_name(explain(source, ip=ip))
        assert name in found, ip
        assert found[name].check.subject.kind == "ip"
        assert found[name].origin == f"assignment #{assignment.pk} ({assignment.tier.name})"
    assert checks(explain(source, ip="198.51.100.1")) == {("tier:anonymous", "ip")}
    assert checks(explain(source, ip="2001:db9::1")) == {("tier:anonymous", "ip")}
    # An authenticated caller from an assigned network: the network's tier limits its address too.
    assert checks(explain(source, key=ApiKeyFactory(), ip="203.0.113.7")) == {
        ("tier:standard", "api_key"),
        ("tier:enterprise", "ip"),
    }


def test_single_address_assignment_saved_through_validation(source: DatabasePolicySource) -> None:
    assignment = SubjectAssignmentFactory.build(subject_kind="ip", subject_id="203.0.113.9", tier=tier("enterprise"))
    assignment.full_clean()
    assignment.save()
    assert checks(explain(source, ip="203.0.113.9")) == {("tier:enterprise", "ip")}
    assert checks(explain(source, ip="203.0.113.10")) == {("tier:anonymous", "ip")}


def test_dated_assignment_beats_a_permanent_one_on_every_database(source: DatabasePolicySource) -> None:
    """The newest start wins; an assignment without a start began at the dawn of time (not first, as NULLs
    sort on PostgreSQL, nor last, as they sort on SQLite)."""
    key = ApiKeyFactory()
    now = timezone.now()
    SubjectAssignmentFactory(subject_id=key_subject(key), tier=tier("free"))
    SubjectAssignmentFactory(
        subject_id=key_subject(key),
        tier=tier("enterprise"),
        starts_at=now - timedelta(hours=1),
        expires_at=now + timedelta(hours=1),
    )
    assert checks(explain(source, key=key, now=now)) == {("tier:enterprise", "api_key")}
    later = now + timedelta(hours=2)
    assert checks(explain(source, key=key, now=later)) == {("tier:free", "api_key"), ("tier:free:quota", "api_key")}


def test_assignments_start_and_expire_on_their_own(source: DatabasePolicySource) -> None:
    now = timezone.now()
    soon, later = ApiKeyFactory(), ApiKeyFactory()
    SubjectAssignmentFactory(subject_id=key_subject(soon), tier=tier("enterprise"), starts_at=now + timedelta(hours=1))
    SubjectAssignmentFactory(
        subject_id=key_subject(later), tier=tier("enterprise"), expires_at=now + timedelta(hours=1)
    )
    expired = ApiKeyFactory()
    SubjectAssignmentFactory(subject_id=key_subject(expired), tier=tier("enterprise"), expires_at=now)
    assert checks(explain(source, key=soon, now=now)) == {("tier:standard", "api_key")}
    assert checks(explain(source, key=soon, now=now + timedelta(hours=1))) == {("tier:enterprise", "api_key")}
    assert checks(explain(source, key=later, now=now)) == {("tier:enterprise", "api_key")}
    assert checks(explain(source, key=later, now=now + timedelta(hours=1))) == {("tier:standard", "api_key")}
    assert checks(explain(source, key=expired)) == {("tier:standard", "api_key")}
    assert len(source.snapshot().assignments) == 2  # the expired row is not even loaded


def test_assignment_to_a_disabled_tier_applies_no_tier_limits(source: DatabasePolicySource) -> None:
    """Tier.enabled: "A disabled tier's limits are not applied", and no default tier stands in for them."""
    key = ApiKeyFactory()
    SubjectAssignmentFactory(subject_id=key_subject(key), tier=TierFactory(rate="1/s", enabled=False))
    assert explain(source, key=key) == []
    assert "tier-" not in "".join(source.snapshot().tiers)


def test_rows_saved_around_validation_are_left_out_not_fatal(
    source: DatabasePolicySource, caplog: pytest.LogCaptureFixture
) -> None:
    """A row the admin would refuse (written by a plain UPDATE) costs itself, never every request."""
    key = ApiKeyFactory()
    good = SubjectAssignmentFactory(subject_id=key_subject(key), tier=tier("enterprise"))
    bad = SubjectAssignmentFactory(subject_id="somebody", tier=tier("enterprise"))
    override = OverrideFactory(subject_id="somebody", rate="1/s")
    Override.objects.filter(pk=override.pk).update(subject_kind="team")
    type(bad).objects.filter(pk=bad.pk).update(subject_kind="team")
    Tier.objects.filter(name="free").update(concurrency=0)  # the admin stores "none" as empty
    source.invalidate()
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        explained = explain(source, key=key)
    assert checks(explained) == {("tier:enterprise", "api_key")}
    assert explained[0].origin == f"assignment #{good.pk} (enterprise)"
    assert f"assignment #{bad.pk} left out: unknown subject kind 'team'" in caplog.text
    assert f"override #{override.pk} left out: unknown subject kind 'team'" in caplog.text
    assert [p.name for p in source.snapshot().tiers["free"]] == ["tier:free", "tier:free:quota"]


# -- endpoints -----------------------------------------------------------------------------------


def test_endpoint_policy_cost_priority_and_limits(source: DatabasePolicySource) -> None:
    EndpointPolicyFactory(
        endpoint="customers",
        cost=3,
        priority="low",
        per_caller_rate="30/m",
        per_caller_burst=10,
        endpoint_rate="600/m",
    )
    key = ApiKeyFactory()
    explained = by_name(explain(source, key=key))
    assert set(explained) == {"tier:standard", "endpoint:customers", "endpoint-all:customers"}
    assert limits(explained["tier:standard"]) == ("100/s", 200, 3)
    assert limits(explained["endpoint:customers"]) == ("30/m", 10, 3)
    assert limits(explained["endpoint-all:customers"]) == ("600/m", 600, 3)
    assert explained["endpoint:customers"].check.subject.kind == "api_key"
    assert explained["endpoint:customers"].origin == "endpoint policy, per caller"
    assert explained["endpoint-all:customers"].check.subject.kind == "endpoint"
    assert explained["endpoint-all:customers"].origin == "endpoint policy, all callers"
    assert source.endpoint_rule("customers", "GET").priority == "low"
    # Another endpoint keeps the default rule.
    assert checks(explain(source, key=key, endpoint="charges")) == {("tier:standard", "api_key")}
    assert source.endpoint_rule("charges", "GET").priority == "normal"


def test_method_specific_policy_beats_any(source: DatabasePolicySource) -> None:
    EndpointPolicyFactory(endpoint="charges", method="POST", cost=5, priority="critical")
    EndpointPolicyFactory(endpoint="charges", method="ANY", cost=2, priority="high")
    key = ApiKeyFactory()
    assert limits(explain(source, key=key, endpoint="charges", method="POST")[0])[2] == 5
    assert limits(explain(source, key=key, endpoint="charges", method="GET")[0])[2] == 2
    assert source.endpoint_rule("charges", "post").priority == "critical"
    assert source.endpoint_rule("charges", "DELETE").priority == "high"


def test_exempt_endpoints(configure: Configure) -> None:
    EndpointPolicyFactory(endpoint="health", exempt=True)
    source = configure(POLICIES={"EXEMPT_ENDPOINTS": ["metrics"]})
    key = ApiKeyFactory()
    assert explain(source, key=key, endpoint="health") == []
    assert explain(source, endpoint="metrics") == []
    assert explain(source, key=key, endpoint="customers") != []


def test_disabled_endpoint_policy_is_ignored(source: DatabasePolicySource) -> None:
    EndpointPolicyFactory(endpoint="customers", cost=4, per_caller_rate="1/m", enabled=False)
    EndpointPolicyFactory(endpoint="health", exempt=True, enabled=False)
    key = ApiKeyFactory()
    assert [limits(e) for e in explain(source, key=key)] == [("100/s", 200, 1)]
    assert checks(explain(source, key=key, endpoint="health")) == {("tier:standard", "api_key")}


# -- overrides -----------------------------------------------------------------------------------


def test_endpoint_override_beats_general_override_beats_tier(source: DatabasePolicySource) -> None:
    key = ApiKeyFactory()
    subject = key_subject(key)
    specific = OverrideFactory(subject_id=subject, endpoint="customers", rate="1/s", reason="abuse on customers")
    general = OverrideFactory(subject_id=subject, rate="500/s", burst=600, reason="migration week")  # newer
    OverrideFactory(subject_id=key_subject(ApiKeyFactory()), rate="2/s")  # someone else's

    on_customers = explain(source, key=key, endpoint="customers")
    assert len(on_customers) == 1
    assert on_customers[0].check.policy.name == f"override:{specific.pk}"
    assert limits(on_customers[0]) == ("1/s", 1, 1)
    assert on_customers[0].origin == f"override #{specific.pk}: abuse on customers"

    on_charges = explain(source, key=key, endpoint="charges")
    assert len(on_charges) == 1
    assert on_charges[0].check.policy.name == "tier:standard"  # a general override replaces the tier's values
    assert limits(on_charges[0]) == ("500/s", 600, 1)
    assert on_charges[0].origin == f"override #{general.pk}: migration week"

    assert [limits(e) for e in explain(source, key=ApiKeyFactory())] == [("100/s", 200, 1)]


def test_newest_general_override_wins(source: DatabasePolicySource) -> None:
    key = ApiKeyFactory()
    OverrideFactory(subject_id=key_subject(key), rate="300/s")
    newest = OverrideFactory(subject_id=key_subject(key), rate="400/s")
    explained = explain(source, key=key)
    assert [limits(e) for e in explained] == [("400/s", 400, 1)]
    assert explained[0].origin.startswith(f"override #{newest.pk}:")


def test_multiplier_override_scales_the_tier_and_keeps_the_quota(source: DatabasePolicySource) -> None:
    key = ApiKeyFactory()
    SubjectAssignmentFactory(subject_id=key_subject(key), tier=tier("free"))  # 25/s, burst 50, 100000/d
    OverrideFactory(subject_id=key_subject(key), rate="", multiplier=Decimal("2.5"))
    on_endpoint = OverrideFactory(subject_id=key_subject(key), endpoint="charges", rate="", multiplier=Decimal("0.1"))
    explained = by_name(explain(source, key=key))
    assert limits(explained["tier:free"]) == ("62/s", 125, 1)  # round(25 * 2.5) = 62: banker's rounding
    assert limits(explained["tier:free:quota"]) == ("100000/d", 100000, 1)
    on_charges = by_name(explain(source, key=key, endpoint="charges"))
    assert limits(on_charges[f"override:{on_endpoint.pk}"]) == ("2/s", 5, 1)
    assert "tier:free:quota" in on_charges


def test_override_on_an_address_saved_through_validation(source: DatabasePolicySource) -> None:
    override = OverrideFactory.build(subject_kind="ip", subject_id="203.0.113.7", rate="3/s")
    override.full_clean()
    override.save()
    assert [limits(e) for e in explain(source, ip="203.0.113.7")] == [("3/s", 3, 1)]
    assert [limits(e) for e in explain(source, ip="203.0.113.8")] == [("10/s", 20, 1)]


def test_overrides_expire_on_their_own(source: DatabasePolicySource) -> None:
    now = timezone.now()
    key = ApiKeyFactory()
    OverrideFactory(subject_id=key_subject(key), rate="7/s", expires_at=now + timedelta(minutes=5))
    gone = ApiKeyFactory()
    OverrideFactory(subject_id=key_subject(gone), rate="7/s", expires_at=now - timedelta(seconds=1))
    assert [limits(e) for e in explain(source, key=key, now=now)] == [("7/s", 7, 1)]
    assert [limits(e) for e in explain(source, key=key, now=now + timedelta(minutes=5))] == [("100/s", 200, 1)]
    assert [limits(e) for e in explain(source, key=gone, now=now)] == [("100/s", 200, 1)]
    assert ("api_key", key_subject(gone)) not in source.snapshot().overrides


def test_disabled_override_is_ignored(source: DatabasePolicySource) -> None:
    key = ApiKeyFactory()
    OverrideFactory(subject_id=key_subject(key), rate="7/s", enabled=False)
    assert [limits(e) for e in explain(source, key=key)] == [("100/s", 200, 1)]


def test_override_applies_to_an_assigned_organisation(source: DatabasePolicySource) -> None:
    SubjectAssignmentFactory(subject_kind="org", subject_id="acme", tier=tier("standard"))
    OverrideFactory(subject_kind="org", subject_id="acme", rate="", multiplier=Decimal("10"))
    explained = explain(source, key=ApiKeyFactory(organization="acme"))
    assert {(e.check.subject.kind, limits(e)) for e in explained} == {
        ("org", ("1000/s", 2000, 1)),
        ("api_key", ("100/s", 200, 1)),
    }


# -- shadow --------------------------------------------------------------------------------------


def test_shadow_tier(source: DatabasePolicySource) -> None:
    key = ApiKeyFactory()
    SubjectAssignmentFactory(subject_id=key_subject(key), tier=TierFactory(rate="5/s", quota="10/d", shadow=True))
    explained = explain(source, key=key)
    assert len(explained) == 2
    assert all(e.check.policy.shadow for e in explained)
    assert not any(e.check.policy.shadow for e in explain(source, key=ApiKeyFactory()))


def test_shadow_override_and_endpoint(source: DatabasePolicySource) -> None:
    key = ApiKeyFactory()
    OverrideFactory(subject_id=key_subject(key), rate="5/s", shadow=True)
    EndpointPolicyFactory(endpoint="customers", per_caller_rate="5/s", shadow=True)
    shadow = {e.check.policy.name: e.check.policy.shadow for e in explain(source, key=key)}
    assert shadow == {"tier:standard": True, "endpoint:customers": True}
    assert {e.check.policy.name: e.check.policy.shadow for e in explain(source, key=ApiKeyFactory())} == {
        "tier:standard": False,
        "endpoint:customers": True,
    }


def test_fleet_shadow_switch_shadows_everything(configure: Configure) -> None:
    FleetSettingsFactory(shadow=True)
    source = configure(DIMENSIONS={"ip": {"rate": "300/s"}, "org": "500/s"})
    key = ApiKeyFactory(organization="acme")
    OverrideFactory(subject_id=key_subject(key), endpoint="customers", rate="5/s")
    SubjectAssignmentFactory(subject_kind="org", subject_id="acme", tier=tier("free"))
    EndpointPolicyFactory(endpoint="customers", per_caller_rate="5/s", endpoint_rate="50/s")
    explained = explain(source, key=key)
    assert {e.check.policy.name for e in explained} >= {
        "tier:free",
        "tier:free:quota",
        "ip",
        "org",
        "endpoint:customers",
        "endpoint-all:customers",
    }
    assert [e.check.policy.name for e in explained if not e.check.policy.shadow] == []


def test_dimensions_are_enforced_without_the_shadow_switch(configure: Configure) -> None:
    source = configure(DIMENSIONS={"ip": {"rate": "300/s"}})
    explained = by_name(explain(source))
    assert explained["ip"].origin == "RATELIMITS['DIMENSIONS']['ip']"
    assert not explained["ip"].check.policy.shadow


# -- the snapshot and its reloads ----------------------------------------------------------------


def decision_with_version(source: DatabasePolicySource, version: str | None) -> Decision:
    """A real decision of this source's checks, from a store whose version stamp is ``version``."""
    backend = MemoryBackend()
    backend.version = version
    return backend.decide(explain_checks(source))


def explain_checks(source: DatabasePolicySource, key: ApiKey | None = None) -> list[Any]:
    return [e.check for e in explain(source, key=key)]


def test_snapshot_is_kept_while_the_version_stands(source: DatabasePolicySource) -> None:
    first = source.snapshot()
    version = first.version
    assert version == PolicyVersion.current()
    source.observe(decision_with_version(source, str(version)))
    assert source.snapshot() is first
    PolicyVersion.advance()  # a change committed by another worker...
    source.observe(decision_with_version(source, str(version + 1)))  # ...whose stamp comes back
    second = source.snapshot()
    assert second is not first and second.version == version + 1
    source.observe(decision_with_version(source, str(version + 1)))
    assert source.snapshot() is second


def test_a_lagging_store_is_repaired_not_reloaded(source: DatabasePolicySource) -> None:
    """A stamp behind the database (a lost publication, an expired or flushed key) is published again."""
    PolicyVersion.advance()  # a change committed while the store was unreachable
    source.invalidate()
    snap = source.snapshot()
    assert snap.version >= 1
    for stale in (None, str(snap.version - 1)):
        source.observe(decision_with_version(source, stale))
        assert source.snapshot() is snap
    assert engine.get_limiter().backend.publish_version(0) == str(snap.version)


def test_the_database_is_rechecked_even_when_no_stamp_moves(configure: Configure) -> None:
    """A change whose publication nobody saw fail is still found within POLICIES['RECHECK_INTERVAL']."""
    configure(POLICIES={"RECHECK_INTERVAL": "60s"})
    worker = DatabasePolicySource()
    snap = worker.snapshot()
    current = decision_with_version(worker, str(snap.version))
    PolicyVersion.advance()  # committed, but the store's stamp never moved
    worker.observe(current)
    assert worker.snapshot() is snap  # not yet: checked less than a minute ago
    snap.checked_at = time.monotonic() - 61
    worker.observe(current)
    assert worker.snapshot() is not snap


def test_a_decision_without_checks_says_nothing_about_the_version(source: DatabasePolicySource) -> None:
    """An exempt endpoint's decision has no version stamp: it must not cost the next request a reload."""
    source.observe(decision_with_version(source, "4"))
    loaded = source.snapshot()
    source.observe(Decision(Verdict.ALLOW, ()))
    assert source.snapshot() is loaded


def test_degraded_worker_reloads_after_the_poll_interval(configure: Configure) -> None:
    configure(POLICIES={"POLL_INTERVAL": "30s"})
    worker = DatabasePolicySource()  # a worker of its own, driven directly
    snap = worker.snapshot()
    degraded = Decision(Verdict.ALLOW, (), degraded=True)

    snap.loaded_at = time.monotonic() - 20  # younger than the interval: kept
    worker.observe(degraded)
    assert worker.snapshot() is snap

    # A change committed elsewhere while the store is down: no version bump reaches this worker.
    Tier.objects.filter(name="standard").update(rate="3/s")
    snap.loaded_at = time.monotonic() - 31
    worker.observe(degraded)
    reloaded = worker.snapshot()
    assert reloaded is not snap
    assert str(reloaded.tiers["standard"][0].rate) == "3/s"
    assert reloaded.version == snap.version + 1  # the update was audited: the database's version moved


# -- through the DRF stack on Redis --------------------------------------------------------------


@pytest.fixture
def metered(use_redis: Any, configure: Configure) -> tuple[DatabasePolicySource, Tier, APIClient]:
    """An API key on a tier of its own, 100/s with a burst of 100, on the real Redis; the worker warmed up.

    For tests with real commits (``transaction=True``): each row below commits, and bumps the version.
    """
    source = configure()
    key = ApiKeyFactory(raw="sk_metered_1")
    metered = TierFactory(name="metered", rate="100/s", burst=100)
    SubjectAssignmentFactory(subject_id=key_subject(key), tier=metered)
    client = client_for("sk_metered_1")
    # The first request loads the snapshot and learns the stamp; the second runs on a current snapshot.
    for _ in range(2):
        response = client.get("/v1/customers")
        assert (response["X-RateLimit-Resource"], response["X-RateLimit-Limit"]) == ("tier:metered", "100")
    # The store's stamp is the snapshot's: asked with the key's own checks (an anonymous caller's
    # would need the migrations' default tiers, which an earlier transactional test's flush removes).
    assert (
        str(source.snapshot().version)
        == engine.get_limiter().backend.decide(explain_checks(source, key=key), consume=False).policy_version
    )
    return source, metered, client


@pytest.mark.django_db(transaction=True)
def test_committed_change_is_enforced_on_the_next_request(
    metered: tuple[DatabasePolicySource, Tier, APIClient],
) -> None:
    """In the worker that made the change, the commit itself drops the snapshot."""
    _, tier_, client = metered
    with transaction.atomic():
        tier_.rate = "1/m"
        tier_.burst = 1
        tier_.save()
        assert client.get("/v1/customers")["X-RateLimit-Limit"] == "100"  # not before it commits
    after = [client.get("/v1/customers") for _ in range(3)]
    assert [r["X-RateLimit-Limit"] for r in after] == ["1", "1", "1"]
    # Old state carries over (same policy name), so which of the three gets the one token may vary;
    # at most one does: the old tier would have let all three through.
    assert [r.status_code for r in after].count(429) >= 2


@pytest.mark.django_db(transaction=True)
def test_other_workers_use_the_old_snapshot_for_at_most_one_request(
    metered: tuple[DatabasePolicySource, Tier, APIClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that did not make the change learns of it from the invalidation channel, or at the latest
    from the version stamp its next decision brings."""
    worker, tier_, client = metered
    with monkeypatch.context() as m:
        # The admin's save runs in another worker: its process has a source of its own.
        m.setattr(policy_source, "_source", ProcessWide(DatabasePolicySource))
        with transaction.atomic():
            tier_.rate = "2/s"
            tier_.burst = 5
            tier_.save()
    assert engine.get_policy_source() is worker
    # On the old snapshot only if the channel's message has not arrived yet; it brings back the new stamp.
    observing = client.get("/v1/customers")
    assert observing["X-RateLimit-Limit"] in ("100", "5")
    assert [client.get("/v1/customers")["X-RateLimit-Limit"] for _ in range(2)] == ["5", "5"]


def test_no_policy_queries_per_request_with_ten_thousand_overrides(
    use_redis: Any, configure: Configure, django_assert_num_queries: Any
) -> None:
    configure()
    key = ApiKeyFactory(raw="sk_zero_queries")
    expires = timezone.now() + timedelta(days=1)
    rows = [
        Override(
            subject_kind="api_key", subject_id=f"ApiKey:{2_000_000 + i}", rate="10/s", reason="bulk", expires_at=expires
        )
        for i in range(9_999)
    ]
    rows.append(
        Override(subject_kind="api_key", subject_id=key_subject(key), rate="42/s", reason="ours", expires_at=expires)
    )
    Override.objects.bulk_create(rows)  # bypasses the audit signals: fine for setup
    assert Override.objects.count() == 10_000
    bump_policy_version()  # the store carries the database's version, as after any committed change
    client = client_for("sk_zero_queries")
    for _ in range(2):  # the first loads the snapshot and learns the stamp; the second reloads once
        assert client.get("/v1/customers").status_code == 200

    with CaptureQueriesContext(connection) as captured:
        response = client.get("/v1/customers")
    assert response.status_code == 200
    assert response["X-RateLimit-Limit"] == "42"  # our override, found among 10,000 without a query
    sql = [q["sql"] for q in captured.captured_queries]
    assert not [s for s in sql if "ratelimits_" in s]
    # The demo's own: the API key lookup (authentication) and the view's customer listing.
    assert len(sql) == 2
    assert '"payments_apikey"' in sql[0] and '"payments_customer"' in sql[1]

    with django_assert_num_queries(1) as only:  # a view without queries of its own: the key lookup, nothing else
        assert client.get("/t/ping").status_code == 200
    assert '"payments_apikey"' in only.captured_queries[0]["sql"]


def test_exempt_requests_do_not_cause_reloads(
    use_redis: Any, configure: Configure, django_assert_num_queries: Any
) -> None:
    configure()
    EndpointPolicyFactory(endpoint="ping", exempt=True)
    ApiKeyFactory(raw="sk_exempt_1")
    bump_policy_version()
    client = client_for("sk_exempt_1")
    for _ in range(2):
        client.get("/v1/customers")
    with django_assert_num_queries(1):  # the key lookup only
        assert client.get("/t/ping").status_code == 200
    with django_assert_num_queries(2) as captured:  # the key lookup and the listing: no policy reload
        assert client.get("/v1/customers").status_code == 200
    assert not [q for q in captured.captured_queries if "ratelimits_" in q["sql"]]
