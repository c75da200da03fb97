"""Usage counting: per-minute counters written by the decision itself, drained into the database.

The decide script increments, in the same round trip, one hash per minute whose fields are
``<subject, organisation, tier, endpoint><metric>``: allowed, limited (429), shed (503),
degraded (decided without the store) and tokens spent. A drain moves closed minutes into
``UsageRecord`` rows exactly once, whatever crashes, retries or duplicate deliveries happen.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db.models.functions import Trunc

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["METRICS", "Usage", "drain", "purge", "rollup", "usage_for"]

#: Field suffix -> UsageRecord column. Tokens are counted as the allowed requests (one each) plus
#: ``x``, the tokens beyond one that costlier requests spent: one counter less on the hot path.
METRICS = {"a": "allowed", "l": "throttled", "s": "shed", "d": "degraded", "x": "tokens"}


class Usage(NamedTuple):
    """Where one request's usage is counted: the minute and the field prefix of its subject."""

    minute: int
    field: str
    tokens: int


def usage_for(kind: str, value: str, organization: str, tier: str, endpoint: str, tokens: int) -> Usage:
    """The usage of one request made now (minutes since the epoch on this process's clock)."""
    return Usage(int(time.time() // 60), _field(kind, value, organization, tier, endpoint), tokens)


@lru_cache(maxsize=65_536)
def _field(kind: str, value: str, organization: str, tier: str, endpoint: str) -> str:
    # JSON, because organisations and endpoints are the host's strings: no separator is safe.
    return json.dumps([kind, value, organization, tier, endpoint], separators=(",", ":"))


def parse_field(field: str) -> tuple[tuple[str, str, str, str, str], str] | None:
    """``(subject kind, id, organisation, tier, endpoint), metric column`` of a counter field."""
    metric = METRICS.get(field[-1:])
    if metric is None:
        return None
    try:
        parts = json.loads(field[:-1])
    except ValueError:
        return None
    if not isinstance(parts, list) or len(parts) != 5 or not all(isinstance(p, str) for p in parts):
        return None
    return (parts[0], parts[1], parts[2], parts[3], parts[4]), metric


def drain(backend: Backend | None = None, *, now: float | None = None) -> int:
    """Move every closed minute's counters into ``UsageRecord`` rows, exactly once; return batches applied.

    Each batch is claimed atomically from the store, applied in one database transaction
    together with a ``UsageBatch`` row naming it, and only then forgotten by the store. A drain
    killed anywhere, retried, or delivered twice at once therefore neither loses nor
    double-counts a request: a batch the database already has is simply forgotten again, and
    of two drains applying the same batch the second fails on ``UsageBatch`` and rolls back.
    """
    from django.db import IntegrityError, transaction

    from .engine import get_limiter
    from .models import UsageBatch

    backend = backend or get_limiter().backend
    current = int((time.time() if now is None else now) // 60)
    applied = 0
    for batch, minute, counts in backend.claim_usage(current):
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
    """Add one minute's counters to its rows (created as needed)."""
    from django.db.models import F

    from .models import UsageRecord

    start = datetime.fromtimestamp(minute * 60, tz=UTC)
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for field, count in counts.items():
        parsed = parse_field(field)
        if parsed is None or count <= 0:
            continue
        (kind, value, organization, tier, endpoint), metric = parsed
        row = rows.setdefault((kind, value, endpoint), {"organization": organization, "tier": tier})
        row[metric] = row.get(metric, 0) + count
    for (kind, value, endpoint), row in rows.items():
        if "allowed" in row:  # each allowed request spent one token, plus the extra counted apart
            row["tokens"] = row.get("tokens", 0) + row["allowed"]
        where = {"granularity": "minute", "period_start": start, "subject_kind": kind, "subject_id": value}
        increments = {metric: row[metric] for metric in METRICS.values() if metric in row}
        updated = UsageRecord.objects.filter(**where, endpoint=endpoint).update(
            organization=row["organization"],
            tier=row["tier"],
            **{metric: F(metric) + n for metric, n in increments.items()},
        )
        if not updated:
            UsageRecord.objects.create(
                **where, endpoint=endpoint, organization=row["organization"], tier=row["tier"], **increments
            )


def rollup(*, now: datetime | None = None, window_hours: int = 48) -> int:
    """(Re)compute hourly rows from minute rows and daily rows from hourly rows; return rows written.

    Every closed hour (and day) of the last ``window_hours`` is recomputed from its parts and
    *set*, not added to, so running it twice, or after late counts arrived, gives the same rows.
    """
    from django.db import transaction
    from django.db.models import Sum

    from .models import UsageRecord

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
    from .models import UsageRecord

    cutoff = (now or datetime.now(tz=UTC)) - keep_minutes_for
    deleted, _ = UsageRecord.objects.filter(granularity="minute", period_start__lt=cutoff).delete()
    return deleted
