"""The usage report's queries: totals per period, top consumers, the most throttled, as bounded tables.

Everything here reads ``UsageRecord`` rows (drained, then rolled up into hours and days by
:mod:`ratelimits.usage.records`): the current minute, and an hour or day not rolled up yet, are
not in. Every query is a plain function of :class:`ReportFilters`; every table is bounded
(:data:`TABLE_LIMIT` rows). Times are UTC throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import F, FloatField, Q, QuerySet, Sum
from django.db.models.functions import Cast, NullIf
from django.urls import reverse

from ..identity import SubjectKind
from ..models import UsageRecord
from .records import MAX_RANGE, OVERFLOW, UNRESOLVED
from .text import csv_text, display_text

__all__ = [
    "MAX_RANGE",
    "TABLES",
    "TABLE_LIMIT",
    "Caveats",
    "Period",
    "ReportFilters",
    "Table",
    "caveats",
    "effective_policy_url",
    "grouped_usage",
    "near_limit",
    "series_table",
    "throttled_endpoints",
    "throttled_subjects",
    "time_series",
    "top_consumers",
    "usage_records",
]

#: The request outcomes, in the order the chart stacks them (bottom first).
OUTCOMES = ("allowed", "throttled", "shed", "degraded")
TOTALS = (*OUTCOMES, "tokens")
#: Rows per table.
TABLE_LIMIT = 20
#: The kinds of subject usage is counted for: the caller (API key, else user, else client IP).
CALLER_KINDS = (SubjectKind.API_KEY, SubjectKind.USER, SubjectKind.IP)
STEPS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
DEFAULT_RANGE = timedelta(hours=24)


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
    """The totals of one period (zeros when nothing was recorded in it)."""

    start: datetime
    allowed: int = 0
    throttled: int = 0
    shed: int = 0
    degraded: int = 0
    tokens: int = 0

    @property
    def requests(self) -> int:
        return self.allowed + self.throttled + self.shed + self.degraded


def usage_records(filters: ReportFilters) -> QuerySet[UsageRecord]:
    """The rows ``filters`` select, unordered (ready to be grouped)."""
    rows = UsageRecord.objects.filter(
        granularity=filters.granularity, period_start__gte=filters.start, period_start__lt=filters.end
    )
    if filters.subject_kind:
        rows = rows.filter(subject_kind=filters.subject_kind, subject_id=filters.subject_id)
    if filters.tier:
        rows = rows.filter(tier=filters.tier)
    if filters.endpoint:
        rows = rows.filter(endpoint=filters.endpoint)
    if filters.organization:
        rows = rows.filter(organization=filters.organization)
    return rows.order_by()


@dataclass(frozen=True, slots=True)
class Caveats:
    """Requests of the range the report cannot name a subject of.

    ``overflow``: counted in an overflow row (kind ``overflow``, the callers' kind as its subject),
    because their minute already counted ``USAGE_MAX_SUBJECTS`` rows. ``unresolved``: recorded
    under a subject's digest (``digest:...``), because its label was not in the database when the
    minute was drained.
    """

    overflow: int = 0
    unresolved: int = 0


def caveats(filters: ReportFilters) -> Caveats:
    """How many requests of the range are in overflow rows, and how many under a digest."""
    requests = F("allowed") + F("throttled") + F("shed") + F("degraded")
    unresolved = Q(subject_id__startswith=UNRESOLVED) | Q(organization__startswith=UNRESOLVED)
    sums = usage_records(filters).aggregate(
        overflow=Sum(requests, filter=Q(subject_kind=OVERFLOW)),
        unresolved=Sum(requests, filter=unresolved & ~Q(subject_kind=OVERFLOW)),
    )
    return Caveats(int(sums["overflow"] or 0), int(sums["unresolved"] or 0))


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


def floor_period(moment: datetime, granularity: str) -> datetime:
    """The start of the (UTC) period of ``granularity`` containing ``moment``."""
    moment = moment.astimezone(UTC).replace(second=0, microsecond=0)
    if granularity in ("hour", "day"):
        moment = moment.replace(minute=0)
    if granularity == "day":
        moment = moment.replace(hour=0)
    return moment


def period_starts(filters: ReportFilters) -> list[datetime]:
    """Every period of the range: starting at or after ``start``, before ``end``."""
    step = STEPS[filters.granularity]
    moment = floor_period(filters.start, filters.granularity)
    if moment < filters.start:
        moment += step
    starts = []
    while moment < filters.end:
        starts.append(moment)
        moment += step
    return starts


def time_series(filters: ReportFilters) -> list[Period]:
    """The totals of every period of the range, oldest first, empty periods included."""
    totals: dict[datetime, dict[str, int]] = {}
    grouped = grouped_usage(usage_records(filters), "period_start")
    for row in grouped:
        start = floor_period(row["period_start"], filters.granularity)
        period = totals.setdefault(start, dict.fromkeys(TOTALS, 0))
        for metric in TOTALS:
            period[metric] += int(row[f"n_{metric}"] or 0)
    return [Period(start, **totals.get(start, {})) for start in period_starts(filters)]


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    label: str
    numeric: bool = True


@dataclass(frozen=True, slots=True)
class Cell:
    text: str
    numeric: bool
    href: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    """A report table: its rows are dicts keyed by column (plus ``links``: column -> URL)."""

    name: str
    title: str
    description: str
    columns: tuple[Column, ...]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def header(self) -> list[str]:
        return [column.label for column in self.columns]

    def csv_rows(self) -> list[list[str]]:
        """The rows as the CSV export writes them (header not included)."""
        return [[csv_text(row[column.key]) for column in self.columns] for row in self.rows]

    def cells(self) -> list[list[Cell]]:
        """The rows as the page shows them."""
        return [
            [Cell(display_text(row[c.key]), c.numeric, row.get("links", {}).get(c.key, "")) for c in self.columns]
            for row in self.rows
        ]


COUNT_COLUMNS = (
    Column("requests", "Requests"),
    Column("allowed", "Allowed"),
    Column("throttled", "Throttled (429)"),
    Column("shed", "Shed (503)"),
    Column("degraded", "Degraded"),
    Column("tokens", "Tokens"),
)
SHARE_COLUMN = Column("throttled_share", "Throttled share")
SUBJECT_COLUMNS = (
    Column("subject_kind", "Kind", numeric=False),
    Column("subject_id", "Subject", numeric=False),
    Column("organization", "Organisation", numeric=False),
    Column("endpoint", "Endpoint", numeric=False),
    *COUNT_COLUMNS,
    SHARE_COLUMN,
)
ENDPOINT_COLUMNS = (Column("endpoint", "Endpoint", numeric=False), *COUNT_COLUMNS, SHARE_COLUMN)
SERIES_COLUMNS = (Column("period_start", "Period start (UTC)", numeric=False), *COUNT_COLUMNS)


def series_table(series: Sequence[Period]) -> Table:
    """The time series as a table (the chart's data, and its CSV export)."""
    rows = [{"period_start": p.start, "requests": p.requests, **{m: getattr(p, m) for m in TOTALS}} for p in series]
    return Table("series", "Requests per period", "Every period of the range, oldest first.", SERIES_COLUMNS, rows)


def _counts(row: dict[str, Any]) -> dict[str, Any]:
    counts = {metric: int(row[f"n_{metric}"] or 0) for metric in TOTALS}
    requests = sum(counts[m] for m in OUTCOMES)
    return {"requests": requests, **counts, "throttled_share": counts["throttled"] / requests if requests else 0.0}


def _share() -> Any:
    return Cast(F("n_throttled"), FloatField()) / NullIf(Cast(F("n_requests"), FloatField()), 0.0)


def _subject_table(
    filters: ReportFilters, name: str, title: str, description: str, order: Sequence[str], *, throttled: bool, hint: str
) -> Table:
    """Subjects grouped over the range, in descending ``order``; each links to its effective policy."""
    grouped = grouped_usage(usage_records(filters), "subject_kind", "subject_id").annotate(share=_share())
    if throttled:
        grouped = grouped.filter(Q(n_throttled__gt=0))
    found = list(
        grouped.order_by(*(F(name).desc(nulls_last=True) for name in order), "subject_kind", "subject_id")[:TABLE_LIMIT]
    )
    hints = _endpoint_hints(filters, [(r["subject_kind"], r["subject_id"]) for r in found], hint)
    rows = []
    for row in found:
        key = (row["subject_kind"], row["subject_id"])
        endpoint, organization = hints.get(key, ("", ""))
        link = effective_policy_url(key[0], key[1], endpoint=endpoint, organization=organization)
        rows.append(
            {
                "subject_kind": key[0],
                "subject_id": key[1],
                "organization": organization,
                "endpoint": endpoint,
                **_counts(row),
                "links": {"subject_id": link} if link else {},
            }
        )
    return Table(name, title, description, SUBJECT_COLUMNS, rows)


def _endpoint_hints(
    filters: ReportFilters, subjects: Sequence[tuple[str, str]], metric: str
) -> dict[tuple[str, str], tuple[str, str]]:
    """Each subject's endpoint with the most ``metric`` in the range, and its organisation."""
    if not subjects:
        return {}
    which = Q()
    for kind, value in subjects:
        which |= Q(subject_kind=kind, subject_id=value)
    grouped = grouped_usage(
        usage_records(filters).filter(which), "subject_kind", "subject_id", "endpoint", "organization"
    )
    candidates = sorted(
        (
            (row["subject_kind"], row["subject_id"]),
            -int(row[f"n_{metric}"] or 0),
            row["endpoint"],
            row["organization"],
        )
        for row in grouped
    )
    hints: dict[tuple[str, str], tuple[str, str]] = {}
    organizations: dict[tuple[str, str], str] = {}
    for key, _, endpoint, organization in candidates:  # the most first; on a tie, by endpoint name
        hints.setdefault(key, (endpoint, organization))
        if organization:
            organizations.setdefault(key, organization)
    return {key: (endpoint, org or organizations.get(key, "")) for key, (endpoint, org) in hints.items()}


def top_consumers(filters: ReportFilters, by: str = "requests") -> Table:
    """The subjects with the most requests (or tokens) in the range."""
    if by not in ("requests", "tokens"):
        raise ValueError(f"rank consumers by requests or tokens, not {by!r}")
    order = ("n_requests", "n_tokens") if by == "requests" else ("n_tokens", "n_requests")
    return _subject_table(
        filters,
        "top_consumers",
        f"Top consumers by {by}",
        f"The {TABLE_LIMIT} subjects with the most {by}; the endpoint is the one each used most.",
        order,
        throttled=False,
        hint=by,
    )


def throttled_subjects(filters: ReportFilters, by: str = "requests") -> Table:
    """The subjects refused with 429 most often in the range."""
    return _subject_table(
        filters,
        "throttled_subjects",
        "Most throttled subjects",
        f"The {TABLE_LIMIT} subjects with the most 429s; the endpoint is where each was throttled most.",
        ("n_throttled", "n_requests"),
        throttled=True,
        hint="throttled",
    )


def near_limit(filters: ReportFilters, by: str = "requests") -> Table:
    """Subjects throttled at least once, highest share of their requests throttled first."""
    return _subject_table(
        filters,
        "near_limit",
        "Near the limit",
        "Subjects throttled at least once in the range, by the share of their requests refused with 429 "
        "(a subject near its limit is refused now and then; one far over it, most of the time).",
        ("share", "n_throttled"),
        throttled=True,
        hint="throttled",
    )


def throttled_endpoints(filters: ReportFilters, by: str = "requests") -> Table:
    """The endpoints refusing the most requests with 429 in the range."""
    grouped = grouped_usage(usage_records(filters), "endpoint")
    order = (F("n_throttled").desc(), F("n_requests").desc(), "endpoint")
    found = grouped.filter(Q(n_throttled__gt=0)).order_by(*order)[:TABLE_LIMIT]
    rows = [{"endpoint": row["endpoint"], **_counts(row)} for row in found]
    description = f"The {TABLE_LIMIT} endpoints with the most 429s, every caller together."
    return Table("throttled_endpoints", "Most throttled endpoints", description, ENDPOINT_COLUMNS, rows)


#: The tables of the page, by name (``?format=csv&table=<name>``; ``series`` is the time series).
TABLES: dict[str, Callable[[ReportFilters, str], Table]] = {
    "top_consumers": top_consumers,
    "throttled_subjects": throttled_subjects,
    "throttled_endpoints": throttled_endpoints,
    "near_limit": near_limit,
}


def effective_policy_url(kind: str, value: str, *, endpoint: str = "", organization: str = "") -> str:
    """The effective policy page, filled in for this subject on ``endpoint`` ("" if it cannot be)."""
    params: dict[str, str] = {}
    if value.startswith(UNRESOLVED):
        return ""  # a digest names nobody the page could look up
    if kind == SubjectKind.API_KEY:
        params["api_key"] = value
    elif kind == SubjectKind.USER:
        params["user"] = value
    elif kind == SubjectKind.IP and value != "unknown":
        params["ip"] = value.split("/", 1)[0]  # an aggregated IPv6 network: its address aggregates back to it
    else:
        return ""
    if organization and not organization.startswith(UNRESOLVED):
        params["org"] = organization
    if endpoint:
        params["endpoint"] = endpoint
    # Usage is not counted per method: GET, the page's own default (the admin can switch it there).
    params["method"] = "GET"
    return f"{reverse('admin:ratelimits_effective_policy')}?{urlencode(params)}"
