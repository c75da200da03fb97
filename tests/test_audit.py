"""The audit trail: every policy change recorded in its own transaction, and a version bump once it commits."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import redis
from django.contrib.auth.models import User
from django.db import transaction

from ratelimits import engine
from ratelimits.backends.memory import MemoryBackend
from ratelimits.models import AuditEntry, ConcurrentEdit, FleetSettings, Override, Tier
from ratelimits.store import audit
from ratelimits.store.audit import audit_context, snapshot
from ratelimits.store.database import DatabasePolicySource
from ratelimits.store.versioning import bump_policy_version

from .factories import (
    AuditEntryFactory,
    EndpointPolicyFactory,
    FleetSettingsFactory,
    OverrideFactory,
    SubjectAssignmentFactory,
    TierFactory,
    UserFactory,
)
from .support.settings import merged

pytestmark = pytest.mark.django_db

CaptureCallbacks = Callable[..., Any]

#: Per audited model: its factory and a change to make (values as the audit trail's JSON holds them).
CASES = [
    pytest.param(TierFactory, {"rate": "20/s", "burst": 40}, id="Tier"),
    pytest.param(SubjectAssignmentFactory, {"note": "upgraded for the migration"}, id="SubjectAssignment"),
    pytest.param(EndpointPolicyFactory, {"cost": 2, "priority": "low"}, id="EndpointPolicy"),
    pytest.param(OverrideFactory, {"rate": "5/s", "shadow": True}, id="Override"),
    pytest.param(FleetSettingsFactory, {"shadow": True, "capacity": 2000}, id="FleetSettings"),
]


@pytest.fixture
def operator() -> User:
    return UserFactory()  # type: ignore[no-any-return]


def memory_backend() -> MemoryBackend:
    backend = engine.get_limiter().backend
    assert isinstance(backend, MemoryBackend)  # tests.settings: RATELIMITS["BACKEND"] = "memory"
    return backend


@pytest.mark.parametrize(("factory", "change"), CASES)
def test_create_change_delete_are_audited_with_actor_reason_before_and_after(
    factory: Any, change: dict[str, Any], operator: User
) -> None:
    model = factory._meta.model
    label = model._meta.label
    if model is FleetSettings:
        FleetSettings.objects.all().delete()  # the seeded singleton: start without it to audit its creation
    AuditEntry.objects.all().delete()

    with audit_context(operator, "ticket 1: new"):
        obj = factory()
    created = AuditEntry.objects.get(model=label)
    assert (created.action, created.actor, created.reason) == ("created", operator, "ticket 1: new")
    assert (created.object_id, created.object_repr) == (str(obj.pk), str(obj))
    assert created.before is None
    assert created.after == snapshot(obj)
    assert created.after["revision"] == 1 and created.after["id"] == obj.pk

    old = {name: created.after[name] for name in change}
    with audit_context(operator, "ticket 2: change"):
        for name, value in change.items():
            setattr(obj, name, value)
        obj.save()
    changed = AuditEntry.objects.get(model=label, action="changed")
    assert (changed.actor, changed.reason, changed.object_id) == (operator, "ticket 2: change", str(obj.pk))
    assert changed.before == created.after
    assert {name: changed.before[name] for name in change} == old
    assert {name: changed.after[name] for name in change} == change
    assert {k for k in changed.after if changed.after[k] != changed.before[k]} == {*change, "revision"}

    with audit_context(operator, "ticket 3: gone"):
        obj.delete()
    deleted = AuditEntry.objects.get(model=label, action="deleted")
    assert (deleted.actor, deleted.reason, deleted.object_id) == (operator, "ticket 3: gone", str(changed.after["id"]))
    assert deleted.before == changed.after
    assert deleted.after is None
    assert AuditEntry.objects.filter(model=label).count() == 3


def test_audit_values_are_json() -> None:
    with audit_context(reason="json"):
        override = OverrideFactory(rate="", multiplier=Decimal("2.5"), subject_kind="ip", subject_id="203.0.113.0/24")
    after = AuditEntry.objects.get(model="ratelimits.Override").after
    assert after["multiplier"] == "2.5"
    # DjangoJSONEncoder keeps milliseconds.
    assert abs(datetime.fromisoformat(after["expires_at"]) - override.expires_at) < timedelta(milliseconds=1)
    assert (after["subject_kind"], after["subject_id"], after["created_by"]) == ("ip", "203.0.113.0/24", None)


def test_assignment_records_its_tier_by_key() -> None:
    with audit_context(reason="keys"):
        assignment = SubjectAssignmentFactory()
    entry = AuditEntry.objects.get(model="ratelimits.SubjectAssignment")
    assert entry.after["tier"] == assignment.tier_id


def test_reason_falls_back_to_the_overrides_own_and_actor_to_none() -> None:
    override = OverrideFactory(reason="customer migration, until Friday")
    tier = TierFactory()
    assert AuditEntry.objects.get(model="ratelimits.Override").reason == "customer migration, until Friday"
    tier_entry = AuditEntry.objects.get(model="ratelimits.Tier", object_id=str(tier.pk))
    assert (tier_entry.actor, tier_entry.reason) == (None, "")
    with audit_context(reason="said in the admin"):
        override.save()
    assert AuditEntry.objects.get(model="ratelimits.Override", action="changed").reason == "said in the admin"


def test_unsaved_actor_is_not_recorded_and_contexts_nest(operator: User) -> None:
    with audit_context(User(username="ghost"), "outer"):
        TierFactory(name="by-ghost")
        with audit_context(operator, "inner"):
            TierFactory(name="by-operator")
        TierFactory(name="by-ghost-again")
    entries = {e.object_repr: (e.actor, e.reason) for e in AuditEntry.objects.filter(model="ratelimits.Tier")}
    assert entries == {
        "by-ghost": (None, "outer"),
        "by-operator": (operator, "inner"),
        "by-ghost-again": (None, "outer"),
    }


def test_rolled_back_change_leaves_no_entry(operator: User) -> None:
    standard = Tier.objects.get(name="standard")
    AuditEntry.objects.all().delete()
    with pytest.raises(RuntimeError), audit_context(operator, "rolled back"), transaction.atomic():
        TierFactory(name="never")
        standard.rate = "1/s"
        standard.save()
        assert AuditEntry.objects.count() == 2  # written inside the transaction...
        raise RuntimeError("the admin's form failed later on")
    assert AuditEntry.objects.count() == 0  # ...and gone with it
    assert not Tier.objects.filter(name="never").exists()
    assert Tier.objects.get(name="standard").rate == "100/s"


def test_change_whose_entry_cannot_be_written_is_not_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    """One transaction: if the audit write fails, so does the change."""
    standard = Tier.objects.get(name="standard")

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("audit table unavailable")

    monkeypatch.setattr(audit, "record", failing)
    standard.rate = "1/s"
    with pytest.raises(RuntimeError, match="audit table unavailable"):
        standard.save()
    with pytest.raises(RuntimeError, match="audit table unavailable"):
        TierFactory(name="unaudited")
    stored = Tier.objects.get(name="standard")
    assert (stored.rate, stored.revision) == ("100/s", 0)
    assert not Tier.objects.filter(name="unaudited").exists()


@pytest.mark.django_db(transaction=True)
def test_refused_concurrent_edit_leaves_no_entry_and_no_bump() -> None:
    backend = memory_backend()
    tier = TierFactory()  # autocommit: each save commits, and bumps, at once
    stale = Tier.objects.get(pk=tier.pk)
    tier.save()
    assert backend.version == "2"
    entries = AuditEntry.objects.count()
    with pytest.raises(ConcurrentEdit):
        stale.save()
    assert backend.version == "2"
    assert AuditEntry.objects.count() == entries


def test_queryset_update_is_audited_per_row(operator: User) -> None:
    a, b, c = TierFactory(rate="10/s"), TierFactory(rate="20/s"), TierFactory(rate="30/s")
    AuditEntry.objects.all().delete()
    with audit_context(operator, "bulk disable"):
        assert Tier.objects.filter(pk__in=[a.pk, b.pk]).update(enabled=False) == 2
    entries = AuditEntry.objects.all()
    assert {e.object_id for e in entries} == {str(a.pk), str(b.pk)}
    for entry in entries:
        assert (entry.action, entry.model, entry.actor, entry.reason) == (
            "changed",
            "ratelimits.Tier",
            operator,
            "bulk disable",
        )
        assert (entry.before["enabled"], entry.after["enabled"]) == (True, False)
        assert (entry.before["revision"], entry.after["revision"]) == (1, 2)
        assert entry.before["rate"] == entry.after["rate"] == Tier.objects.get(pk=entry.object_id).rate
    assert Tier.objects.get(pk=c.pk).enabled


def test_queryset_update_of_nothing_writes_nothing(django_capture_on_commit_callbacks: CaptureCallbacks) -> None:
    AuditEntry.objects.all().delete()
    with django_capture_on_commit_callbacks() as callbacks:
        assert Tier.objects.filter(name="no-such-tier").update(enabled=False) == 0
    assert callbacks == []
    assert not AuditEntry.objects.exists()


def test_queryset_delete_is_audited_per_row(operator: User) -> None:
    overrides = OverrideFactory.create_batch(3)
    AuditEntry.objects.all().delete()
    with audit_context(operator, "clean-up"):
        Override.objects.filter(pk__in=[o.pk for o in overrides[:2]]).delete()
    entries = AuditEntry.objects.filter(action="deleted")
    assert {e.object_id for e in entries} == {str(o.pk) for o in overrides[:2]}
    assert all(e.after is None and e.before["reason"] and e.reason == "clean-up" for e in entries)


# -- the version bump ----------------------------------------------------------------------------


def test_version_moves_only_once_the_change_commits(django_capture_on_commit_callbacks: CaptureCallbacks) -> None:
    backend = memory_backend()
    start = backend.version
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        TierFactory()
        assert backend.version == start  # not while the transaction is open
    assert callbacks == [bump_policy_version]
    assert backend.version is not None and backend.version != start


def test_rolled_back_change_schedules_no_bump(django_capture_on_commit_callbacks: CaptureCallbacks) -> None:
    backend = memory_backend()
    start = backend.version
    standard = Tier.objects.get(name="standard")
    with (
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        pytest.raises(RuntimeError),
        transaction.atomic(),
    ):
        standard.rate = "1/s"
        standard.save()
        raise RuntimeError("rolled back")
    assert callbacks == []  # the rolled-back change's bump was dropped with it
    assert backend.version == start


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: TierFactory(), id="create"),
        pytest.param(lambda t: t.save(), id="save"),
        pytest.param(lambda t: Tier.objects.filter(pk=t.pk).update(rate="3/s"), id="update"),
        pytest.param(lambda t: t.delete(), id="delete"),
    ],
)
def test_every_kind_of_change_bumps_the_version_when_it_commits(change: Callable[[Tier], Any]) -> None:
    tier = TierFactory()
    backend = memory_backend()
    start = backend.version
    assert start is not None  # the factory's own commit bumped it
    with transaction.atomic():
        change(tier)
        assert backend.version == start
    assert backend.version == str(int(start) + 1)


@pytest.mark.django_db(transaction=True)
def test_version_moves_on_a_real_commit_and_not_on_a_rollback() -> None:
    backend = memory_backend()
    with transaction.atomic():
        tier = TierFactory()
        assert backend.version is None
    assert backend.version == "1"
    assert AuditEntry.objects.filter(model="ratelimits.Tier", object_id=str(tier.pk)).count() == 1

    with pytest.raises(RuntimeError), transaction.atomic():
        Tier.objects.filter(pk=tier.pk).update(rate="1/s")
        raise RuntimeError("rolled back")
    assert backend.version == "1"
    assert AuditEntry.objects.filter(model="ratelimits.Tier", object_id=str(tier.pk)).count() == 1

    tier.delete()  # autocommit: the change commits at once, and so does the bump
    assert backend.version == "2"


@pytest.mark.django_db(transaction=True)
def test_bump_reaches_redis_after_commit(use_redis: Any, redis_client: redis.Redis) -> None:
    key = "rl:policy-version"
    assert redis_client.get(key) is None
    with transaction.atomic():
        tier = TierFactory()
        assert redis_client.get(key) is None
    assert redis_client.get(key) == b"1"
    assert redis_client.ttl(key) > 0
    with transaction.atomic():
        tier.rate = "2/s"
        tier.save()
        TierFactory()
        assert redis_client.get(key) == b"1"
    assert redis_client.get(key) == b"2"  # one transaction, one bump


def test_bump_drops_this_process_snapshot(settings: Any, django_capture_on_commit_callbacks: CaptureCallbacks) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    source = engine.get_policy_source()
    assert isinstance(source, DatabasePolicySource)
    before = source.snapshot()
    assert "gold" not in before.tiers
    with django_capture_on_commit_callbacks(execute=True):
        TierFactory(name="gold", rate="7/s")
        assert source.snapshot() is before
    after = source.snapshot()
    assert after is not before
    assert [p.rate.limit for p in after.tiers["gold"]] == [7]


def test_commit_succeeds_when_the_version_cannot_be_bumped(
    settings: Any, django_capture_on_commit_callbacks: CaptureCallbacks
) -> None:
    """An unreachable store must not turn a committed change into an error: workers poll instead."""
    # Nothing listens on port 1: connection refused.
    settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": "redis://127.0.0.1:1/0"}})
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ratelimits")
    logger.addHandler(handler)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            TierFactory(name="saved-anyway")
    finally:
        logger.removeHandler(handler)
    assert Tier.objects.filter(name="saved-anyway").exists()
    assert [r.getMessage() for r in records if "could not publish policy version" in r.getMessage()]


# -- the entries themselves ----------------------------------------------------------------------


def test_audit_entries_newest_first_and_readable() -> None:
    older = AuditEntryFactory(object_repr="standard")
    newer = AuditEntryFactory(object_repr="free", at=older.at)
    assert list(AuditEntry.objects.filter(pk__in=[older.pk, newer.pk])) == [newer, older]
    assert str(older) == f"{older.at:%Y-%m-%d %H:%M} changed ratelimits.Tier standard"
