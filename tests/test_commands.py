"""Management commands: the effective limits of a caller, and policy export/import between environments."""

from __future__ import annotations

import copy
import io
import json
import re
import sys
from datetime import UTC, datetime
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.http import HttpRequest

from ratelimits.engine import get_limiter, get_policy_source
from ratelimits.identity import Identity, Subject
from ratelimits.models import (
    AuditEntry,
    EndpointPolicy,
    FleetSettings,
    Override,
    SubjectAssignment,
    Tier,
    validate_subject,
)
from ratelimits.store.audit import audit_context
from ratelimits.store.portability import (
    MAX_DEPTH,
    PolicyImportError,
    export_policies,
    import_policies,
    load_document,
)

from .support.settings import merged

pytestmark = pytest.mark.django_db

LATER = datetime(2099, 1, 1, tzinfo=UTC)
PAST = "2020-01-31T12:00:00Z"


def run(*args: Any, **options: Any) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


@pytest.fixture
def db_source(settings: Any, use_redis: Any) -> None:
    """The admin-managed policies, decided on the private Redis."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})


def wipe() -> None:
    """An empty policy database (the migrations seed tiers and the fleet row)."""
    with audit_context(None, "test: start empty"):
        for model in (Override, SubjectAssignment, EndpointPolicy, FleetSettings, Tier):
            for row in model.objects.all():
                row.delete()


def policies() -> dict[str, Any]:
    """A little of everything, on top of the seeded tiers."""
    gold = Tier.objects.create(name="gold", rate="50/s", burst=100, quota="1000/d", description="Paying customers.")
    team = Tier.objects.create(name="team", rate="200/s", algorithm="sliding_window", shadow=True)
    fleet = FleetSettings.load()
    fleet.authenticated_tier = gold
    fleet.shed_low_percent = 55
    fleet.save()
    SubjectAssignment.objects.create(subject_kind="org", subject_id="acme", tier=team, note="enterprise deal")
    SubjectAssignment.objects.create(
        subject_kind="ip",
        subject_id="2001:db8::/48",
        tier=gold,
        starts_at=datetime(2024, 1, 1, tzinfo=UTC),
        expires_at=LATER,
    )
    EndpointPolicy.objects.create(
        endpoint="charges", method="POST", cost=2, priority="critical", per_caller_rate="20/h", description="Money."
    )
    EndpointPolicy.objects.create(endpoint="health", exempt=True)
    Override.objects.create(
        subject_kind="api_key",
        subject_id="ApiKey:1",
        endpoint="charges",
        rate="5/m",
        burst=10,
        reason="launch week",
        expires_at=LATER,
    )
    Override.objects.create(
        subject_kind="user", subject_id="7", multiplier=Decimal("1.5"), reason="migration", expires_at=LATER
    )
    return export_policies()


# -- ratelimits_effective ------------------------------------------------------------------------


def test_effective_shows_every_check_with_origin_and_live_remaining(db_source: None) -> None:
    policies()
    args = ["--subject", "api_key:ApiKey:1", "--subject", "org:acme", "--subject", "ip:203.0.113.7"]
    report = json.loads(run("ratelimits_effective", *args, "--endpoint", "charges", "--method", "post", "--json"))

    assert report["endpoint"] == "charges" and report["method"] == "POST" and report["degraded"] is False
    assert report["subjects"] == {"api_key": "ApiKey:1", "org": "acme", "ip": "203.0.113.7"}
    checks = {c["policy"]: c for c in report["checks"]}
    override = next(c for c in report["checks"] if c["origin"] == "override")
    assert override["policy"].startswith("override:")
    assert override["subject"] == "api_key" and override["cost"] == 2
    assert override["description"] == "5 / minute, burst 10"
    assert override["origin_detail"].endswith("launch week")
    assert (override["remaining"], override["limit"]) == (10, 10)
    quota = checks["tier:gold:quota"]  # the tier's quota is kept under a rate override
    assert (
        quota["origin"] == "tier"
        and quota["origin_detail"] == "default tier for authenticated callers (fleet settings)"
    )
    assert (quota["remaining"], quota["limit"]) == (1000, 1000)
    team = checks["tier:team"]
    assert team["origin"] == "assignment" and team["subject"] == "org" and team["shadow"] is True
    endpoint = checks["endpoint:POST/charges"]
    assert endpoint["origin"] == "endpoint" and endpoint["subject"] == "api_key"
    assert (endpoint["remaining"], endpoint["limit"]) == (20, 20)
    assert endpoint["reset"] >= int(datetime.now(UTC).timestamp())

    # Spend one request the way the throttle would: the peek shows it; the peeks themselves spend nothing.
    request = HttpRequest()
    request.method = "POST"
    identity = Identity(
        ip=Subject("ip", "203.0.113.7"),
        endpoint=Subject("endpoint", "charges"),
        api_key=Subject("api_key", "ApiKey:1"),
        organization=Subject("org", "acme"),
    )
    assert get_limiter().decide(get_policy_source().checks_for(request, identity)).allowed
    for _ in range(2):
        text = run("ratelimits_effective", *args, "--endpoint", "charges", "--method", "POST")
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith(("override:", "tier:", "endpoint"))}
    assert set(lines) == {override["policy"], "tier:gold:quota", "tier:team", "endpoint:POST/charges"}
    # REMAINING, then LIMIT, then RESET; the origin's detail last.
    assert re.search(r" override +no +8 +10 +in [0-9.]+s +override #[0-9]+: launch week$", lines[override["policy"]])
    assert re.search(
        r" tier +no +998 +1000 +in .* default tier for authenticated callers \(fleet settings\)$",
        lines["tier:gold:quota"],
    )
    assert re.search(r" endpoint +no +18 +20 +in .* endpoint policy, per caller$", lines["endpoint:POST/charges"])
    assert re.search(r" assignment +yes +198 +200 +in .* assignment #[0-9]+ \(team\)$", lines["tier:team"])
    assert "ORIGIN" in text and "REMAINING" in text


def test_effective_anonymous_caller_on_an_exempt_endpoint(db_source: None) -> None:
    policies()
    text = run("ratelimits_effective", "--endpoint", "health")
    assert "(ip=unknown)" in text
    assert "No limits apply" in text


def test_effective_normalises_ipv6_like_requests(db_source: None) -> None:
    policies()
    report = json.loads(run("ratelimits_effective", "--subject", "ip:2001:db8::1", "--endpoint", "x", "--json"))
    assert report["subjects"] == {"ip": "2001:db8::/64"}
    # The /48 assignment covers the caller's /64.
    checks = [(c["policy"], c["origin"]) for c in report["checks"]]
    assert checks == [("tier:gold", "assignment"), ("tier:gold:quota", "assignment")]
    mapped = json.loads(run("ratelimits_effective", "--subject", "ip:::ffff:192.0.2.9", "--endpoint", "x", "--json"))
    assert mapped["subjects"] == {"ip": "192.0.2.9"}


def test_effective_shows_degraded_when_the_store_is_unreachable(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "POLICIES": {"SOURCE": "database"},
            "BACKEND": "redis",
            "REDIS": {"URL": "redis://127.0.0.1:1/0"},
        },
    )
    policies()
    text = run("ratelimits_effective", "--subject", "api_key:ApiKey:1", "--endpoint", "charges", "--method", "POST")
    assert "unreachable (degraded)" in text
    assert text.count("degraded  ") >= 3  # remaining and reset of each check
    report = json.loads(run("ratelimits_effective", "--subject", "api_key:ApiKey:1", "--endpoint", "charges", "--json"))
    assert report["degraded"] is True
    assert all(c["remaining"] is None and c["limit"] > 0 for c in report["checks"])


def test_effective_falls_back_to_checks_for_with_the_settings_source(settings: Any, use_redis: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"anon": {"rate": "2/m"}, "auth": {"rate": "9/s"}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "auth"}},
        },
    )
    report = json.loads(run("ratelimits_effective", "--subject", "user:7", "--endpoint", "customers", "--json"))
    assert [(c["policy"], c["subject"], c["origin"], c["remaining"]) for c in report["checks"]] == [
        ("tier:auth", "user", "settings", 9)
    ]


@pytest.mark.parametrize(
    ("subject", "message"),
    [
        ("api_key", "expected KIND:ID"),
        ("team:acme", "unknown kind 'team'"),
        ("ip:999.1.1.1", "'999.1.1.1' is not an IP address"),
        ("ip:", "is not an IP address"),
        ("ip:2001:db8::/64", "is not an IP address"),
        ("user:alice", "primary key"),
        ("api_key:", "1 to 200 visible characters"),
        ("org:has space", "1 to 200 visible characters"),
    ],
)
def test_effective_malformed_subject_is_a_command_error(subject: str, message: str) -> None:
    with pytest.raises(CommandError, match="--subject") as error:
        run("ratelimits_effective", "--subject", subject, "--endpoint", "charges")
    assert message in str(error.value)


def test_effective_other_bad_arguments() -> None:
    with pytest.raises(CommandError, match="given twice"):
        run("ratelimits_effective", "--subject", "ip:192.0.2.1", "--subject", "ip:192.0.2.2", "--endpoint", "x")
    with pytest.raises(CommandError, match="--endpoint: '/v1/charges' is not an endpoint name"):
        run("ratelimits_effective", "--endpoint", "/v1/charges")
    with pytest.raises(CommandError, match="--method"):
        run("ratelimits_effective", "--endpoint", "x", "--method", "GET /")


# -- export and import ---------------------------------------------------------------------------


def test_export_document_uses_natural_keys() -> None:
    document = policies()
    assert document["format"] == "ratelimits-policies" and document["version"] == 1
    assert [t["name"] for t in document["tiers"]] == ["anonymous", "enterprise", "free", "gold", "standard", "team"]
    assert document["tiers"][3] == {
        "name": "gold",
        "rate": "50/s",
        "burst": 100,
        "concurrency": None,
        "quota": "1000/d",
        "quota_zone": "",
        "quota_mode": "hard",
        "algorithm": "token_bucket",
        "fail_mode": "",
        "scope": "region",
        "enabled": True,
        "shadow": False,
        "description": "Paying customers.",
    }
    assert document["assignments"][0] == {
        "subject_kind": "ip",
        "subject_id": "2001:db8::/48",
        "tier": "gold",
        "starts_at": "2024-01-01T00:00:00Z",
        "expires_at": "2099-01-01T00:00:00Z",
        "quota_anchor": None,
        "note": "",
    }
    assert [(e["endpoint"], e["method"]) for e in document["endpoints"]] == [("charges", "POST"), ("health", "ANY")]
    assert document["overrides"][1]["multiplier"] == "1.500"
    assert "id" not in document["overrides"][0] and "revision" not in document["overrides"][0]
    assert document["fleet"]["authenticated_tier"] == "gold" and document["fleet"]["anonymous_tier"] == "anonymous"


def test_round_trip_through_an_empty_database(tmp_path: Path) -> None:
    document = policies()
    path = tmp_path / "policies.json"
    assert "Exported 6 tiers, 2 assignments, 2 endpoints, 2 overrides" in run("ratelimits_export", output=str(path))
    assert json.loads(path.read_text()) == document
    assert json.loads(run("ratelimits_export")) == document

    wipe()
    empty = export_policies()
    assert [empty[s] for s in ("tiers", "assignments", "endpoints", "overrides", "fleet")] == [[], [], [], [], None]
    out = run("ratelimits_import", str(path), reason="copy from staging")
    assert out.startswith("Created 13, updated 0, deleted 0 (0 unchanged).")
    assert export_policies() == document

    again = run("ratelimits_import", str(path), reason="no-op")
    assert again.startswith("Created 0, updated 0, deleted 0 (13 unchanged).")


def test_import_updates_by_natural_key_and_audits_every_change() -> None:
    document = policies()
    gold = Tier.objects.get(name="gold")
    before = AuditEntry.objects.count()
    changed = copy.deepcopy(document)
    changed["tiers"][3]["burst"] = 150  # gold
    changed["endpoints"][0]["per_caller_rate"] = "40/m"
    changed["overrides"].append(
        {
            "subject_kind": "ip",
            "subject_id": "192.0.2.1",
            "rate": "1/s",
            "reason": "abuse",
            "expires_at": "2099-01-01T00:00:00+02:00",
        }
    )
    changed["fleet"]["capacity"] = 2000

    report = import_policies(changed, reason="quarterly review")
    assert (report.total_created, report.total_updated, report.total_deleted) == (1, 3, 0)
    assert report.updated == {"tiers": 1, "endpoints": 1, "fleet": 1}
    canonical = validate_subject("ip", "192.0.2.1")  # as the admin would store it
    assert report.changes == [
        "update tier gold",
        "update fleet settings",
        "update endpoint policy POST charges",
        f"create override ip {canonical} until 2098-12-31T22:00:00Z",
    ]
    gold.refresh_from_db()
    assert gold.burst == 150 and gold.revision == 2  # updated in place: same row
    new = list(AuditEntry.objects.order_by("id")[before:])
    assert len(new) == 4
    assert {e.reason for e in new} == {"quarterly review"}
    assert sorted(e.action for e in new) == ["changed", "changed", "changed", "created"]
    gold_entry = next(e for e in new if e.model == "ratelimits.Tier")
    assert gold_entry.before["burst"] == 100 and gold_entry.after["burst"] == 150  # type: ignore[index]
    assert export_policies()["overrides"][1]["subject_id"] == canonical


def test_import_with_an_invalid_item_changes_nothing_and_names_it(tmp_path: Path) -> None:
    document = policies()
    before = AuditEntry.objects.count()
    bad = copy.deepcopy(document)
    bad["tiers"].append({"name": "new", "rate": "10/s"})
    bad["tiers"][2]["rate"] = "0/s"
    bad["endpoints"][0]["cost"] = "lots"
    bad["assignments"][1]["tier"] = "platinum"
    bad["overrides"][0]["expires_at"] = "2099-01-01 00:00"
    bad["overrides"][1]["colour"] = "red"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))

    with pytest.raises(CommandError) as error:
        run("ratelimits_import", str(path), reason="should fail")
    message = str(error.value)
    assert "Nothing was imported" in message
    assert "tiers[2].rate: '0/s' allows nothing; the limit must be at least 1" in message
    assert "endpoints[0].cost: " in message and "lots" in message
    assert "assignments[1].tier: 'platinum' is not a tier in the document or the database." in message
    assert "overrides[0].expires_at: '2099-01-01 00:00' has no UTC offset" in message
    assert "overrides[1]: unknown fields colour" in message
    assert export_policies() == document
    assert AuditEntry.objects.count() == before
    assert not Tier.objects.filter(name="new").exists()


def test_model_clean_runs_on_the_result_and_rolls_everything_back() -> None:
    document = policies()
    before = AuditEntry.objects.count()
    bad = copy.deepcopy(document)
    bad["tiers"][3]["rate"] = "60/s"  # a valid change, written before the invalid one is found
    bad["assignments"].append(
        {
            "subject_kind": "org",
            "subject_id": "x",
            "tier": "gold",
            "starts_at": "2030-01-01T00:00:00Z",
            "expires_at": "2029-01-01T00:00:00Z",
        }
    )
    bad["overrides"].append(
        {
            "subject_kind": "org",
            "subject_id": "x",
            "rate": "1/s",
            "multiplier": "2",
            "reason": "r",
            "expires_at": "2099-01-01T00:00:00Z",
        }
    )
    with pytest.raises(PolicyImportError) as error:
        import_policies(bad, reason="should fail")
    assert error.value.errors == [
        "assignments[2].expires_at: The expiry must come after the start.",
        "overrides[2]: Give either replacement values (rate, burst) or a multiplier, not both.",
    ]
    assert export_policies() == document
    assert AuditEntry.objects.count() == before


def test_related_changes_are_validated_together() -> None:
    """A tier's burst and an endpoint's cost raised in one import: checked against the result, not piecemeal."""
    wipe()
    Tier.objects.create(name="small", rate="5/s")
    document = export_policies()
    document["tiers"][0]["burst"] = 20
    document["endpoints"] = [{"endpoint": "reports.export", "cost": 15}]
    report = import_policies(document, reason="bigger exports")
    assert (report.total_created, report.total_updated) == (1, 1)
    assert EndpointPolicy.objects.get(endpoint="reports.export").cost == 15


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    document = policies()
    changed = copy.deepcopy(document)
    changed["tiers"][3]["rate"] = "75/s"
    del changed["endpoints"][1]
    changed["tiers"].append({"name": "bronze", "rate": "5/s"})
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(changed))
    before = AuditEntry.objects.count()

    out = run("ratelimits_import", str(path), "--dry-run", "--replace", reason="preview")
    assert out.startswith("Would create 1, update 1, delete 1 (11 unchanged).")
    assert (
        "  - create tier bronze" in out and "  - update tier gold" in out and "  - delete endpoint policy health" in out
    )
    assert out.rstrip().endswith("Dry run: nothing was written.")
    assert export_policies() == document
    assert AuditEntry.objects.count() == before

    report = import_policies(changed, reason="preview", dry_run=True)
    assert report.dry_run and report.total_created == 1 and report.total_deleted == 0  # not replacing
    assert export_policies() == document


def test_replace_deletes_rows_missing_from_the_document(tmp_path: Path) -> None:
    document = policies()
    trimmed = copy.deepcopy(document)
    trimmed["tiers"] = [t for t in trimmed["tiers"] if t["name"] not in ("team", "enterprise")]
    trimmed["assignments"] = [a for a in trimmed["assignments"] if a["tier"] != "team"]
    trimmed["endpoints"] = trimmed["endpoints"][:1]
    trimmed["overrides"] = []
    path = tmp_path / "trimmed.json"
    path.write_text(json.dumps(trimmed))
    before = AuditEntry.objects.count()

    out = run("ratelimits_import", str(path), reason="merge only")
    assert out.startswith("Created 0, updated 0, deleted 0 (")
    assert export_policies() == document

    out = run("ratelimits_import", str(path), "--replace", reason="make prod match")
    assert out.startswith("Created 0, updated 0, deleted 6 (")
    assert "  tiers: 0 created, 0 updated, 2 deleted, 4 unchanged" in out
    assert export_policies() == trimmed
    deleted = AuditEntry.objects.order_by("id")[before:]
    assert [e.action for e in deleted] == ["deleted"] * 6
    assert {e.reason for e in deleted} == {"make prod match"}


def test_replace_needs_every_section_and_can_drop_the_fleet_row() -> None:
    document = policies()
    partial = {k: v for k, v in document.items() if k != "overrides"}
    with pytest.raises(PolicyImportError, match="overrides: missing; replace deletes"):
        import_policies(partial, reason="x", replace=True)
    import_policies(partial, reason="merging without overrides is fine")
    report = import_policies({**document, "fleet": None}, reason="no fleet row", replace=True)
    assert report.deleted == {"fleet": 1}
    assert not FleetSettings.objects.exists()


def test_duplicate_assignments_round_trip_but_duplicate_tiers_do_not() -> None:
    wipe()
    tier = Tier.objects.create(name="t", rate="5/s")
    for note in ("first", "second"):
        SubjectAssignment.objects.create(subject_kind="user", subject_id="1", tier=tier, note=note)
    document = export_policies()
    assert [a["note"] for a in document["assignments"]] == ["first", "second"]
    wipe()
    import_policies(document, reason="restore")
    assert export_policies() == document
    document["tiers"].append(document["tiers"][0])
    with pytest.raises(PolicyImportError, match=r"tiers\[1\]: the same tier as tiers\[0\]"):
        import_policies(document, reason="x")


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "must be a JSON object"),
        ({"format": "other", "version": 1}, "format: expected 'ratelimits-policies'"),
        ({"format": "ratelimits-policies", "version": 2}, "reads version 1 documents, not 2"),
        ({"format": "ratelimits-policies", "version": 1, "tiers": {}}, "tiers: expected a list"),
        ({"format": "ratelimits-policies", "version": 1, "tiers": ["gold"]}, r"tiers\[0\]: expected an object"),
        (
            {"format": "ratelimits-policies", "version": 1, "tiers": [{"name": "a", "rate": "1/s", "enabled": "yes"}]},
            r"tiers\[0\].enabled: expected true or false",
        ),
        (
            {"format": "ratelimits-policies", "version": 1, "tiers": [{"name": ["a"], "rate": "1/s"}]},
            r"tiers\[0\].name: expected a single value, got list",
        ),
        (
            {
                "format": "ratelimits-policies",
                "version": 1,
                "assignments": [{"subject_kind": "user", "subject_id": "x", "tier": "free"}],
            },
            r"assignments\[0\].subject_id: A user is identified",
        ),
        (
            {
                "format": "ratelimits-policies",
                "version": 1,
                "assignments": [{"subject_kind": "org", "subject_id": "x"}],
            },
            r"assignments\[0\].tier: This field is required",
        ),
    ],
)
def test_malformed_documents_are_refused(document: Any, message: str) -> None:
    with pytest.raises(PolicyImportError, match=message):
        import_policies(document, reason="x")


def test_import_command_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(CommandError, match="is not a JSON document"):
        run("ratelimits_import", str(path), reason="x")
    with pytest.raises(CommandError, match="Cannot read"):
        run("ratelimits_import", str(tmp_path / "missing.json"), reason="x")
    path.write_text(json.dumps(export_policies()))
    with pytest.raises(CommandError, match="--reason"):
        run("ratelimits_import", str(path))
    with pytest.raises(CommandError, match="--reason"):
        run("ratelimits_import", str(path), reason="  ")
    with pytest.raises(CommandError, match="no user 'nobody'"):
        run("ratelimits_import", str(path), reason="x", actor="nobody")


def test_import_names_the_actor_and_bumps_the_version_on_commit(
    use_redis: Any, django_user_model: Any, django_capture_on_commit_callbacks: Any
) -> None:
    from ratelimits.store.versioning import bump_policy_version

    admin = django_user_model.objects.create(username="ops")
    document = export_policies()
    document["tiers"].append({"name": "bronze", "rate": "5/s"})
    document["overrides"].append(
        {"subject_kind": "org", "subject_id": "a", "rate": "1/s", "reason": "r", "expires_at": "2099-01-01T00:00:00Z"}
    )
    with django_capture_on_commit_callbacks() as callbacks:
        import_policies(document, reason="x", dry_run=True)
    assert callbacks == []
    from ratelimits.models import PolicyVersion

    version = PolicyVersion.current()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        import_policies(document, reason="with actor", actor=admin)
    assert callbacks == [bump_policy_version]  # one publication for the whole import
    assert PolicyVersion.current() == version + 1
    assert get_limiter().backend.publish_version(0) == str(version + 1)  # what every worker now sees
    assert {e.actor_id for e in AuditEntry.objects.filter(reason="with actor")} == {admin.pk}
    assert Override.objects.get(subject_id="a").created_by == admin


def test_effective_says_when_its_figures_are_its_own(settings: Any) -> None:
    """With the memory backend the command counts in its own process: it must not pass for the servers'."""
    settings.RATELIMITS = {**settings.RATELIMITS, "BACKEND": "memory"}
    text = run("ratelimits_effective", "--subject", "user:7", "--endpoint", "customers")
    assert "Limiter store: memory, this command's own: the figures are not the servers'" in text
    report = json.loads(run("ratelimits_effective", "--subject", "user:7", "--endpoint", "customers", "--json"))
    assert (report["backend"], report["store_shared"]) == ("memory", False)


