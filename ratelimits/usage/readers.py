"""One truth for every reader of usage: the admin's report and its CSVs, ``GET /v1/usage``, ``today``.

Usage rows are drained per minute, then rolled up into hours and days
(:mod:`ratelimits.usage.records`). A period is read from its own rows once the roll-up wrote them,
and summed from the finer rows until then (:func:`coverage`), so the hour under way is there too.
The minutes not drained yet come from the store (:mod:`.live`): every reader takes them as
``live`` rows and counts them in, marked live. :func:`time_series` (totals per period) and
:func:`endpoint_series` (per period, endpoint and tier) are those rows summed; the admin's report
(:mod:`ratelimits.reports.queries`), the customer API (:class:`ratelimits.views.UsageView`) and ``/v1/rate_limit``'s
``today`` (:func:`today_usage`) read them, so each tells the same counts for the same range.
Times are UTC throughout.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import F, Max, Q, QuerySet, Sum
from django.db.models.functions import Trunc

from ..identity import Subject, SubjectKind
from ..models import UsageRecord
from ..periods import BillingPeriod
from .live import LiveRow, read_live

__all__ = [
    "OUTCOMES",
    "SOURCES",
    "STEPS",
    "SUMS",
    "TOTALS",
    "EndpointPeriod",
    "Period",
    "QuotaPeriod",
    "ReportFilters",
    "caller_filters",
    "coverage",
    "endpoint_series",
    "floor_period",
    "grouped_usage",
    "live_rows",
    "period_bounds",
    "period_starts",
    "quota_periods",
    "rolled_up_until",
    "time_series",
    "today_usage",
    "usage_records",
]

#: The request outcomes, in the order the chart stacks them (bottom first).
OUTCOMES = ("allowed", "throttled", "shed", "degraded")
TOTALS = (*OUTCOMES, "tokens")

STEPS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
#: The rows each granularity's periods are read from, coarsest first: its own, once the roll-up
#: wrote them, and until then the finer ones they are summed from.
SOURCES = {"minute": ("minute",), "hour": ("hour", "minute"), "day": ("day", "hour", "minute")}


@dataclass(frozen=True, slots=True)
class ReportFilters:
    """Which rows a report covers: ``granularity`` rows whose period starts in ``[start, end)``."""

    start: datetime
    end: datetime
    granularity: str = "hour"
    subject_kind: str = ""
    subject_id: str = ""
    tier: str = ""
    endpoint: str = ""
    organization: str = ""


@dataclass(frozen=True, slots=True)
class Period:
    """The totals of one period (zeros when nothing was recorded in it).

    ``live``: some of them were read from the store's counters, not drained yet (:mod:`.live`).
    """

    start: datetime
    allowed: int = 0
    throttled: int = 0
    shed: int = 0
    degraded: int = 0
    tokens: int = 0
    live: bool = False

    @property
    def requests(self) -> int:
        return self.allowed + self.throttled + self.shed + self.degraded


def usage_records(filters: ReportFilters) -> QuerySet[UsageRecord]:
    """The rows of the range's periods that ``filters`` select (:func:`coverage`), unordered (ready to be grouped)."""
    first, until = period_bounds(filters)
    rows = UsageRecord.objects.filter(coverage(filters.granularity), period_start__gte=first, period_start__lt=until)
    if filters.subject_kind:
        rows = rows.filter(subject_kind=filters.subject_kind, subject_id=filters.subject_id)
    if filters.tier:
        rows = rows.filter(tier=filters.tier)
    if filters.endpoint:
        rows = rows.filter(endpoint=filters.endpoint)
    if filters.organization:
        rows = rows.filter(organization=filters.organization)
    return rows.order_by()


def live_rows(live: Iterable[LiveRow], filters: ReportFilters) -> list[LiveRow]:
    """The live rows of the range's periods that ``filters`` select, as :func:`usage_records` selects rows."""
    first, until = period_bounds(filters)
    return [
        row
        for row in live
        if first <= row.period_start < until
        and (
            not filters.subject_kind or (row.subject_kind, row.subject_id) == (filters.subject_kind, filters.subject_id)
        )
        and (not filters.tier or row.tier == filters.tier)
        and (not filters.endpoint or row.endpoint == filters.endpoint)
        and (not filters.organization or row.organization == filters.organization)
    ]


def rolled_up_until(granularity: str) -> datetime | None:
    """Where the last period of ``granularity`` the roll-up wrote ends (``None``: it wrote none)."""
    latest = UsageRecord.objects.filter(granularity=granularity).aggregate(latest=Max("period_start"))["latest"]
    return None if latest is None else latest + STEPS[granularity]


