"""The policy admin through the Django test client: lists, forms, guardrails, actions, permissions, audit.

Rows are created directly (not through tests/factories.py). The migrations seed four tiers
(anonymous, free, standard, enterprise) and the fleet settings row.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from django import forms
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from ratelimits import engine
from ratelimits.admin import EffectivePolicyForm
from ratelimits.engine import get_limiter, get_policy_source
from ratelimits.models import AuditEntry, EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier
from ratelimits.reconciler import reconcile

from .support.redis_server import RedisServer
from .support.settings import merged

pytestmark = pytest.mark.django_db

MODELS = ("tier", "subjectassignment", "endpointpolicy", "override", "fleetsettings", "auditentry")
API_KEY = "ApiKey:3"


def url(name: str, *args: Any) -> str:
    return reverse(f"admin:ratelimits_{name}", args=args)


def form_data(response: Any) -> dict[str, Any]:
    """What a browser would send back for the admin form in ``response`` (hidden revision included)."""
    form = response.context["adminform"].form
    data: dict[str, Any] = {}
    for name, field in form.fields.items():
        value = form[name].value()
        widget = getattr(field.widget, "widget", field.widget)  # unwrap RelatedFieldWidgetWrapper
        if isinstance(widget, forms.MultiWidget):
            parts = value if isinstance(value, list | tuple) else widget.decompress(value)
            for index, part in enumerate(parts):
                data[f"{name}_{index}"] = "" if part is None else str(part)
        elif isinstance(field, forms.BooleanField):
            if value:
                data[name] = "on"
        else:
            data[name] = "" if value is None else value
    return data


def form_errors(response: Any) -> dict[str, list[str]]:
    assert response.status_code == 200, f"expected the form again, got {response.status_code}"
    return {field: list(messages) for field, messages in response.context["adminform"].form.errors.items()}


def expires(days: int = 1) -> dt.datetime:
    return timezone.now() + dt.timedelta(days=days)


def make_override(**fields: Any) -> Override:
    values: dict[str, Any] = {
        "subject_kind": "api_key",
        "subject_id": API_KEY,
        "rate": "10/h",
        "burst": 10,
        "reason": "incident 42: integrator retry storm",
        "expires_at": expires(),
        **fields,
    }
    return Override.objects.create(**values)


@pytest.fixture
def db_source(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})


@pytest.fixture
def viewer(django_user_model: Any) -> Any:
    """Staff with view permissions only."""
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="ratelimits", codename__startswith="view_")
    )
    return user


@pytest.fixture
def viewer_client(viewer: Any) -> Client:
    client = Client()
    client.force_login(viewer)
    return client


# -- change lists ---------------------------------------------------------------------------------


def test_every_changelist_renders_with_human_readable_rates(admin_client: Client) -> None:
    standard = Tier.objects.get(name="standard")
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=API_KEY, tier=standard, note="big integrator")
    EndpointPolicy.objects.create(endpoint="charges", per_caller_rate="100/s", per_caller_burst=200, cost=2)
    make_override(rate="100/s", burst=200)
    AuditEntry.objects.create(action="changed", model="ratelimits.Tier", object_id="1", object_repr="standard")

    for model in MODELS:
        response = admin_client.get(url(f"{model}_changelist"))
        assert response.status_code == 200, model
        assert response.context["cl"].result_count >= 1, model

    tiers = admin_client.get(url("tier_changelist")).content.decode()
    assert "100 / second, burst 200" in tiers  # the seeded standard tier
    assert "1000 / second, burst 2000" in tiers
    endpoints = admin_client.get(url("endpointpolicy_changelist")).content.decode()
    assert "100 / second, burst 200" in endpoints
    assert "—" in endpoints  # no all-callers limit
    overrides = admin_client.get(url("override_changelist")).content.decode()
    assert "100 / second, burst 200" in overrides
    assert "incident 42" in overrides
    assignments = admin_client.get(url("subjectassignment_changelist")).content.decode()
    assert API_KEY in assignments


def test_changelist_search_and_filters(admin_client: Client) -> None:
    Tier.objects.filter(name="free").update(enabled=False)
    EndpointPolicy.objects.create(endpoint="charges", method="POST", priority="high")
    EndpointPolicy.objects.create(endpoint="reports-export", priority="low", description="nightly CSV export")

    def names(model: str, query: dict[str, str]) -> set[str]:
        response = admin_client.get(url(f"{model}_changelist"), query)
        assert response.status_code == 200
        return {str(obj) for obj in response.context["cl"].result_list}

    assert names("tier", {"q": "enterprise"}) == {"enterprise"}
    assert names("tier", {"q": "integrators"}) == {"enterprise"}  # description: "Large integrators, by contract."
    assert names("tier", {"enabled__exact": "0"}) == {"free"}
    assert names("tier", {"enabled__exact": "1"}) == {"anonymous", "standard", "enterprise"}
    assert names("endpointpolicy", {"q": "CSV"}) == {"reports-export"}
    assert names("endpointpolicy", {"priority__exact": "high"}) == {"POST charges"}
    assert names("endpointpolicy", {"method__exact": "ANY"}) == {"reports-export"}

    make_override(subject_kind="ip", subject_id="203.0.113.0/24", reason="load test from the partner")
    make_override(reason="incident 7")
    assert names("override", {"subject_kind__exact": "ip"}) == {"IP address or network 203.0.113.0/24"}
    assert names("override", {"q": "partner"}) == {"IP address or network 203.0.113.0/24"}


# -- forms: add, change, audit ----------------------------------------------------------------------


def test_add_and_change_tier_are_audited_with_actor_and_reason(admin_client: Client, admin_user: Any) -> None:
    add = admin_client.get(url("tier_add"))
    assert add.status_code == 200
    assert '<input type="hidden" name="revision"' in add.content.decode()
    data = form_data(add)
    data.update(name="gold", rate="50/s", burst="100", change_reason="new plan for partners")
    response = admin_client.post(url("tier_add"), data)
    assert response.status_code == 302, form_errors(response)
    gold = Tier.objects.get(name="gold")
    assert (gold.rate, gold.burst, gold.revision) == ("50/s", 100, 1)
    created = AuditEntry.objects.get(model="ratelimits.Tier", object_id=str(gold.pk))
    assert created.action == "created"
    assert created.actor == admin_user
    assert created.reason == "new plan for partners"
    assert created.before is None
    assert created.after["rate"] == "50/s"

    change = admin_client.get(url("tier_change", gold.pk))
    data = form_data(change)
    assert data["revision"] == 1
    data.update(burst="150", change_reason="partners asked for more headroom")
    response = admin_client.post(url("tier_change", gold.pk), data)
    assert response.status_code == 302, form_errors(response)
    gold.refresh_from_db()
    assert (gold.burst, gold.revision) == (150, 2)
    changed = AuditEntry.objects.get(model="ratelimits.Tier", object_id=str(gold.pk), action="changed")
    assert changed.actor == admin_user
    assert changed.reason == "partners asked for more headroom"
    assert (changed.before["burst"], changed.after["burst"]) == (100, 150)

    history = admin_client.get(url("auditentry_changelist"), {"q": "headroom"})
    assert [e.pk for e in history.context["cl"].result_list] == [changed.pk]


def test_add_override_records_creator_and_uses_its_reason(admin_client: Client, admin_user: Any) -> None:
    data = form_data(admin_client.get(url("override_add")))
    data.update(
        subject_kind="api_key",
        subject_id=f"  {API_KEY} ",
        endpoint="charges",
        rate="5/s",
        reason="incident 51: runaway retries",
        expires_at_0=str(expires().date()),
        expires_at_1="12:00:00",
    )
    response = admin_client.post(url("override_add"), data)
    assert response.status_code == 302, form_errors(response)
    override = Override.objects.get()
    assert override.subject_id == API_KEY  # canonicalised by the model's clean()
    assert override.created_by == admin_user
    entry = AuditEntry.objects.get(model="ratelimits.Override")
    assert (entry.action, entry.actor, entry.reason) == ("created", admin_user, "incident 51: runaway retries")


# -- guardrails -------------------------------------------------------------------------------------


def test_bad_rate_is_refused_naming_the_problem(admin_client: Client) -> None:
    data = form_data(admin_client.get(url("tier_add")))
    data.update(name="broken", rate="0/s")
    response = admin_client.post(url("tier_add"), data)
    assert form_errors(response)["rate"] == ["'0/s' allows nothing; the limit must be at least 1"]
    assert "allows nothing" in response.content.decode()
    assert not Tier.objects.filter(name="broken").exists()

    standard = Tier.objects.get(name="standard")
    data = form_data(admin_client.get(url("tier_change", standard.pk)))
    data.update(rate="abc")
    errors = form_errors(admin_client.post(url("tier_change", standard.pk), data))
    assert "'abc' is not a rate" in errors["rate"][0]
    standard.refresh_from_db()
    assert standard.rate == "100/s"


def test_tier_whose_burst_is_below_an_endpoint_cost_is_refused(admin_client: Client) -> None:
    EndpointPolicy.objects.create(endpoint="reports-export", cost=50)
    data = form_data(admin_client.get(url("tier_add")))
    data.update(name="tiny", rate="10/s", burst="20")
    response = admin_client.post(url("tier_add"), data)
    message = (
        "With a capacity of 20, every request to reports-export (cost 50) from this tier would be denied. "
        "Raise the burst to at least 50 or lower that endpoint's cost."
    )
    assert form_errors(response)["__all__"] == [message]
    assert "every request to reports-export (cost 50)" in response.content.decode()
    assert not Tier.objects.filter(name="tiny").exists()

    data.update(burst="50")  # enough for the costliest endpoint
    assert admin_client.post(url("tier_add"), data).status_code == 302
    assert Tier.objects.filter(name="tiny").exists()


def test_endpoint_cost_above_a_tier_capacity_is_refused(admin_client: Client) -> None:
    data = form_data(admin_client.get(url("endpointpolicy_add")))
    data.update(endpoint="reports-export", cost="25")  # the seeded anonymous tier holds 20
    errors = form_errors(admin_client.post(url("endpointpolicy_add"), data))
    assert "exceeds the capacity 20 of tier 'anonymous'" in errors["cost"][0]
    assert not EndpointPolicy.objects.exists()


def test_an_endpoint_that_settles_is_saved_and_a_max_cost_below_its_cost_refused(admin_client: Client) -> None:
    data = form_data(admin_client.get(url("endpointpolicy_add")))
    data.update(endpoint="customers-export", cost="3", max_cost="2", counts="no_server_errors")
    errors = form_errors(admin_client.post(url("endpointpolicy_add"), data))
    assert errors["max_cost"] == [
        "2 is less than the cost 3, which every request is admitted at: the most a view may true a "
        "request's cost up to is at least that."
    ]
    data.update(counts="sometimes")
    assert "Select a valid choice" in form_errors(admin_client.post(url("endpointpolicy_add"), data))["counts"][0]
    data.update(max_cost="15", counts="no_server_errors")
    assert admin_client.post(url("endpointpolicy_add"), data).status_code == 302
    row = EndpointPolicy.objects.get(endpoint="customers-export")
    assert (row.cost, row.max_cost, row.counts) == (3, 15, "no_server_errors")
    listed = admin_client.get(url("endpointpolicy_changelist")).content.decode()
    assert "every response but server errors (5xx), trued up to 15" in listed


def test_override_without_reason_is_refused(admin_client: Client) -> None:
    data = form_data(admin_client.get(url("override_add")))
    data.update(
        subject_kind="api_key",
        subject_id=API_KEY,
        rate="5/s",
        reason="   ",
        expires_at_0=str(expires().date()),
        expires_at_1="12:00:00",
    )
    response = admin_client.post(url("override_add"), data)
    assert "reason" in form_errors(response)
    assert not Override.objects.exists()

    data.update(reason="incident 9", rate="", multiplier="")
    errors = form_errors(admin_client.post(url("override_add"), data))
    assert errors["__all__"] == ["Give a replacement rate, a multiplier, a concurrency limit, or a quota."]

    data.update(subject_kind="ip", subject_id="not-an-ip", rate="5/s")
    errors = form_errors(admin_client.post(url("override_add"), data))
    assert "'not-an-ip' is not an IP address or network" in errors["subject_id"][0]
    assert not Override.objects.exists()


CONFIRM_BOX = '<input type="checkbox" name="confirm_expired"'


@pytest.mark.parametrize("model", [Override, SubjectAssignment])
def test_an_expiry_that_has_passed_is_saved_only_once_confirmed(
    admin_client: Client, model: type[Override | SubjectAssignment]
) -> None:
    name = model._meta.model_name
    page = admin_client.get(url(f"{name}_add"))
    assert CONFIRM_BOX not in page.content.decode()  # nothing to confirm yet
    data = form_data(page)
    data.update(subject_kind="org", subject_id="acme", expires_at_0="2020-01-31", expires_at_1="12:00:00")
    if model is Override:
        data.update(rate="5/s", reason="incident 9")
    else:
        data.update(tier=str(Tier.objects.get(name="free").pk))
    noun = model._meta.verbose_name

    response = admin_client.post(url(f"{name}_add"), data)
    assert form_errors(response) == {
        "expires_at": [
            f"This expiry has already passed: the {noun} would never apply. "
            "Give a later one, or tick “Save with this past expiry” to save it anyway."
        ]
    }
    assert CONFIRM_BOX in response.content.decode()  # offered with the error
    assert not model.objects.exists()

    data["confirm_expired"] = "on"
    response = admin_client.post(url(f"{name}_add"), data)
    assert response.status_code == 302, form_errors(response)
    row = model.objects.get()
    assert row.expires_at is not None and row.expires_at < timezone.now()

    # Changing the expired row asks again; a later expiry needs no confirmation.
    data = form_data(admin_client.get(url(f"{name}_change", row.pk)))
    assert "expires_at" in form_errors(admin_client.post(url(f"{name}_change", row.pk), data))
    data.update(expires_at_0=str(expires().date()))
    assert admin_client.post(url(f"{name}_change", row.pk), data).status_code == 302


# -- concurrent edits -------------------------------------------------------------------------------


def test_stale_revision_is_refused_and_first_change_kept(admin_client: Client, django_user_model: Any) -> None:
    standard = Tier.objects.get(name="standard")
    other = Client()
    other.force_login(django_user_model.objects.create_superuser("other", password="pw"))
    first = form_data(admin_client.get(url("tier_change", standard.pk)))
    second = form_data(other.get(url("tier_change", standard.pk)))
    assert first["revision"] == second["revision"]

    first.update(rate="200/s", burst="400", change_reason="launch week")
    assert admin_client.post(url("tier_change", standard.pk), first).status_code == 302

    second.update(description="edited from a stale page", change_reason="typo")
    response = other.post(url("tier_change", standard.pk), second)
    errors = form_errors(response)
    assert "Someone else saved this tier while you were editing it" in errors["__all__"][0]
    assert "Someone else saved this tier" in response.content.decode()

    standard.refresh_from_db()
    assert (standard.rate, standard.burst) == ("200/s", 400)
    assert standard.description != "edited from a stale page"
    assert AuditEntry.objects.filter(model="ratelimits.Tier", object_id=str(standard.pk)).count() == 1


def test_stale_revision_after_an_action_is_refused(admin_client: Client) -> None:
    """An action changes rows too: a page loaded before it must not silently undo it."""
    standard = Tier.objects.get(name="standard")
    stale = form_data(admin_client.get(url("tier_change", standard.pk)))
    run_action(admin_client, "tier", "enabled_off", [standard.pk])
    stale.update(description="edited from a stale page")
    errors = form_errors(admin_client.post(url("tier_change", standard.pk), stale))
    assert "Someone else saved this tier" in errors["__all__"][0]
    standard.refresh_from_db()
    assert standard.enabled is False


# -- actions ----------------------------------------------------------------------------------------


def run_action(client: Client, model: str, action: str, pks: list[int]) -> Any:
    return client.post(url(f"{model}_changelist"), {"action": action, "_selected_action": [str(pk) for pk in pks]})


@pytest.mark.parametrize(
    ("action", "field", "value"),
    [("enabled_off", "enabled", False), ("enabled_on", "enabled", True), ("shadow_on", "shadow", True)],
)
def test_actions_change_rows_and_are_audited(
    admin_client: Client, admin_user: Any, action: str, field: str, value: bool
) -> None:
    tiers = list(Tier.objects.filter(name__in=["free", "standard"]))
    endpoints = [EndpointPolicy.objects.create(endpoint=name) for name in ("charges", "customers")]
    overrides = [make_override(reason="incident 1"), make_override(reason="incident 2", endpoint="charges")]
    for rows in (tiers, endpoints, overrides):
        type(rows[0]).objects.filter(pk__in=[r.pk for r in rows]).update(**{field: not value})
    AuditEntry.objects.all().delete()

    for model, rows in (("tier", tiers), ("endpointpolicy", endpoints), ("override", overrides)):
        response = run_action(admin_client, model, action, [r.pk for r in rows])
        assert response.status_code == 302, model
        messages = [str(m) for m in response.wsgi_request._messages]
        assert any(": 2 " in m for m in messages), messages
        manager = type(rows[0]).objects
        assert set(manager.filter(pk__in=[r.pk for r in rows]).values_list(field, flat=True)) == {value}
        entries = AuditEntry.objects.filter(model=f"ratelimits.{type(rows[0]).__name__}")
        assert sorted(entries.values_list("object_id", flat=True)) == sorted(str(r.pk) for r in rows)
        for entry in entries:
            assert entry.action == "changed"
            assert entry.actor == admin_user
            assert entry.reason.startswith("admin action: ")
            assert (entry.before[field], entry.after[field]) == (not value, value)
    # Rows not selected are untouched.
    assert Tier.objects.get(name="enterprise").enabled is True
    assert Tier.objects.get(name="enterprise").shadow is False


# -- permissions ------------------------------------------------------------------------------------


def test_view_only_staff_cannot_change_a_tier(viewer_client: Client) -> None:
    standard = Tier.objects.get(name="standard")
    page = viewer_client.get(url("tier_change", standard.pk))
    assert page.status_code == 200
    assert b'name="_save"' not in page.content  # read-only view
    data = {"name": "standard", "rate": "1/s", "burst": "1", "algorithm": "token_bucket", "enabled": "on"}
    response = viewer_client.post(url("tier_change", standard.pk), {**data, "revision": standard.revision})
    assert response.status_code == 403
    assert viewer_client.post(url("tier_add"), {**data, "name": "sneaky"}).status_code == 403
    standard.refresh_from_db()
    assert (standard.rate, standard.burst) == ("100/s", 200)
    assert not Tier.objects.filter(name="sneaky").exists()
    assert not AuditEntry.objects.exists()


def test_view_only_staff_cannot_run_actions(viewer_client: Client) -> None:
    changelist = viewer_client.get(url("tier_changelist"))
    assert changelist.status_code == 200
    assert b'name="action"' not in changelist.content
    tiers = list(Tier.objects.values_list("pk", flat=True))
    for action in ("enabled_off", "shadow_on", "delete_selected"):
        viewer_client.post(url("tier_changelist"), {"action": action, "_selected_action": tiers})
    assert set(Tier.objects.values_list("enabled", "shadow")) == {(True, False)}
    assert Tier.objects.count() == len(tiers)
    assert not AuditEntry.objects.exists()


def test_audit_entries_are_read_only(admin_client: Client) -> None:
    entry = AuditEntry.objects.create(action="changed", model="ratelimits.Tier", object_id="1", object_repr="x")
    changelist = admin_client.get(url("auditentry_changelist"))
    assert changelist.status_code == 200
    assert url("auditentry_add").encode() not in changelist.content
    assert b'name="action"' not in changelist.content  # not even delete_selected
    assert admin_client.get(url("auditentry_add")).status_code == 403
    page = admin_client.get(url("auditentry_change", entry.pk))
    assert page.status_code == 200
    assert b'name="_save"' not in page.content
    assert admin_client.post(url("auditentry_change", entry.pk), {"reason": "rewritten"}).status_code == 403
    assert admin_client.post(url("auditentry_delete", entry.pk), {"post": "yes"}).status_code == 403
    admin_client.post(url("auditentry_changelist"), {"action": "delete_selected", "_selected_action": [entry.pk]})
    entry.refresh_from_db()
    assert entry.reason == ""


def test_fleet_settings_cannot_be_added_twice_or_deleted(admin_client: Client) -> None:
    assert FleetSettings.objects.count() == 1
    assert admin_client.get(url("fleetsettings_add")).status_code == 403
    assert admin_client.get(url("fleetsettings_delete", 1)).status_code == 403


# -- the effective policy page ----------------------------------------------------------------------


EFFECTIVE = {"api_key": API_KEY, "user": "", "org": "acme", "ip": "", "endpoint": "charges", "method": "GET"}


@pytest.fixture
def policies(db_source: None) -> dict[str, Any]:
    """An API key on the standard tier with an override on `charges`; its organisation on enterprise."""
    tiers = {t.name: t for t in Tier.objects.all()}
    key_assignment = SubjectAssignment.objects.create(
        subject_kind="api_key", subject_id=API_KEY, tier=tiers["standard"]
    )
    org_assignment = SubjectAssignment.objects.create(subject_kind="org", subject_id="acme", tier=tiers["enterprise"])
    EndpointPolicy.objects.create(endpoint="charges", per_caller_rate="100/d", endpoint_rate="1000/d")
    override = make_override(endpoint="charges", rate="10/h", burst=10)
    return {"override": override, "key_assignment": key_assignment, "org_assignment": org_assignment}


def effective_rows(response: Any) -> dict[str, dict[str, Any]]:
    assert response.status_code == 200
    return {row["policy"]: row for row in response.context["rows"]}


def spend(times: int) -> None:
    """Make requests' worth of consumption for the subject of ``EFFECTIVE``."""
    form = EffectivePolicyForm(EFFECTIVE)
    assert form.is_valid(), form.errors
    caller = form.caller()
    checks = get_policy_source().checks_for(caller.request, caller.identity)
    for _ in range(times):
        assert get_limiter().decide(checks).allowed


