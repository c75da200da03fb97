"""The admin is where limits live: it never shows a policy that is not enforced without saying so.

The finding: with the default (settings) policy source, a new project's admin had a full *Rate
limits* section with the migration's seeded tiers, while the enforced anonymous limit was the
settings' 5/min; nothing on the page said these rows were ignored, and an operator who edited a
tier saw nothing happen. Now every page of the section carries a banner when its tables are not
the source, with a link to *Limits in force*: every enforced limit, wherever it is set, read-only,
with where to change it. With the database source there is no banner, and the page lists the
tables' limits beside those that stay in the settings.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from ratelimits import engine
from ratelimits.models import AuditEntry, EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier

from .support.settings import merged

pytestmark = pytest.mark.django_db

BANNER = 'id="ratelimits-source-banner"'
SETTINGS_LIMITS = {
    "TIERS": {"walk-in": {"rate": "5/m"}, "partner": {"rate": "100/s", "burst": 200}},
    "POLICIES": {"DEFAULT_TIERS": {"anonymous": "walk-in", "authenticated": "partner"}},
    "ENDPOINTS": {"charges": {"cost": 5, "priority": "critical", "rate": "10/s"}},
    "DIMENSIONS": {"ip": {"rate": "300/m", "burst": 300}},
}

#: Every page of the section, by how to reach it: the app's index, each table's list, add and
#: change pages, a delete confirmation and a history, and the section's own pages.
PAGES = [
    ("admin:app_list", {"app_label": "ratelimits"}),
    *[(f"admin:ratelimits_{model}_changelist", {}) for model in ("tier", "endpointpolicy", "subjectassignment")],
    *[(f"admin:ratelimits_{model}_changelist", {}) for model in ("override", "fleetsettings", "auditentry")],
    ("admin:ratelimits_tier_add", {}),
    ("admin:ratelimits_tier_change", {"object_id": "{tier}"}),
    ("admin:ratelimits_tier_delete", {"object_id": "{tier}"}),
    ("admin:ratelimits_tier_history", {"object_id": "{tier}"}),
    ("admin:ratelimits_effective_policy", {}),
    ("admin:ratelimits_usage_report", {}),
    ("admin:ratelimits_limits_in_force", {}),
]


def pages(tier: Tier) -> list[str]:
    return [
        reverse(name, kwargs={k: v.format(tier=tier.pk) for k, v in kwargs.items()} or None) for name, kwargs in PAGES
    ]


@pytest.fixture
def seeded() -> Tier:
    """A row in the tables, as the migrations seed (an earlier test may have flushed those)."""
    return Tier.objects.create(name="free-seeded", rate="1/s", burst=5)


def test_with_the_settings_source_every_page_of_the_section_says_its_tables_are_not_enforced(
    settings: Any, admin_client: Client, seeded: Tier
) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, SETTINGS_LIMITS)
    engine.reset()
    for url in pages(seeded):
        response = admin_client.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert html.count(BANNER) == 1, url
        banner = html.split(BANNER)[1].split("</ul>")[0]
        assert "Not enforced:" in banner and "the limits in force are written in the settings" in banner, url
        assert reverse("admin:ratelimits_limits_in_force") in banner, url


def test_the_limits_in_force_list_what_the_settings_enforce(settings: Any, admin_client: Client, seeded: Tier) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, SETTINGS_LIMITS)
    engine.reset()
    response = admin_client.get(reverse("admin:ratelimits_limits_in_force"))
    context = response.context
    tiers = {(row["policy"], row["description"], row["origin"]) for row in context["tiers"]}
    assert ("tier:walk-in", "5 / minute, burst 5", "RATELIMITS['TIERS']['walk-in']") in tiers
    assert ("tier:partner", "100 / second, burst 200", "RATELIMITS['TIERS']['partner']") in tiers
    assert not any(row["tier"] == "free-seeded" for row in context["tiers"])  # the row is not enforced
    assert ("anonymous", "walk-in") in [(kind, tier) for kind, tier, _ in context["defaults"]]
    [charges] = [row for row in context["endpoints"] if row["endpoint"] == "charges"]
    assert (charges["cost"], charges["priority"], charges["per_caller"]) == (5, "critical", "10 / second, burst 10")
    assert charges["origin"] == "RATELIMITS['ENDPOINTS']['charges']"
    assert context["dimensions"] == [("ip", "300 / minute, burst 300", "RATELIMITS['DIMENSIONS']['ip']")]


def test_with_the_database_source_no_banner_and_the_tables_are_the_limits(
    settings: Any, admin_client: Client, seeded: Tier
) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}, "DIMENSIONS": SETTINGS_LIMITS["DIMENSIONS"]}
    )
    FleetSettings.objects.update_or_create(pk=1, defaults={"anonymous_tier": seeded, "authenticated_tier": seeded})
    EndpointPolicy.objects.create(endpoint="charges", per_caller_rate="100/d")
    engine.reset()
    for url in pages(seeded):
        response = admin_client.get(url)
        assert response.status_code == 200 and BANNER not in response.content.decode(), url
    context = admin_client.get(reverse("admin:ratelimits_limits_in_force")).context
    assert ("free-seeded", f"tier #{seeded.pk}") in {(row["tier"], row["origin"]) for row in context["tiers"]}
    assert [row["origin"] for row in context["endpoints"] if row["endpoint"] == "charges"] == ["endpoint policy"]
    # The backstops stay in the settings with either source: listed, with where they are set.
    assert context["dimensions"] == [("ip", "300 / minute, burst 300", "RATELIMITS['DIMENSIONS']['ip']")]


def test_the_limits_in_force_need_the_view_permission(django_user_model: Any) -> None:
    clerk = django_user_model.objects.create_user("clerk", password="pw", is_staff=True)
    client = Client()
    client.force_login(clerk)
    assert client.get(reverse("admin:ratelimits_limits_in_force")).status_code == 403


def test_every_table_of_the_section_is_among_the_pages() -> None:
    """The pages above cover every table of the section (a new one must be added to PAGES)."""
    tables = {AuditEntry, EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier}
    listed = {name.split("_")[1] for name, _ in PAGES if name.endswith("_changelist")}
    assert listed == {model._meta.model_name for model in tables}