def coverage(granularity: str) -> Q:
    """Which rows stand for which moments in a report of ``granularity``: each moment is read from one granularity.

    The roll-up writes closed periods oldest first, and every one of them that counted anything
    (:func:`~.records.rollup`): up to where the last one it wrote ends, a period's own rows are
    all it had. After that, the periods are summed from the next finer rows, up to where the
    roll-up got with those, and so on down to the minutes. A minute is therefore never counted
    twice, in its rolled-up hour and again on its own. Decided for every subject at once, so a
    filtered report adds up to the unfiltered one.
    """
    parts: list[Q] = []
    since: datetime | None = None  # where the coarser rows read so far end
    *coarser, finest = SOURCES[granularity]
    for level in coarser:
        until = rolled_up_until(level)
        if until is not None and (since is None or until > since):
            parts.append(Q(granularity=level, period_start__lt=until) & _from(since))
            since = until
    parts.append(Q(granularity=finest) & _from(since))
    return functools.reduce(operator.or_, parts)


def _from(since: datetime | None) -> Q:
    return Q() if since is None else Q(period_start__gte=since)


def grouped_usage(rows: QuerySet[UsageRecord], *fields: str) -> QuerySet[UsageRecord, dict[str, Any]]:
    """``rows`` grouped by ``fields``, with the sums ``n_<metric>`` of every metric and ``n_requests``."""
    summed: QuerySet[UsageRecord, dict[str, Any]] = rows.values(*fields).annotate(
        n_allowed=Sum("allowed"),
        n_throttled=Sum("throttled"),
        n_shed=Sum("shed"),
        n_degraded=Sum("degraded"),
        n_tokens=Sum("tokens"),
    )
    return summed.annotate(n_requests=F("n_allowed") + F("n_throttled") + F("n_shed") + F("n_degraded"))


#: The sums of a grouped row (:func:`grouped_usage`), ``n_requests`` aside.
SUMS = tuple(f"n_{metric}" for metric in TOTALS)


def floor_period(moment: datetime, granularity: str) -> datetime:
    """The start of the (UTC) period of ``granularity`` containing ``moment``."""
    moment = moment.astimezone(UTC).replace(second=0, microsecond=0)
    if granularity in ("hour", "day"):
        moment = moment.replace(minute=0)
    if granularity == "day":
        moment = moment.replace(hour=0)
    return moment


def _ceil_period(moment: datetime, granularity: str) -> datetime:
    """The start of the first period of ``granularity`` starting at or after ``moment``."""
    floor = floor_period(moment, granularity)
    return floor if floor == moment else floor + STEPS[granularity]


def period_bounds(filters: ReportFilters) -> tuple[datetime, datetime]:
    """Where the range's first period starts and where its last one ends.

    A period is in the range when it starts at or after ``start`` and before ``end``; all of it
    is, the minutes it is summed from included.
    """
    return _ceil_period(filters.start, filters.granularity), _ceil_period(filters.end, filters.granularity)


def period_starts(filters: ReportFilters) -> list[datetime]:
    """Every period of the range: starting at or after ``start``, before ``end``."""
    step = STEPS[filters.granularity]
    moment, until = period_bounds(filters)
    starts = []
    while moment < until:
        starts.append(moment)
        moment += step
    return starts


def time_series(filters: ReportFilters, live: Sequence[LiveRow] = ()) -> list[Period]:
    """The totals of every period of the range, oldest first, empty periods included."""
    totals: dict[datetime, dict[str, int]] = {}
    # Truncated in the database: the periods not rolled up yet are summed from many finer rows.
    periods = usage_records(filters).annotate(period=Trunc("period_start", filters.granularity, tzinfo=UTC))
    for row in grouped_usage(periods, "period"):
        period = totals.setdefault(row["period"], dict.fromkeys(TOTALS, 0))
        for metric in TOTALS:
            period[metric] += int(row[f"n_{metric}"] or 0)
    counted_live: set[datetime] = set()
    for live_row in live_rows(live, filters):
        start = floor_period(live_row.period_start, filters.granularity)
        period = totals.setdefault(start, dict.fromkeys(TOTALS, 0))
        for metric in TOTALS:
            period[metric] += getattr(live_row, metric)
        counted_live.add(start)
    return [Period(start, **totals.get(start, {}), live=start in counted_live) for start in period_starts(filters)]


@dataclass(frozen=True, slots=True)
class EndpointPeriod(Period):
    """One period's usage of one endpoint, under one tier."""

    endpoint: str = ""
    tier: str = ""