def test_effective_policy_shows_a_global_policys_share_here_and_the_last_round(
    admin_client: Client, policies: dict[str, Any], use_redis: RedisServer, settings: Any
) -> None:
    with RedisServer() as other:
        settings.RATELIMITS = merged(
            settings.RATELIMITS, {"REGIONS": {"CURRENT": "eu", "STORES": {"eu": use_redis.url, "us": other.url}}}
        )
        Tier.objects.filter(name="enterprise").update(scope="global")
        engine.reset()  # the policies are read afresh
        page = admin_client.get(url("effective_policy"), EFFECTIVE)
        rows = effective_rows(page)
        assert rows["tier:enterprise"]["region_share"].startswith("global: region eu holds 50% (burst ")
        assert rows["tier:enterprise"]["region_share"].endswith("never reconciled")
        assert "No reconciliation round has reached this region yet" in page.content.decode()
        spend(1)  # demand in eu, for the round to read
        time.sleep(1.02 - time.time() % 1)  # the round reads the second before its own
        done = reconcile()
        assert done.reached == ["eu", "us"] and done.subjects >= 1
        page = admin_client.get(url("effective_policy"), EFFECTIVE)
        rows = effective_rows(page)
        assert rows["tier:enterprise"]["region_share"].startswith("global: region eu holds 95% (burst ")
        assert "reconciled " in rows["tier:enterprise"]["region_share"]
        assert f"Last reconciliation round: {done.summary()['at']}" in page.content.decode()


