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
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import IntegrityError, NotSupportedError, connection, transaction
from django.db.models import Sum
from django.db.models.functions import Trunc

from ..backends import UsageSupport, get_backend
from ..counters import EXTRA_TOKENS, METRICS, OVERFLOW, parse_row
from ..metrics import get_recorder
from ..models import UsageBatch, UsageRecord
from . import subjects
from .subjects import chunks, max_params

__all__ = [
    "GRACE_S",
    "LEASE_S",
    "MAX_RANGE",
    "OVERFLOW",
    "UNRESOLVED",
    "drain",
    "purge",
    "rollup",
    "usage_rows",
]

logger = logging.getLogger("ratelimits")

#: The longest range one query of usage rows may cover, per granularity (keeps pages and scans bounded).
MAX_RANGE = {"minute": timedelta(days=2), "hour": timedelta(days=31), "day": timedelta(days=366)}
#: A minute is drained this long after it closed, not before: the labels of its last subjects,
#: written about a second after their requests (:mod:`.subjects`), are in by then.
GRACE_S = 5.0
#: How long a drain holds the batch it applies: far longer than applying the most rows a minute
#: counts takes (docs/usage.md has the figures). Another drain takes the batch over after that.
LEASE_S = 30.0
#: What a subject without a label is recorded as: its digest, after this.
UNRESOLVED = "digest:"

_COLUMNS = ("granularity", "period_start", "subject_kind", "subject_id", "endpoint", "organization", "tier")
_KEY = ("granularity", "period_start", "subject_kind", "subject_id", "endpoint")  # the rows' unique constraint
_COUNTS = tuple(METRICS.values())