def endpoint_series(filters: ReportFilters, live: Sequence[LiveRow] = ()) -> list[EndpointPeriod]:
    """The periods of the range that counted anything, per endpoint and tier, oldest first.

    The rows :func:`time_series` sums, grouped finer: the two add up to the same totals.
    """
    groups: dict[tuple[datetime, str, str], dict[str, int]] = {}
    periods = usage_records(filters).annotate(period=Trunc("period_start", filters.granularity, tzinfo=UTC))
    for row in grouped_usage(periods, "period", "endpoint", "tier"):
        group = groups.setdefault((row["period"], row["endpoint"], row["tier"]), dict.fromkeys(TOTALS, 0))
        for metric in TOTALS:
            group[metric] += int(row[f"n_{metric}"] or 0)
    counted_live: set[tuple[datetime, str, str]] = set()
    for live_row in live_rows(live, filters):
        key = (floor_period(live_row.period_start, filters.granularity), live_row.endpoint, live_row.tier)
        group = groups.setdefault(key, dict.fromkeys(TOTALS, 0))
        for metric in TOTALS:
            group[metric] += getattr(live_row, metric)
        counted_live.add(key)
    return [
        EndpointPeriod(
            start,
            **groups[start, endpoint, tier],
            live=(start, endpoint, tier) in counted_live,
            endpoint=endpoint,
            tier=tier,
        )
        for start, endpoint, tier in sorted(groups)
    ]


def caller_filters(caller: Subject, start: datetime, end: datetime, granularity: str) -> ReportFilters:
    """A report of one caller's usage (the subject its rows are labelled with)."""
    return ReportFilters(start, end, granularity, subject_kind=caller.kind, subject_id=caller.value)


def today_usage(caller: Subject, *, now: datetime | None = None) -> dict[str, int]:
    """``caller``'s usage since midnight UTC, the minutes not drained yet included: the day's :func:`time_series`."""
    now = now or datetime.now(tz=UTC)
    midnight = floor_period(now, "day")
    filters = caller_filters(caller, midnight, midnight + STEPS["day"], "day")
    live = read_live(midnight, now + STEPS["minute"], caller=caller, now=now.timestamp())
    [day] = time_series(filters, live.rows)
    return {metric: getattr(day, metric) for metric in TOTALS}


@dataclass(frozen=True, slots=True)
class QuotaPeriod:
    """A caller's usage against its quota in one billing period."""

    start: datetime
    end: datetime
    quota: int
    #: Tokens the caller's admitted requests spent in it (what the quota counts).
    used: int
    #: Some of it was read from the store's counters, not drained yet: it may still grow.
    live: bool = False

    @property
    def remaining(self) -> int:
        return max(self.quota - self.used, 0)

    @property
    def overage(self) -> int:
        """What a soft quota admitted past the quota (a hard one refuses it: 0, but for requests
        decided without the store, which no quota counted)."""
        return max(self.used - self.quota, 0)


#: The most billing periods one read may cover (a year of months).
MAX_QUOTA_PERIODS = 12


def quota_periods(
    subject: Subject, period: BillingPeriod, quota: int, *, count: int = 3, now: datetime | None = None
) -> list[QuotaPeriod]:
    """``subject``'s usage against ``quota`` in its last ``count`` billing periods, the current one last.

    ``subject``: the quota's (a caller, or an organisation placed on the tier: its callers' usage
    together). Read from the hourly rows (and the minutes not drained yet), as every reader of
    usage reads: a period is summed from the hours that start in it, so a bound off the hour (an
    anchor at 09:30, a zone half an hour off UTC) counts from the hour it falls in.
    """
    now = now or datetime.now(tz=UTC)
    starts = [period.start(now)]
    while len(starts) < min(count, MAX_QUOTA_PERIODS):
        starts.insert(0, period.start(starts[0] - timedelta(microseconds=1)))
    ends = [*starts[1:], period.next_start(now)]
    first, until = floor_period(starts[0], "hour"), floor_period(now, "hour") + STEPS["hour"]
    if subject.kind == SubjectKind.ORG:
        filters = ReportFilters(first, until, "hour", organization=subject.value)
        live = read_live(first, until, now=now.timestamp())
    else:
        filters = caller_filters(subject, first, until, "hour")
        live = read_live(first, until, caller=subject, now=now.timestamp())
    hours = time_series(filters, live.rows)
    found = []
    for start, end in zip(starts, ends, strict=True):
        first, last = floor_period(start, "hour"), floor_period(end, "hour")
        inside = [hour for hour in hours if first <= hour.start < last]
        used = sum(hour.tokens for hour in inside)
        found.append(QuotaPeriod(start, end, quota, used, any(hour.live for hour in inside)))
    return found