def test_effective_policy_shows_checks_origins_and_live_remaining(
    admin_client: Client, policies: dict[str, Any], use_redis: Any
) -> None:
    page = admin_client.get(url("effective_policy"))
    assert page.status_code == 200
    assert page.context["rows"] == []
    assert b'id="effective-form"' in page.content

    override, key_assignment, org_assignment = (
        policies["override"],
        policies["key_assignment"],
        policies["org_assignment"],
    )
    rows = effective_rows(admin_client.get(url("effective_policy"), EFFECTIVE))
    name = f"override:{override.pk}"
    assert set(rows) == {name, "tier:enterprise", "endpoint:charges", "endpoint-all:charges"}
    assert rows[name]["origin"] == f"override #{override.pk}: incident 42: integrator retry storm"
    assert rows[name]["subject"] == "api_key"
    assert rows[name]["description"] == "10 / hour, burst 10"
    assert rows["tier:enterprise"]["origin"] == f"assignment #{org_assignment.pk} (enterprise)"
    assert rows["tier:enterprise"]["subject"] == "org"
    assert rows["endpoint:charges"]["origin"] == "endpoint policy, per caller"
    assert rows["endpoint-all:charges"]["origin"] == "endpoint policy, all callers"
    assert rows["endpoint-all:charges"]["subject"] == "endpoint"
    for row in rows.values():  # nothing spent yet: every counter is full
        assert (row["remaining"], row["reset_seconds"]) == (row["limit"], 0), row
    assert key_assignment.tier.name == "standard"  # replaced on `charges` by the override

    spend(3)
    page = admin_client.get(url("effective_policy"), EFFECTIVE)
    rows = effective_rows(page)
    assert (rows[name]["remaining"], rows[name]["limit"]) == (7, 10)
    assert (rows["endpoint:charges"]["remaining"], rows["endpoint:charges"]["limit"]) == (97, 100)
    assert rows["endpoint-all:charges"]["remaining"] == 997
    # Three tokens of 10/h (one per 360 s) and of 100/d (one per 864 s) to win back.
    assert 1075 <= rows[name]["reset_seconds"] <= 1080
    assert 2585 <= rows["endpoint:charges"]["reset_seconds"] <= 2592
    html = page.content.decode()
    assert '<td class="remaining">7 / 10</td>' in html
    assert f"override #{override.pk}: incident 42" in html
    assert 'id="reset-form"' in html
    assert html.count('id="id_api_key"') == 1  # the reset form's copies carry no duplicate ids
    assert f'<input type="hidden" name="api_key" value="{API_KEY}">' in html
    assert '<input type="hidden" name="method" value="GET">' in html
    assert "no client IP was given" in html  # EFFECTIVE names no address
    with_ip = admin_client.get(url("effective_policy"), {**EFFECTIVE, "ip": "203.0.113.7"})
    assert with_ip.context["ip_unknown"] is False
    assert "no client IP was given" not in with_ip.content.decode()


