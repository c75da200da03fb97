"""The policy models' guardrails: what an admin cannot save, and what it is told instead."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from ratelimits.models import ConcurrentEdit, EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier

from .factories import (
    EndpointPolicyFactory,
    FleetSettingsFactory,
    OverrideFactory,
    SubjectAssignmentFactory,
    TierFactory,
)

pytestmark = pytest.mark.django_db

NOT_A_RATE = "is not a rate; expected 'N/period' such as '100/s', '5/10m' or '1000/h'"
BAD_RATES = [
    ("0/s", "'0/s' allows nothing; the limit must be at least 1"),
    ("-1/m", f"'-1/m' {NOT_A_RATE}"),
    ("1e3/s", f"'1e3/s' {NOT_A_RATE}"),
]


def errors_of(instance: Any) -> dict[str, list[str]]:
    """What ``full_clean()`` refuses, by field (``__all__`` for the whole object)."""
    with pytest.raises(ValidationError) as caught:
        instance.full_clean()
    return caught.value.message_dict


def valid(model: type[Any], **fields: Any) -> Any:
    """An unsaved instance that passes ``full_clean()`` as given, for a test to spoil one field of."""
    defaults: dict[type[Any], dict[str, Any]] = {
        Tier: {"name": "gold", "rate": "10/s"},
        EndpointPolicy: {"endpoint": "customers"},
        Override: {
            "subject_kind": "api_key",
            "subject_id": "ApiKey:1",
            "rate": "50/s",
            "reason": "incident 42",
            "expires_at": timezone.now() + timedelta(hours=1),
        },
        SubjectAssignment: {"subject_kind": "api_key", "subject_id": "ApiKey:1", "tier": Tier.objects.first()},
    }
    return model(**{**defaults[model], **fields})


# -- rates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bad", "message"), BAD_RATES)
@pytest.mark.parametrize(
    ("model", "field"),
    [
        (Tier, "rate"),
        (Tier, "quota"),
        (EndpointPolicy, "per_caller_rate"),
        (EndpointPolicy, "endpoint_rate"),
        (Override, "rate"),
    ],
)
def test_bad_rates_are_refused_naming_the_field(model: type[Any], field: str, bad: str, message: str) -> None:
    valid(model).full_clean()  # the baseline is valid: the error below is the bad rate's
    assert errors_of(valid(model, **{field: bad})) == {field: [message]}


@pytest.mark.parametrize("good", ["100/s", "5/10m", "10000/d", " 20/S "])
def test_good_rates_pass(good: str) -> None:
    valid(Tier, rate=good, quota=good).full_clean()
    valid(EndpointPolicy, per_caller_rate=good, endpoint_rate=good, cost=1).full_clean()


def test_tier_needs_a_rate() -> None:
    assert errors_of(valid(Tier, rate="")) == {"rate": ["This field cannot be blank."]}


def test_tier_describes_itself() -> None:
    assert TierFactory.build(rate="100/s", burst=200).describe() == "100 / second, burst 200"
    assert TierFactory.build(rate="5/10m").describe() == "5 / 10 minutes, burst 5"
    assert TierFactory.build(rate="bad").describe() == "bad"


def test_tier_capacity_cannot_fall_below_an_endpoints_cost() -> None:
    EndpointPolicyFactory(endpoint="reports", cost=15)
    EndpointPolicyFactory(endpoint="bulk", cost=40, exempt=True)  # exempt: never charged
    errors = errors_of(valid(Tier, rate="10/s"))
    assert errors == {
        NON_FIELD_ERRORS: [
            "With a capacity of 10, every request to reports (cost 15) from this tier would be denied. "
            "Raise the burst to at least 15 or lower that endpoint's cost."
        ]
    }
    valid(Tier, rate="10/s", burst=15).full_clean()
    assert "With a capacity of 12," in errors_of(valid(Tier, rate="10/s", burst=20, quota="12/d"))[NON_FIELD_ERRORS][0]
    valid(Tier, rate="10/s", enabled=False).full_clean()  # a disabled tier limits nothing


def test_endpoint_cost_cannot_exceed_a_tiers_capacity() -> None:
    # The seeded tiers: anonymous has the smallest capacity, a burst of 20.
    errors = errors_of(valid(EndpointPolicy, cost=21))
    assert errors == {
        "cost": [
            "A cost of 21 exceeds the capacity 20 of tier 'anonymous': "
            "every request to this endpoint from that tier would be denied."
        ]
    }
    valid(EndpointPolicy, cost=20).full_clean()
    valid(EndpointPolicy, cost=21, exempt=True).full_clean()


# -- endpoint policies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "burst"), [("per_caller_rate", "per_caller_burst"), ("endpoint_rate", "endpoint_burst")]
)
def test_endpoint_burst_without_rate(rate: str, burst: str) -> None:
    assert errors_of(valid(EndpointPolicy, **{burst: 5})) == {burst: ["A burst needs a rate."]}
    valid(EndpointPolicy, **{rate: "5/s", burst: 5}).full_clean()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"cost": 10, "per_caller_rate": "5/s"},
            "A cost of 10 exceeds the per caller rate's capacity of 5: every request to this endpoint would be denied.",
        ),
        (
            {"cost": 10, "per_caller_rate": "100/s", "per_caller_burst": 9},
            "A cost of 10 exceeds the per caller rate's capacity of 9: every request to this endpoint would be denied.",
        ),
        (
            {"cost": 3, "endpoint_rate": "2/m"},
            "A cost of 3 exceeds the endpoint rate's capacity of 2: every request to this endpoint would be denied.",
        ),
    ],
)
def test_cost_above_the_endpoints_own_capacity_is_refused(fields: dict[str, Any], message: str) -> None:
    assert errors_of(valid(EndpointPolicy, **fields)) == {"cost": [message]}


def test_cost_that_fits_the_burst_is_accepted() -> None:
    valid(EndpointPolicy, cost=10, per_caller_rate="5/s", per_caller_burst=10, endpoint_rate="10/s").full_clean()


def test_bad_rate_with_a_cost_reports_the_rate_instead_of_crashing() -> None:
    """clean() must not choke on a rate its field validator already refused (it raised ConfigurationError)."""
    errors = errors_of(valid(EndpointPolicy, cost=5, per_caller_rate="0/s", endpoint_rate="1e3/s"))
    assert errors == {
        "per_caller_rate": ["'0/s' allows nothing; the limit must be at least 1"],
        "endpoint_rate": [f"'1e3/s' {NOT_A_RATE}"],
    }


ENDPOINT_REFUSED = (
    "{!r} is not an endpoint name: use the view's throttle_scope or route name "
    "(letters, digits and _ . : / -), not a path or a regular expression."
)


@pytest.mark.parametrize("bad", ["/v1/charges/.*", "^charges$", "/v1/charges", "charges list", "charges?x=1", ""])
def test_endpoint_names_refuse_paths_and_regexes(bad: str) -> None:
    errors = errors_of(valid(EndpointPolicy, endpoint=bad))
    expected = ["This field cannot be blank."] if bad == "" else [ENDPOINT_REFUSED.format(bad)]
    assert errors == {"endpoint": expected}
    if bad:
        assert errors_of(valid(Override, endpoint=bad)) == {"endpoint": [ENDPOINT_REFUSED.format(bad)]}


@pytest.mark.parametrize("good", ["charges", "reports.export", "payments:charge-list", "v1/charges", "Ping_2"])
def test_endpoint_names_accepted(good: str) -> None:
    valid(EndpointPolicy, endpoint=good).full_clean()
    valid(Override, endpoint=good).full_clean()


def test_one_policy_per_endpoint_and_method() -> None:
    EndpointPolicyFactory(endpoint="charges", method="POST")
    EndpointPolicyFactory(endpoint="charges", method="ANY")
    errors = errors_of(valid(EndpointPolicy, endpoint="charges", method="POST"))
    assert errors == {NON_FIELD_ERRORS: ["Endpoint policy with this Endpoint and Method already exists."]}


# -- overrides -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["", "   "])
def test_override_needs_a_reason(reason: str) -> None:
    assert "Say why this override exists." in errors_of(valid(Override, reason=reason))["reason"]


def test_override_rate_or_multiplier_not_both() -> None:
    both = errors_of(valid(Override, rate="5/s", multiplier=Decimal("2")))
    assert both == {NON_FIELD_ERRORS: ["Give either replacement values (rate, burst) or a multiplier, not both."]}
    burst_and_multiplier = errors_of(valid(Override, rate="", burst=5, multiplier=Decimal("2")))
    assert burst_and_multiplier == both
    neither = errors_of(valid(Override, rate=""))
    assert neither == {NON_FIELD_ERRORS: ["Give a replacement rate, a multiplier, a concurrency limit, or a quota."]}
    valid(Override, rate="", multiplier=Decimal("0.5")).full_clean()


def test_override_burst_without_rate() -> None:
    assert errors_of(valid(Override, rate="", burst=5)) == {"burst": ["A burst needs a rate."]}


@pytest.mark.parametrize("multiplier", [Decimal("0"), Decimal("-1"), Decimal("10001")])
def test_override_multiplier_bounds(multiplier: Decimal) -> None:
    assert list(errors_of(valid(Override, rate="", multiplier=multiplier))) == ["multiplier"]


def test_override_needs_an_expiry() -> None:
    assert errors_of(valid(Override, expires_at=None)) == {"expires_at": ["This field cannot be null."]}


# -- subjects ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [SubjectAssignment, Override])
@pytest.mark.parametrize(
    ("kind", "given", "canonical"),
    [
        ("ip", "203.0.113.7/24", "203.0.113.0/24"),
        ("ip", " 203.0.113.0/24 ", "203.0.113.0/24"),
        ("ip", "2001:DB8:0:0::1/48", "2001:db8::/48"),
        # A single address is stored as the address: that is the value a caller's IP subject has.
        ("ip", "203.0.113.7", "203.0.113.7"),
        ("ip", "203.0.113.7/32", "203.0.113.7"),
        ("user", "42", "42"),
        ("api_key", "  ApiKey:7 ", "ApiKey:7"),
        ("org", "acme", "acme"),
    ],
)
def test_subjects_are_canonicalised(model: type[Any], kind: str, given: str, canonical: str) -> None:
    instance = valid(model, subject_kind=kind, subject_id=given)
    instance.full_clean()
    assert instance.subject_id == canonical


@pytest.mark.parametrize("model", [SubjectAssignment, Override])
@pytest.mark.parametrize(
    ("kind", "given", "message"),
    [
        (
            "ip",
            "203.0.113.999",
            "'203.0.113.999' is not an IP address or network such as 203.0.113.7 or 2001:db8::/48.",
        ),
        ("ip", "example.com", "'example.com' is not an IP address or network such as 203.0.113.7 or 2001:db8::/48."),
        ("user", "alice", "A user is identified by its primary key (a number)."),
        ("user", "-3", "A user is identified by its primary key (a number)."),
        ("api_key", "ApiKey 7", "Enter an identifier of 1 to 200 visible characters."),
        ("org", "acme\tcorp", "Enter an identifier of 1 to 200 visible characters."),
        ("org", "acme\x00", "Enter an identifier of 1 to 200 visible characters."),
    ],
)
def test_bad_subjects_are_refused(model: type[Any], kind: str, given: str, message: str) -> None:
    assert errors_of(valid(model, subject_kind=kind, subject_id=given)) == {"subject_id": [message]}


def test_blank_subject_is_refused() -> None:
    errors = errors_of(valid(SubjectAssignment, subject_id="   "))
    assert errors["subject_id"] == ["Enter an identifier of 1 to 200 visible characters."]


def test_assignment_expiry_must_follow_its_start() -> None:
    now = timezone.now()
    errors = errors_of(valid(SubjectAssignment, starts_at=now, expires_at=now))
    assert errors == {"expires_at": ["The expiry must come after the start."]}
    valid(SubjectAssignment, starts_at=now, expires_at=now + timedelta(seconds=1)).full_clean()


def test_factories_build_valid_rows() -> None:
    for instance in (
        TierFactory(),
        SubjectAssignmentFactory(),
        EndpointPolicyFactory(),
        OverrideFactory(),
        FleetSettingsFactory(),
    ):
        instance.full_clean()


# -- fleet settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(("low", "normal", "high"), [(80, 70, 90), (60, 95, 90), (91, 91, 90)])
def test_shedding_thresholds_must_rise_with_priority(low: int, normal: int, high: int) -> None:
    fleet = FleetSettings(shed_low_percent=low, shed_normal_percent=normal, shed_high_percent=high)
    assert errors_of(fleet) == {NON_FIELD_ERRORS: ["Shedding thresholds must rise with priority: low ≤ normal ≤ high."]}


def test_shedding_thresholds_at_most_100_percent() -> None:
    fleet = FleetSettings(shed_low_percent=60, shed_normal_percent=75, shed_high_percent=101)
    assert errors_of(fleet) == {"shed_high_percent": ["Ensure this value is less than or equal to 100."]}
    FleetSettings(shed_low_percent=50, shed_normal_percent=50, shed_high_percent=100).full_clean()


def test_fleet_settings_is_a_singleton() -> None:
    assert list(FleetSettings.objects.values_list("pk", flat=True)) == [1]
    another = FleetSettings(capacity=5000, shed_low_percent=10)
    another.save()
    assert another.pk == 1
    assert list(FleetSettings.objects.values_list("pk", "capacity", "shed_low_percent")) == [(1, 5000, 10)]
    assert FleetSettings.load().capacity == 5000


def test_fleet_settings_load_creates_the_row_if_missing() -> None:
    FleetSettings.objects.all().delete()
    loaded = FleetSettings.load()
    assert (loaded.pk, loaded.default_fail_mode, loaded.capacity, loaded.anonymous_tier) == (1, "open", None, None)


def test_fleet_settings_factory_applies_what_it_is_given_to_the_seeded_row() -> None:
    free = Tier.objects.get(name="free")
    fleet = FleetSettingsFactory(shadow=True, authenticated_tier=free)
    assert fleet.pk == 1
    stored = FleetSettings.objects.get()
    assert (stored.shadow, stored.authenticated_tier, stored.anonymous_tier.name) == (True, free, "anonymous")


# -- optimistic locking --------------------------------------------------------------------------


def test_a_stale_copy_cannot_undo_another_edit() -> None:
    mine = Tier.objects.get(name="standard")
    theirs = Tier.objects.get(name="standard")
    theirs.rate = "200/s"
    theirs.save()
    mine.rate = "5/s"
    mine.burst = 5
    with pytest.raises(ConcurrentEdit) as caught:
        mine.save()
    assert caught.value.messages == [
        "This tier was changed by someone else while you were editing it "
        "(revision 1, you started from 0). Reload it and apply your change again."
    ]
    assert isinstance(caught.value, ValidationError)  # forms and the admin show it like any validation error
    stored = Tier.objects.get(name="standard")
    assert (stored.rate, stored.burst, stored.revision) == ("200/s", 200, 1)
    assert mine.revision == 0
    fresh = Tier.objects.get(name="standard")
    fresh.rate = "5/s"
    fresh.save()
    assert Tier.objects.get(name="standard").revision == 2


def test_every_save_bumps_the_revision() -> None:
    tier = TierFactory()
    assert tier.revision == 1
    tier.save()
    tier.save()
    assert Tier.objects.get(pk=tier.pk).revision == tier.revision == 3


def test_concurrent_edit_on_every_revisioned_model() -> None:
    for instance in (SubjectAssignmentFactory(), EndpointPolicyFactory(), OverrideFactory(), FleetSettings.load()):
        model = type(instance)
        stale = model.objects.get(pk=instance.pk)
        model.objects.get(pk=instance.pk).save()
        with pytest.raises(ConcurrentEdit, match=rf"This {model._meta.verbose_name} was changed by someone else"):
            stale.save()


def test_save_with_update_fields_still_records_the_revision() -> None:
    tier = TierFactory(rate="10/s")
    stale = Tier.objects.get(pk=tier.pk)
    tier.rate = "20/s"
    tier.save(update_fields=["rate"])
    assert Tier.objects.get(pk=tier.pk).revision == tier.revision == 2
    tier.enabled = False
    tier.save(update_fields=["enabled"])  # the same copy saves again: it is not stale
    with pytest.raises(ConcurrentEdit):
        stale.save()
    stored = Tier.objects.get(pk=tier.pk)
    assert (stored.rate, stored.enabled, stored.revision) == ("20/s", False, 3)


def test_queryset_update_counts_as_an_edit() -> None:
    tier = TierFactory(rate="10/s")
    stale = Tier.objects.get(pk=tier.pk)
    assert Tier.objects.filter(pk=tier.pk).update(rate="20/s") == 1
    assert Tier.objects.get(pk=tier.pk).revision == 2
    stale.rate = "30/s"
    with pytest.raises(ConcurrentEdit):
        stale.save()
    assert Tier.objects.get(pk=tier.pk).rate == "20/s"


def test_a_failed_save_keeps_the_revision_it_started_from() -> None:
    TierFactory(name="taken")
    tier = TierFactory(name="mine")
    tier.name = "taken"
    with pytest.raises(IntegrityError), transaction.atomic():
        tier.save()
    assert tier.revision == 1
    tier.name = "mine-2"
    tier.save()  # not refused as a concurrent edit of itself
    assert Tier.objects.get(pk=tier.pk).revision == 2


# -- the seed migration --------------------------------------------------------------------------


def test_seed_migration_tiers() -> None:
    tiers = {t.name: (t.rate, t.burst, t.concurrency, t.quota, t.enabled) for t in Tier.objects.all()}
    assert tiers == {
        "anonymous": ("10/s", 20, None, "", True),
        "free": ("25/s", 50, None, "100000/d", True),
        "standard": ("100/s", 200, None, "", True),
        "enterprise": ("1000/s", 2000, None, "", True),
    }
    for tier in Tier.objects.all():
        tier.full_clean()  # the seeds pass their own guardrails


def test_seed_migration_fleet_defaults() -> None:
    fleet = FleetSettings.objects.get()
    assert fleet.pk == 1
    assert fleet.anonymous_tier is not None and fleet.anonymous_tier.name == "anonymous"
    assert fleet.authenticated_tier is not None and fleet.authenticated_tier.name == "standard"
    assert (fleet.default_fail_mode, fleet.shadow) == ("open", False)
    assert (fleet.shed_low_percent, fleet.shed_normal_percent, fleet.shed_high_percent) == (60, 75, 90)
    fleet.full_clean()


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"endpoint_shards": 4}, "endpoint_shards", "Shards split the all-callers rate: give one."),
        (
            {"endpoint_shards": 11, "endpoint_rate": "10/s"},
            "endpoint_shards",
            "11 shards exceed the capacity 10: each needs one.",
        ),
        (
            {"endpoint_shards": 4, "endpoint_rate": "100/s", "endpoint_burst": 20, "cost": 6},
            "cost",
            "A cost of 6 exceeds what each of the 4 shards holds (5): every request to this endpoint would be denied.",
        ),
    ],
)
def test_endpoint_shards_are_checked_against_the_all_callers_limit(
    fields: dict[str, Any], field: str, message: str
) -> None:
    assert errors_of(valid(EndpointPolicy, **fields)) == {field: [message]}
    valid(EndpointPolicy, endpoint_shards=4, endpoint_rate="100/s", endpoint_burst=20, cost=5).full_clean()
