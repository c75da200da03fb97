"""The near-limit digest and the expiry task, as plain functions."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime, timedelta
from typing import Any

import django
import pytest
from django.core import mail
from django.utils import timezone

from ratelimits.models import AuditEntry, Override, UsageRecord
from ratelimits.periods import BillingPeriod, Unit
from ratelimits.reports.digest import near_limit_digest, send_digest
from ratelimits.store.expiry import expire_policies

from .factories import OverrideFactory, SubjectAssignmentFactory

pytestmark = pytest.mark.django_db
DAY = date(2026, 11, 29)


def usage(subject: str, tier: str, minute: int, kind: str = "api_key", **counts: int) -> None:
    start = datetime(DAY.year, DAY.month, DAY.day, tzinfo=UTC) + timedelta(minutes=minute)
    UsageRecord.objects.create(
        granularity="minute",
        period_start=start,
        subject_kind=kind,
        subject_id=subject,
        tier=tier,
        endpoint="charges",
        **counts,
    )


def test_digest_lists_subjects_near_their_daily_quota_and_the_most_throttled(settings: Any) -> None:
    settings.RATELIMITS = {
        "TIERS": {"free": {"rate": "10/s", "quota": "1000/d"}, "pro": {"rate": "100/s"}},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "free", "authenticated": "free"}},
    }
    # Addresses alone from Django 6.0, which deprecates (name, address) pairs; 5.2 takes pairs only.
    settings.ADMINS = ["ops@example.com"] if django.VERSION >= (6, 0) else [("Ops", "ops@example.com")]
    usage("ApiKey:1", "free", 0, allowed=500, tokens=500)
    usage("ApiKey:1", "free", 5, allowed=350, throttled=7, tokens=350)  # 850 of 1000: near
    usage("ApiKey:2", "free", 0, allowed=700, tokens=700)  # 70 %: not near
    usage("ApiKey:3", "pro", 0, allowed=10**6, throttled=40, tokens=10**6)  # no quota, most throttled
    usage("ApiKey:4", "free", 0, allowed=10, tokens=10)
    usage("ApiKey:4", "free", 60 * 24, allowed=999, tokens=999)  # the next day: not counted
    digest = near_limit_digest(DAY)
    assert digest.near_limit == [("api_key", "ApiKey:1", "free", 850, 1000)]
    assert digest.most_throttled == [("api_key", "ApiKey:3", 40, 10**6 + 40), ("api_key", "ApiKey:1", 7, 857)]
    sent = send_digest(DAY)
    assert sent == digest
    assert len(mail.outbox) == 1 and "ApiKey:1 (free): 850 of 1000" in mail.outbox[0].body


def test_the_digest_says_what_overflow_and_digest_rows_stand_for(settings: Any) -> None:
    usage("ip", "", 0, kind="overflow", allowed=900, throttled=90)
    usage("digest:AAAAAAAAAAAAAAAA", "free", 0, allowed=9, throttled=9)
    text = near_limit_digest(DAY).render()
    cap = "RATELIMITS['USAGE']['MAX_SUBJECTS']"
    assert f"overflow ip (every one beyond the subjects a minute counts, {cap}, together): 90 of" in text
    assert "api_key digest:AAAAAAAAAAAAAAAA (its label was not recorded: named by its digest): 9 of 18" in text


def test_expired_overrides_and_assignments_are_removed_with_an_audit_entry() -> None:
    now = timezone.now()
    gone = OverrideFactory(expires_at=now + timedelta(seconds=1))
    Override.objects.filter(pk=gone.pk).update(expires_at=now - timedelta(minutes=1))
    kept = OverrideFactory(expires_at=now + timedelta(days=1))
    old = SubjectAssignmentFactory(expires_at=now - timedelta(minutes=1))
    assert expire_policies() == 2
    assert list(Override.objects.values_list("pk", flat=True)) == [kept.pk]
    assert not type(old).objects.filter(pk=old.pk).exists()
    assert AuditEntry.objects.filter(action="deleted", reason="expired").count() == 2


def test_a_quota_by_month_is_shared_over_the_days_of_the_month_in_force(settings: Any) -> None:
    settings.RATELIMITS = {
        "TIERS": {"metered": {"rate": "10/s", "quota": "3100/month"}},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "metered", "authenticated": "metered"}},
    }
    days = BillingPeriod(Unit.MONTH).length_us(int(time.time() * 1_000_000)) // 86_400_000_000
    daily = 3100 // days  # 100 a day in a month of 31 days (not 3100 / 31 days and 3 hours, its longest)
    usage("ApiKey:5", "metered", 0, allowed=daily - 1, tokens=daily - 1)
    assert near_limit_digest(DAY).near_limit == [("api_key", "ApiKey:5", "metered", daily - 1, daily)]
