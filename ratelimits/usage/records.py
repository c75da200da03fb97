"""Usage records: closed minutes of counters drained into ``UsageRecord`` rows, rolled up, purged.

The counters themselves are written by every decision in its own round trip
(:mod:`ratelimits.counters`), naming subjects by digest. Here they become rows exactly once,
whatever crashes, retries or duplicate deliveries happen, their digests turned back into the
labels the workers wrote (:mod:`.subjects`); hours and days are summed from minutes; old minutes
are purged.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Sum
from django.db.models.functions import Trunc

from ..backends import Backend, get_backend
from ..counters import METRICS, parse_field
from ..identity import Identity
from ..models import UsageBatch, UsageRecord
from . import subjects

__all__ = ["GRACE_S", "MAX_RANGE", "UNRESOLVED", "drain", "purge", "rollup", "today_usage"]

logger = logging.getLogger("ratelimits")

#: The longest range one query of usage rows may cover, per granularity (keeps pages and scans bounded).
MAX_RANGE = {"minute": timedelta(days=2), "hour": timedelta(days=31), "day": timedelta(days=366)}
#: A minute is drained this long after it closed, not before: the labels of its last subjects,
#: written about a second after their requests (:mod:`.subjects`), are in by then.
GRACE_S = 5.0
#: What a subject without a label is recorded as: its digest, after this.
UNRESOLVED = "digest:"


def drain(backend: Backend | None = None, *, now: float | None = None) -> int:
    """Move every closed minute's counters into ``UsageRecord`` rows, exactly once; return batches applied.

    Each batch is claimed atomically from the store, applied in one database transaction
    together with a ``UsageBatch`` row naming it, and only then forgotten by the store. A drain
    killed anywhere, retried, or delivered twice at once therefore neither loses nor
    double-counts a request: a batch the database already has is simply forgotten again, and
    of two drains applying the same batch the second fails on ``UsageBatch`` and rolls back.
    """
    backend = backend or get_backend()
    closed_before = int(((time.time() if now is None else now) - GRACE_S) // 60)
    applied = 0
    for batch, minute, counts in backend.claim_usage(closed_before):
        try:
            with transaction.atomic():
                if not UsageBatch.objects.filter(batch=batch).exists():
                    _apply(minute, counts)
                    UsageBatch.objects.create(batch=batch)
                    applied += 1
        except IntegrityError:
            if not UsageBatch.objects.filter(batch=batch).exists():
                continue  # raced another batch to a new row: nothing kept; the next drain retries it
            # else another drain applied this very batch: it is in the database
        backend.finish_usage(batch)
    return applied


def _apply(minute: int, counts: dict[str, int]) -> None:
    """Add one minute's counters to its rows (created as needed), the digests resolved to their labels."""
    start = datetime.fromtimestamp(minute * 60, tz=UTC)
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for field, count in counts.items():
        parsed = parse_field(field)
        if parsed is None or count <= 0:
            continue
        (kind, subject, organization, tier, endpoint), metric = parsed
        row = rows.setdefault((kind, subject, endpoint), {"organization": organization, "tier": tier})
        row[metric] = row.get(metric, 0) + count
    digests = {subject for _, subject, _ in rows}
    digests.update(row["organization"] for row in rows.values() if row["organization"])
    labels = {digest: value for digest, (_, value) in subjects.resolve(digests).items()}
    unresolved = digests - labels.keys()
    if unresolved:
        logger.warning(
            "ratelimits: %d subjects of usage minute %d have no label; recorded as %s<their digest>",
            len(unresolved),
            minute,
            UNRESOLVED,
        )
    for (kind, subject, endpoint), row in rows.items():
        if "allowed" in row:  # each allowed request spent one token, plus the extra counted apart
            row["tokens"] = row.get("tokens", 0) + row["allowed"]
        organization = _label(row["organization"], labels) if row["organization"] else ""
        where = {
            "granularity": "minute",
            "period_start": start,
            "subject_kind": kind,
            "subject_id": _label(subject, labels),
        }
        increments = {metric: row[metric] for metric in METRICS.values() if metric in row}
        updated = UsageRecord.objects.filter(**where, endpoint=endpoint).update(
            organization=organization,
            tier=row["tier"],
            **{metric: F(metric) + n for metric, n in increments.items()},
        )
        if not updated:
            UsageRecord.objects.create(
                **where, endpoint=endpoint, organization=organization, tier=row["tier"], **increments
            )


def _label(digest: str, labels: dict[str, str]) -> str:
    return labels.get(digest) or f"{UNRESOLVED}{digest}"


def rollup(*, now: datetime | None = None, window_hours: int = 48) -> int:
    """(Re)compute hourly rows from minute rows and daily rows from hourly rows; return rows written.

    Every closed hour (and day) of the last ``window_hours`` is recomputed from its parts and
    *set*, not added to, so running it twice, or after late counts arrived, gives the same rows.
    """
    now = now or datetime.now(tz=UTC)
    this_hour = now.replace(minute=0, second=0, microsecond=0)
    today = this_hour.replace(hour=0)
    since = this_hour - timedelta(hours=window_hours)
    written = 0
    plan = (("minute", "hour", "hour", this_hour), ("hour", "day", "day", today))
    for source, target, unit, closed_before in plan:
        sums = (
            UsageRecord.objects.filter(granularity=source, period_start__gte=since, period_start__lt=closed_before)
            .annotate(period=Trunc("period_start", unit, tzinfo=UTC))
            .values("period", "subject_kind", "subject_id", "endpoint")
            .annotate(**{m: Sum(m) for m in METRICS.values()})
        )
        with transaction.atomic():
            for values_row in sums:
                row: dict[str, Any] = dict(values_row)
                period: datetime = row["period"]
                key: dict[str, Any] = {k: row[k] for k in ("subject_kind", "subject_id", "endpoint")}
                latest = (
                    UsageRecord.objects.filter(granularity=source, **key, period_start__gte=period)
                    .order_by("-period_start")
                    .values("organization", "tier")
                    .first()
                ) or {"organization": "", "tier": ""}
                values: dict[str, Any] = {**latest, **{m: row[m] or 0 for m in METRICS.values()}}
                UsageRecord.objects.update_or_create(granularity=target, period_start=period, **key, defaults=values)
                written += 1
    return written


def purge(*, now: datetime | None = None, keep_minutes_for: timedelta = timedelta(days=2)) -> int:
    """Delete minute rows older than ``keep_minutes_for`` (hourly and daily rows are kept).

    Run it after :func:`rollup`, whose window (48 hours) covers the default retention: every
    minute row deleted here has been summed into its hour first.
    """
    cutoff = (now or datetime.now(tz=UTC)) - keep_minutes_for
    deleted, _ = UsageRecord.objects.filter(granularity="minute", period_start__lt=cutoff).delete()
    return deleted


def today_usage(identity: Identity) -> dict[str, int]:
    """The caller's usage since midnight UTC, as drained so far (the current minute is not in yet)."""
    midnight = datetime.now(tz=UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    caller = identity.caller
    sums = UsageRecord.objects.filter(
        subject_kind=caller.kind, subject_id=caller.value, granularity="minute", period_start__gte=midnight
    ).aggregate(**{m: Sum(m) for m in METRICS.values()})
    return {m: int(v or 0) for m, v in sums.items()}