def drain(backend: UsageSupport | None = None, *, now: float | None = None) -> int:
    """Move every closed minute's counters into ``UsageRecord`` rows, exactly once; return batches applied.

    Each batch is claimed atomically from the store, leased (no other drain is handed it while
    this one applies it), applied in one database transaction together with a ``UsageBatch`` row
    naming it, and only then forgotten by the store. A drain killed anywhere, retried, or
    delivered twice at once therefore neither loses nor double-counts a request: a batch the
    database already has is simply forgotten again; a batch whose drain died is taken by another
    once its lease runs out; and should two drains still apply the same batch at once, the second
    fails on ``UsageBatch`` and rolls back.

    A backend without usage counters (no :class:`~ratelimits.backends.UsageSupport`) has nothing
    to drain: 0 (``manage.py check`` refuses ``USAGE`` on with it, ``ratelimits.E183``).
    """
    if backend is None:
        configured = get_backend()
        if not isinstance(configured, UsageSupport):
            return 0
        backend = configured
    now = time.time() if now is None else now
    closed_before = int((now - GRACE_S) // 60)
    applied = 0
    claimed = backend.claim_usage(closed_before)
    for batch, minute in claimed:
        counts = backend.lease_usage(batch, LEASE_S)
        if counts is None:
            continue  # another drain is applying it (or has just finished)
        try:
            with transaction.atomic():
                if not UsageBatch.objects.filter(batch=batch).exists():
                    _apply(minute, counts)
                    UsageBatch.objects.create(batch=batch)
                    applied += 1
        except IntegrityError:
            if not UsageBatch.objects.filter(batch=batch).exists():
                raise
            # Another drain applied this very batch (it took it over when our lease ran out): it is
            # in the database.
        backend.finish_usage(batch)
    recorder = get_recorder()
    if recorder is not None:
        # How far behind the drain was: the oldest minute it was handed had closed this long ago.
        oldest = min((minute for _, minute in claimed), default=None)
        recorder.set_gauge("ratelimits_usage_drain_lag_seconds", 0.0 if oldest is None else now - (oldest + 1) * 60)
        recorder.set_gauge("ratelimits_usage_drained_at_seconds", time.time())
    return applied


def _apply(minute: int, counts: dict[str, int]) -> None:
    """Add one minute's counters to its rows (created as needed), the digests resolved to their labels."""
    records, unresolved = usage_rows(counts)
    if unresolved:
        logger.warning(
            "ratelimits: %d subjects of usage minute %d have no label; recorded as %s<their digest>",
            len(unresolved),
            minute,
            UNRESOLVED,
        )
    start = UsageRecord._meta.get_field("period_start").get_db_prep_value(
        datetime.fromtimestamp(minute * 60, tz=UTC), connection
    )
    # Sorted as the unique index is: two drains upserting the same rows lock them in one order, and
    # the index is written in order.
    _add_records(
        [
            (
                "minute",
                start,
                kind,
                subject,
                endpoint,
                values["organization"],
                values["tier"],
                *(values.get(m, 0) for m in _COUNTS),
            )
            for (kind, subject, endpoint), values in sorted(records.items())
        ]
    )


def usage_rows(counts: Mapping[str, int]) -> tuple[dict[tuple[str, str, str], dict[str, Any]], set[str]]:
    """One minute's counters as the ``UsageRecord`` rows they make, and the digests that have no label.

    Rows are keyed ``(subject kind, subject, endpoint)``, as they are unique; each holds its
    ``organization``, ``tier`` and the metric columns it counted, ``tokens`` included. Digests
    are resolved to the labels the workers wrote; a row whose digest has none is under
    ``digest:<digest>`` (:data:`UNRESOLVED`).
    """
    by_row: dict[str, dict[str, int]] = {}  # counter row -> metric column -> count
    for field, count in counts.items():
        metric = METRICS.get(field[-1:])
        # Tokens beyond one a request may be fewer than none: requests a settlement gave back
        # (docs/charging.md), never more than the row's own.
        if metric is not None and (count > 0 or (count < 0 and field[-1:] == EXTRA_TOKENS)):
            metrics = by_row.setdefault(field[:-1], {})
            metrics[metric] = metrics.get(metric, 0) + count
    parsed = [(row, by_row[text]) for text in by_row if (row := parse_row(text)) is not None]
    digests = {row.subject for row, _ in parsed if row.kind != OVERFLOW}
    digests.update(row.organization for row, _ in parsed if row.organization)
    labels = {digest: value for digest, (_, value) in subjects.resolve(digests).items()}
    # Keyed as the rows are unique: two digests of one subject (the hash key changed) are one row.
    records: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row, metrics in parsed:
        subject = row.subject if row.kind == OVERFLOW else _label(row.subject, labels)
        organization = _label(row.organization, labels) if row.organization else ""
        values = records.setdefault((row.kind, subject, row.endpoint), {"organization": organization, "tier": row.tier})
        for metric, count in metrics.items():
            values[metric] = values.get(metric, 0) + count
    for values in records.values():  # each allowed request spent one token, plus the extra counted apart
        values["tokens"] = max(values.get("tokens", 0) + values.get("allowed", 0), 0)
    return records, digests - labels.keys()


def _label(digest: str, labels: dict[str, str]) -> str:
    return labels.get(digest) or f"{UNRESOLVED}{digest}"


def _add_records(records: list[tuple[Any, ...]]) -> None:
    """Add counts to their ``UsageRecord`` rows, creating them as needed, with ``INSERT ... ON CONFLICT``.

    ``records`` hold the database values of :data:`_COLUMNS` then :data:`_COUNTS` (the model's
    field names are its columns). A row already there gets the counts added, and takes this
    batch's organisation and tier, as the drain always did.
    """
    if not records:
        return
    if not connection.features.supports_update_conflicts_with_target:
        raise NotSupportedError(f"the usage drain needs INSERT ... ON CONFLICT, which {connection.vendor} lacks")
    quote = connection.ops.quote_name
    table = quote(UsageRecord._meta.db_table)
    names = (*_COLUMNS, *_COUNTS)
    columns = [quote(name) for name in names]
    updates = [f"{c} = EXCLUDED.{c}" for c in columns[len(_KEY) : len(_COLUMNS)]]
    updates += [f"{c} = {table}.{c} + EXCLUDED.{c}" for c in columns[len(_COLUMNS) :]]
    insert = f"INSERT INTO {table} ({', '.join(columns)}) "
    on_conflict = f" ON CONFLICT ({', '.join(quote(name) for name in _KEY)}) DO UPDATE SET {', '.join(updates)}"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One statement of one array per column: a list of VALUES as long would take the
            # driver longer to bind than the server takes to run it.
            arrays = ", ".join(f"%s::{UsageRecord._meta.get_field(name).db_type(connection)}[]" for name in names)
            cursor.execute(
                f"{insert}SELECT * FROM unnest({arrays}){on_conflict}", [list(c) for c in zip(*records, strict=True)]
            )
            return
        row = f"({', '.join(['%s'] * len(columns))})"
        for chunk in chunks(records, max_params(len(columns))):
            values = ", ".join([row] * len(chunk))
            cursor.execute(f"{insert}VALUES {values}{on_conflict}", [v for record in chunk for v in record])


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
    # A day is summed from all of its hours, those before the window too: set from only the hours
    # inside it, the day the window starts in would lose the rest of its total.
    plan = (("minute", "hour", "hour", since, this_hour), ("hour", "day", "day", since.replace(hour=0), today))
    for source, target, unit, start, closed_before in plan:
        sums = (
            UsageRecord.objects.filter(granularity=source, period_start__gte=start, period_start__lt=closed_before)
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