def test_effective_refuses_a_method_nobody_sends() -> None:
    with pytest.raises(CommandError, match=r"--method: 'FOO' is not one of GET, HEAD, POST"):
        run("ratelimits_effective", "--endpoint", "customers", "--method", "FOO")


def test_import_refuses_an_expiry_that_has_passed(tmp_path: Path) -> None:
    document = policies()
    bad = copy.deepcopy(document)
    bad["overrides"][0]["expires_at"] = "2020-01-31T12:00:00+01:00"
    bad["assignments"].append({"subject_kind": "org", "subject_id": "late", "tier": "gold", "expires_at": PAST})
    with pytest.raises(PolicyImportError) as error:
        import_policies(bad, reason="should fail")
    assert error.value.errors == [
        f"assignments[2].expires_at: {PAST} has already passed: the assignment would never apply. "
        "Give a later expiry, or leave it out.",
        "overrides[0].expires_at: 2020-01-31T11:00:00Z has already passed: the override would never apply. "
        "Give a later expiry, or leave it out.",
    ]
    path = tmp_path / "late.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(CommandError, match=r"Nothing was imported.*\n  assignments\[2\]\.expires_at: 2020-01-31"):
        run("ratelimits_import", str(path), reason="should fail")
    assert export_policies() == document


def test_an_expired_row_that_is_already_stored_is_left_alone() -> None:
    """Not a new expiry: the row stopped applying on its own, and the import does not write it."""
    Override.objects.create(
        subject_kind="org", subject_id="old", rate="1/s", reason="r", expires_at=datetime(2020, 1, 1, tzinfo=UTC)
    )
    document = export_policies()
    report = import_policies(document, reason="same again", replace=True)
    assert not report.changed and report.unchanged["overrides"] == 1
    document["overrides"][0]["reason"] = "edited"
    with pytest.raises(PolicyImportError, match=r"overrides\[0\]\.expires_at: 2020-01-01T00:00:00Z has already passed"):
        import_policies(document, reason="an edit saves it again")