def test_effective_policy_reset_clears_counters_and_is_audited(
    admin_client: Client, admin_user: Any, policies: dict[str, Any], use_redis: Any
) -> None:
    spend(4)
    name = f"override:{policies['override'].pk}"
    assert effective_rows(admin_client.get(url("effective_policy"), EFFECTIVE))[name]["remaining"] == 6
    AuditEntry.objects.all().delete()

    response = admin_client.post(url("effective_policy"), {**EFFECTIVE, "reset": "Reset this subject's counters"})
    rows = effective_rows(response)
    assert (rows[name]["remaining"], rows["endpoint:charges"]["remaining"]) == (10, 100)
    assert rows["tier:enterprise"]["remaining"] == 2000
    assert rows["endpoint-all:charges"]["remaining"] == 996  # shared by every caller: not reset
    assert f"Counters reset for api_key {API_KEY}." in [str(m) for m in response.context["messages"]]

    entry = AuditEntry.objects.get()
    assert (entry.action, entry.actor, entry.model) == ("reset", admin_user, "ratelimits.counters")
    assert entry.object_id == f"api_key:{API_KEY}"
    assert entry.reason == "reset from the effective policy page"
    assert entry.after == {
        "policies": sorted([name, "endpoint:charges", "tier:enterprise"]),
        "subjects": ["api_key", "org"],
    }


