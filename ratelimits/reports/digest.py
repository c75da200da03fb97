"""The daily "near limit" digest: who spent most of a quota, who was throttled most."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.core.mail import mail_admins
from django.db.models import Sum

from ..models import UsageRecord
from ..policies.source import build_policy_source
from ..policies.values import Role
from ..usage.records import OVERFLOW, UNRESOLVED

__all__ = ["Digest", "near_limit_digest", "send_digest"]

#: A subject is "near its limit" once it spent more than this share of its tier's daily quota.
NEAR = 0.8
TOP = 20


@dataclass(frozen=True)
class Digest:
    day: date
    #: (subject kind, id, tier, tokens spent, quota) of subjects above NEAR of their daily quota.
    near_limit: list[tuple[str, str, str, int, int]]
    #: (subject kind, id, throttled, requests) of the most throttled subjects.
    most_throttled: list[tuple[str, str, int, int]]

    def render(self) -> str:
        lines = [f"Rate limiting digest for {self.day:%Y-%m-%d} (UTC)", ""]
        lines.append(f"Subjects above {NEAR:.0%} of their daily quota:")
        lines += [f"  {k} {i} ({t}): {spent} of {quota}" for k, i, t, spent, quota in self.near_limit] or ["  none"]
        lines += ["", "Most throttled subjects:"]
        lines += [f"  {k} {i}{_note(k, i)}: {th} of {req} requests" for k, i, th, req in self.most_throttled] or [
            "  none"
        ]
        return "\n".join(lines)


def _note(kind: str, ident: str) -> str:
    """What a row that names no one subject stands for."""
    if kind == OVERFLOW:
        return " (every one beyond the subjects a minute counts, RATELIMITS['USAGE']['MAX_SUBJECTS'], together)"
    if ident.startswith(UNRESOLVED):
        return " (its label was not recorded: named by its digest)"
    return ""


def near_limit_digest(day: date | None = None) -> Digest:
    """Compute the digest for ``day`` (default: yesterday, UTC) from the usage rows."""
    day = day or (datetime.now(tz=UTC) - timedelta(days=1)).date()
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    rows = (
        UsageRecord.objects.filter(
            granularity="minute", period_start__gte=start, period_start__lt=start + timedelta(days=1)
        )
        .values("subject_kind", "subject_id", "tier")
        .annotate(
            tokens=Sum("tokens"),
            throttled=Sum("throttled"),
            allowed=Sum("allowed"),
            shed=Sum("shed"),
            degraded=Sum("degraded"),
        )
    )
    quotas = _daily_quotas()
    near: list[tuple[str, str, str, int, int]] = []
    throttled: list[tuple[str, str, int, int]] = []
    for row in rows:
        kind, ident, tier, tokens = row["subject_kind"], row["subject_id"], row["tier"], int(row["tokens"] or 0)
        quota = quotas.get(tier)
        if quota and tokens > NEAR * quota:
            near.append((kind, ident, tier, tokens, quota))
        requests = sum(int(row[m] or 0) for m in ("allowed", "throttled", "shed", "degraded"))
        if row["throttled"]:
            throttled.append((kind, ident, int(row["throttled"]), requests))
    near.sort(key=lambda r: r[3] / r[4], reverse=True)
    throttled.sort(key=lambda r: r[2], reverse=True)
    return Digest(day, near[:TOP], throttled[:TOP])


def send_digest(day: date | None = None) -> Digest:
    """Compute the digest and mail it to the site's ADMINS."""
    digest = near_limit_digest(day)
    mail_admins(f"Rate limiting digest {digest.day:%Y-%m-%d}", digest.render())
    return digest


def _daily_quotas() -> dict[str, int]:
    """Each enabled tier's quota scaled to one day, as the policies stand now.

    Read from a source of its own: the process's snapshot may be a day old in a Celery worker,
    which decides nothing and so never hears that policies changed.
    """
    daily = {}
    now_us = time.time_ns() // 1000
    for name, policies in build_policy_source().snapshot().tiers.items():
        for policy in policies:
            if policy.role is Role.QUOTA:
                # A quota by billing period: over the period in force (a month of 28 to 31 days), not
                # its longest, which only bounds how long its count is kept.
                span = policy.period.length_us(now_us) if policy.period is not None else policy.rate.period_us
                daily[name] = policy.rate.limit * 86_400_000_000 // span
    return daily