def test_import_refuses_a_file_over_the_size_limit(settings: Any, tmp_path: Path) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"IMPORT_MAX_SIZE": "1KB"}})
    document = export_policies()
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**document, "tiers": [{"name": "big", "rate": "1/s", "description": "x" * 2000}]}))
    size = path.stat().st_size
    with pytest.raises(CommandError) as error:
        run("ratelimits_import", str(path), reason="too big")
    assert (
        str(error.value) == f"{path} is {size:,} bytes, over the 1 KB RATELIMITS['POLICIES']['IMPORT_MAX_SIZE'] allows."
    )
    assert export_policies() == document


def test_import_reads_no_more_of_a_stream_than_the_limit(settings: Any, monkeypatch: Any) -> None:
    """A pipe has no size to ask for: it is read up to the limit, and refused past it."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"IMPORT_MAX_SIZE": 1024}})
    stream = io.BytesIO(b" " * 1025 + b"{}")
    with pytest.raises(
        PolicyImportError, match=r"^stdin is over the 1 KB RATELIMITS\['POLICIES'\]\['IMPORT_MAX_SIZE'\] allows\.$"
    ):
        load_document(stream, name="stdin")
    assert stream.tell() == 1025  # the limit and one byte more, never the rest
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b" " * 1025 + b"{}")))
    with pytest.raises(CommandError, match=r"^stdin is over the 1 KB"):
        run("ratelimits_import", "-", reason="too big")
    document = export_policies()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(document).encode()[:1024])))
    with pytest.raises(CommandError, match=r"^stdin is not a JSON document"):
        run("ratelimits_import", "-", reason="cut short")


def test_import_refuses_a_document_nested_too_deep(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # what made json's recursive parser raise RecursionError
    with pytest.raises(CommandError) as error:
        run("ratelimits_import", str(path), reason="deep")
    assert str(error.value) == f"{path} nests deeper than {MAX_DEPTH} levels; a ratelimits export nests 3."
    assert load_document(io.BytesIO(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH), name="x") is not None
    with pytest.raises(PolicyImportError, match="nests deeper"):
        load_document(io.BytesIO(b"{" + b'"a": [' * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"), name="x")


def test_brackets_inside_strings_are_text_not_nesting(tmp_path: Path) -> None:
    wipe()
    description = '[{ "quoted \\" [[[ ' + "[" * 100 + " } ]\\\\"
    document = export_policies()
    document["tiers"] = [{"name": "brackets", "rate": "1/s", "description": description}]
    path = tmp_path / "brackets.json"
    path.write_text(json.dumps(document))
    run("ratelimits_import", str(path), reason="brackets in text")
    assert Tier.objects.get(name="brackets").description == description