def test_effective_policy_form_errors(admin_client: Client, db_source: None) -> None:
    response = admin_client.get(url("effective_policy"), {**EFFECTIVE, "api_key": "", "org": ""})
    assert response.context["form"].non_field_errors() == ["Give at least one identity of the subject."]
    response = admin_client.get(url("effective_policy"), {**EFFECTIVE, "ip": "999.1.1.1", "user": "bob"})
    errors = response.context["form"].errors
    assert "is not an IP address" in errors["ip"][0]
    assert errors["user"] == ["A user is identified by its id (a number)."]
    response = admin_client.get(url("effective_policy"), {**EFFECTIVE, "endpoint": "/v1/charges?x=1"})
    assert "is not an endpoint name" in response.context["form"].errors["endpoint"][0]
    assert response.context["rows"] == []


def test_effective_policy_needs_view_tier_and_reset_needs_change_tier(
    django_user_model: Any, policies: dict[str, Any], use_redis: Any
) -> None:
    staff = django_user_model.objects.create_user("staff", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get(url("effective_policy"), EFFECTIVE).status_code == 403

    staff.user_permissions.add(Permission.objects.get(codename="view_tier"))
    staff = django_user_model.objects.get(pk=staff.pk)  # fresh permission cache
    client.force_login(staff)
    page = client.get(url("effective_policy"), EFFECTIVE)
    assert page.status_code == 200
    assert b'id="reset-form"' not in page.content
    spend(2)
    assert client.post(url("effective_policy"), {**EFFECTIVE, "reset": "1"}).status_code == 403
    name = f"override:{policies['override'].pk}"
    assert effective_rows(client.get(url("effective_policy"), EFFECTIVE))[name]["remaining"] == 8
    assert not AuditEntry.objects.filter(action="reset").exists()

    anonymous = Client().get(url("effective_policy"))
    assert anonymous.status_code == 302
    assert "/admin/login/" in anonymous["Location"]


def test_subject_suggestions_find_api_keys_and_users(admin_client: Any, settings: Any) -> None:
    """The subject field's suggestions: API keys by name (as the limiter names them) and users."""
    from project.payments.models import ApiKey

    settings.RATELIMITS = merged(settings.RATELIMITS, {"IDENTITY": {"API_KEY_MODEL": "payments.ApiKey"}})
    key, _ = ApiKey.issue(name="Initech billing", tier="free", organization="initech")
    url = "/admin/ratelimits/fleetsettings/subjects/"
    found = admin_client.get(url, {"kind": "api_key", "term": "initech"}).json()["results"]
    assert found == [{"id": f"ApiKey:{key.pk}", "text": str(key)}]
    users = admin_client.get(url, {"kind": "user", "term": "admin"}).json()["results"]
    assert users and all(u["id"].isdigit() for u in users)
    assert admin_client.get(url, {"kind": "org", "term": "x"}).json() == {"results": []}
    page = admin_client.get("/admin/ratelimits/override/add/")
    assert b"subject-autocomplete.js" in page.content and b"data-suggest-url" in page.content


def test_subject_suggestions_need_view_permission(client: Any, django_user_model: Any) -> None:
    staff = django_user_model.objects.create_user("nosy", password="pw", is_staff=True)
    client.force_login(staff)
    assert client.get("/admin/ratelimits/fleetsettings/subjects/", {"kind": "user", "term": "a"}).status_code == 403


def test_fleet_settings_list_links_to_the_effective_policy_page_and_the_usage_report(admin_client: Any) -> None:
    page = admin_client.get("/admin/ratelimits/fleetsettings/").content.decode()
    assert 'href="/admin/ratelimits/fleetsettings/effective/"' in page
    assert 'href="/admin/ratelimits/fleetsettings/usage/"' in page
