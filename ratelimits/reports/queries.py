"""The usage report's queries: totals per period, top consumers, the most throttled, as bounded tables.

Every query reads the rows :mod:`ratelimits.usage.readers` says stand for each moment (the rolled-up periods,
those still summed from finer rows) and the live minutes, as every other reader of usage does.
Every query is a plain function of :class:`~ratelimits.usage.readers.ReportFilters`; every table is bounded
(:data:`TABLE_LIMIT` rows). Times are UTC throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.db.models import F, FloatField, Q, Sum
from django.db.models.functions import Cast, NullIf
from django.urls import reverse

from ..identity import SubjectKind
from ..models import UsageRecord
from ..status import quota_checks, stand_in
from ..usage.live import LiveRow
from ..usage.readers import (
    MAX_QUOTA_PERIODS,
    OUTCOMES,
    STEPS,
    SUMS,
    TOTALS,
    Period,
    ReportFilters,
    coverage,
    floor_period,
    grouped_usage,
    live_rows,
    period_bounds,
    quota_periods,
    time_series,
    usage_records,
)
from ..usage.records import MAX_RANGE, OVERFLOW, UNRESOLVED
from ..usage.subjects import chunks, max_params
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
    "coverage",
    "effective_policy_url",
    "floor_period",
    "grouped_usage",
    "near_limit",
    "period_bounds",
    "series_table",
    "throttled_endpoints",
    "throttled_subjects",
    "time_series",
    "top_consumers",
    "usage_records",
    "young",
]

#: Rows per table.
TABLE_LIMIT = 20
#: The kinds of subject usage is counted for: the caller (API key, else user, else client IP).
CALLER_KINDS = (SubjectKind.API_KEY, SubjectKind.USER, SubjectKind.IP)
DEFAULT_RANGE = timedelta(hours=24)
#: An install none of whose usage rows started longer ago than this is young (:func:`young`).
YOUNG = timedelta(hours=1)


def young(now: datetime) -> bool:
    """Whether no usage row started longer than :data:`YOUNG` before ``now`` (none at all, on a fresh install)."""
    return not UsageRecord.objects.filter(granularity__in=list(STEPS), period_start__lt=now - YOUNG).exists()


@dataclass(frozen=True, slots=True)
class Caveats:
    """Requests of the range the report cannot name a subject of.

    ``overflow``: counted in an overflow row (kind ``overflow``, the callers' kind as its subject),
    because their minute already counted ``USAGE['MAX_SUBJECTS']`` rows. ``unresolved``: recorded
    under a subject's digest (``digest:...``), because its label was not in the database when the
    minute was drained.
    """

    overflow: int = 0
    unresolved: int = 0


def caveats(filters: ReportFilters, live: Sequence[LiveRow] = ()) -> Caveats:
    """How many requests of the range are in overflow rows, and how many under a digest."""
    requests = F("allowed") + F("throttled") + F("shed") + F("degraded")
    unresolved = Q(subject_id__startswith=UNRESOLVED) | Q(organization__startswith=UNRESOLVED)
    sums = usage_records(filters).aggregate(
        overflow=Sum(requests, filter=Q(subject_kind=OVERFLOW)),
        unresolved=Sum(requests, filter=unresolved & ~Q(subject_kind=OVERFLOW)),
    )
    rows = live_rows(live, filters)
    overflow = sum(row.requests for row in rows if row.subject_kind == OVERFLOW)
    digests = sum(
        row.requests
        for row in rows
        if row.subject_kind != OVERFLOW
        and (row.subject_id.startswith(UNRESOLVED) or row.organization.startswith(UNRESOLVED))
    )
    return Caveats(int(sums["overflow"] or 0) + overflow, int(sums["unresolved"] or 0) + digests)


def _live_sums(rows: Iterable[LiveRow], fields: Sequence[str]) -> dict[tuple[Any, ...], dict[str, int]]:
    """``rows`` summed by ``fields``, as :func:`grouped_usage` names the sums."""
    groups: dict[tuple[Any, ...], dict[str, int]] = {}
    for row in rows:
        sums = groups.setdefault(tuple(getattr(row, name) for name in fields), dict.fromkeys(SUMS, 0))
        for metric in TOTALS:
            sums[f"n_{metric}"] += getattr(row, metric)
    return groups


def _merged(
    stored: Iterable[dict[str, Any]], live: dict[tuple[Any, ...], dict[str, int]], fields: Sequence[str]
) -> list[dict[str, Any]]:
    """Grouped rows of the database with the live sums of the same groups added (and the live-only groups)."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in stored:
        groups[tuple(row[name] for name in fields)] = {**row, **{name: int(row[name] or 0) for name in SUMS}}
    for key, sums in live.items():
        group = groups.setdefault(key, {**dict(zip(fields, key, strict=True)), **dict.fromkeys(SUMS, 0)})
        for name, count in sums.items():
            group[name] += count
    for group in groups.values():
        group["n_requests"] = sum(group[f"n_{metric}"] for metric in OUTCOMES)
        group["share"] = group["n_throttled"] / group["n_requests"] if group["n_requests"] else None
    return list(groups.values())


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
SERIES_COLUMNS = (
    Column("period_start", "Period start (UTC)", numeric=False),
    *COUNT_COLUMNS,
    Column("live", "Live", numeric=False),
)
#: The series table's ``live`` cell of a period counting minutes not drained yet (empty otherwise).
LIVE = "live"


def series_table(series: Sequence[Period]) -> Table:
    """The time series as a table (the chart's data, and its CSV export)."""
    rows = [
        {
            "period_start": p.start,
            "requests": p.requests,
            **{m: getattr(p, m) for m in TOTALS},
            "live": LIVE if p.live else "",
        }
        for p in series
    ]
    return Table("series", "Requests per period", "Every period of the range, oldest first.", SERIES_COLUMNS, rows)


def _counts(row: dict[str, Any]) -> dict[str, Any]:
    counts = {metric: int(row[f"n_{metric}"] or 0) for metric in TOTALS}
    requests = sum(counts[m] for m in OUTCOMES)
    return {"requests": requests, **counts, "throttled_share": counts["throttled"] / requests if requests else 0.0}


def _share() -> Any:
    return Cast(F("n_throttled"), FloatField()) / NullIf(Cast(F("n_requests"), FloatField()), 0.0)


def _ranked(
    filters: ReportFilters, live: Sequence[LiveRow], fields: tuple[str, ...], order: Sequence[str], *, throttled: bool
) -> list[dict[str, Any]]:
    """The first :data:`TABLE_LIMIT` groups of ``fields`` by descending ``order`` (then ``fields``), live rows in.

    ``throttled``: only groups throttled at least once. The database ranks its rows; the live
    ones are added here, to the database's first ``TABLE_LIMIT`` groups plus one more for each
    live group. That is exact (ties for the last place aside): a group without live rows keeps
    its sums, so only live groups can overtake one, and a group without live rows that makes the
    merged table ranks in the database behind at most ``TABLE_LIMIT - 1`` others that make it too
    and the live groups. The live groups' own database sums are read apart.
    """
    grouped = grouped_usage(usage_records(filters), *fields).annotate(share=_share())
    ranked = grouped.filter(Q(n_throttled__gt=0)) if throttled else grouped
    ordering: list[Any] = [*(F(name).desc(nulls_last=True) for name in order), *fields]
    extra = _live_sums(live_rows(live, filters), fields)
    found = list(ranked.order_by(*ordering)[: TABLE_LIMIT + len(extra)])
    if not extra:
        return found
    known = {tuple(row[name] for name in fields) for row in found}
    stored = _stored_groups(filters, fields, [key for key in extra if key not in known])
    merged = [row for row in _merged([*found, *stored], extra, fields) if row["n_throttled"] > 0 or not throttled]
    merged.sort(key=lambda row: (*(_descending(row[name]) for name in order), *(row[name] for name in fields)))
    return merged[:TABLE_LIMIT]


def _descending(value: float | None) -> tuple[bool, float]:
    """A sort key putting the largest first, and ``None`` last (as ``DESC NULLS LAST``)."""
    return (value is None, -(value or 0))


def _stored_groups(
    filters: ReportFilters, fields: tuple[str, ...], keys: Sequence[tuple[Any, ...]]
) -> list[dict[str, Any]]:
    """The database's grouped rows of these groups of ``fields`` (one query per value of all fields but the last)."""
    by_prefix: dict[tuple[Any, ...], list[Any]] = {}
    for key in keys:
        by_prefix.setdefault(key[:-1], []).append(key[-1])
    found: list[dict[str, Any]] = []
    *prefix_fields, last = fields
    # Half a statement's parameters: the range's and the filters' take some of the rest.
    for prefix, values in by_prefix.items():
        for chunk in chunks(values, max_params(2)):
            rows = usage_records(filters).filter(
                **dict(zip(prefix_fields, prefix, strict=True)), **{f"{last}__in": chunk}
            )
            found += grouped_usage(rows, *fields)
    return found


def _subject_table(
    filters: ReportFilters,
    live: Sequence[LiveRow],
    name: str,
    title: str,
    description: str,
    order: Sequence[str],
    *,
    throttled: bool,
    hint: str,
) -> Table:
    """Subjects grouped over the range, in descending ``order``; each links to its effective policy."""
    found = _ranked(filters, live, ("subject_kind", "subject_id"), order, throttled=throttled)
    hints = _endpoint_hints(filters, live, [(r["subject_kind"], r["subject_id"]) for r in found], hint)
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
    filters: ReportFilters, live: Sequence[LiveRow], subjects: Sequence[tuple[str, str]], metric: str
) -> dict[tuple[str, str], tuple[str, str]]:
    """Each subject's endpoint with the most ``metric`` in the range, and its organisation."""
    if not subjects:
        return {}
    which = Q()
    for kind, value in subjects:
        which |= Q(subject_kind=kind, subject_id=value)
    fields = ("subject_kind", "subject_id", "endpoint", "organization")
    wanted = set(subjects)
    extra = _live_sums(
        (row for row in live_rows(live, filters) if (row.subject_kind, row.subject_id) in wanted), fields
    )
    grouped = _merged(grouped_usage(usage_records(filters).filter(which), *fields), extra, fields)
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


def top_consumers(filters: ReportFilters, by: str = "requests", live: Sequence[LiveRow] = ()) -> Table:
    """The subjects with the most requests (or tokens) in the range."""
    if by not in ("requests", "tokens"):
        raise ValueError(f"rank consumers by requests or tokens, not {by!r}")
    order = ("n_requests", "n_tokens") if by == "requests" else ("n_tokens", "n_requests")
    return _subject_table(
        filters,
        live,
        "top_consumers",
        f"Top consumers by {by}",
        f"The {TABLE_LIMIT} subjects with the most {by}; the endpoint is the one each used most.",
        order,
        throttled=False,
        hint=by,
    )


def throttled_subjects(filters: ReportFilters, by: str = "requests", live: Sequence[LiveRow] = ()) -> Table:
    """The subjects refused with 429 most often in the range."""
    return _subject_table(
        filters,
        live,
        "throttled_subjects",
        "Most throttled subjects",
        f"The {TABLE_LIMIT} subjects with the most 429s; the endpoint is where each was throttled most.",
        ("n_throttled", "n_requests"),
        throttled=True,
        hint="throttled",
    )


def near_limit(filters: ReportFilters, by: str = "requests", live: Sequence[LiveRow] = ()) -> Table:
    """Subjects throttled at least once, highest share of their requests throttled first."""
    return _subject_table(
        filters,
        live,
        "near_limit",
        "Near the limit",
        "Subjects throttled at least once in the range, by the share of their requests refused with 429 "
        "(a subject near its limit is refused now and then; one far over it, most of the time).",
        ("share", "n_throttled"),
        throttled=True,
        hint="throttled",
    )


def throttled_endpoints(filters: ReportFilters, by: str = "requests", live: Sequence[LiveRow] = ()) -> Table:
    """The endpoints refusing the most requests with 429 in the range."""
    found = _ranked(filters, live, ("endpoint",), ("n_throttled", "n_requests"), throttled=True)
    rows = [{"endpoint": row["endpoint"], **_counts(row)} for row in found]
    description = f"The {TABLE_LIMIT} endpoints with the most 429s, every caller together."
    return Table("throttled_endpoints", "Most throttled endpoints", description, ENDPOINT_COLUMNS, rows)


QUOTA_COLUMNS = (
    Column("policy", "Quota", numeric=False),
    Column("period_start", "Period start", numeric=False),
    Column("period_end", "Renews", numeric=False),
    Column("quota", "Quota"),
    Column("used", "Used"),
    Column("remaining", "Remaining"),
    Column("overage", "Overage"),
    Column("live", "Live", numeric=False),
)


def billing_periods(filters: ReportFilters, by: str = "requests", live: Sequence[LiveRow] = ()) -> Table:
    """One subject's quotas by billing period over the range: what each period allowed, what was
    spent, and the overage past it (a soft quota's bill). Empty unless the report is of one subject."""
    title = "Billing periods"
    if not (filters.subject_kind and filters.subject_id) or filters.subject_kind not in _STANDS_IN:
        description = "Filter the report by one API key, user, organisation or IP address to see its quotas by period."
        return Table("billing_periods", title, description, QUOTA_COLUMNS)
    caller = stand_in(endpoint=filters.endpoint or "usage", **{_STANDS_IN[filters.subject_kind]: filters.subject_id})
    rows = []
    for check in quota_checks(caller.request, caller.identity):
        period = check.policy.billing_period
        assert period is not None  # quota_checks gives those that have one
        # The periods the range overlaps, counted back from its end (or now, if that is earlier).
        now = min(filters.end, datetime.now(tz=UTC))
        count, start = 1, period.start(now)
        while count < MAX_QUOTA_PERIODS and start > filters.start:
            count, start = count + 1, period.start(start - timedelta(microseconds=1))
        for row in quota_periods(check.subject, period, check.policy.rate.limit, count=count, now=now):
            rows.append(
                {
                    "policy": check.policy.name,
                    "period_start": row.start,
                    "period_end": row.end,
                    "quota": row.quota,
                    "used": row.used,
                    "remaining": row.remaining,
                    "overage": row.overage,
                    "live": LIVE if row.live else "",
                }
            )
    description = (
        "The subject's quotas by calendar day, week or month, each period of the range from its own anchor "
        f"(at most {MAX_QUOTA_PERIODS}), summed from the hourly rows: the overage is what a soft quota "
        "admitted past it."
    )
    return Table("billing_periods", title, description, QUOTA_COLUMNS, rows)


#: The report's subject kinds, as :func:`~ratelimits.status.stand_in` takes them.
_STANDS_IN: dict[str, str] = {
    SubjectKind.API_KEY: "api_key",
    SubjectKind.USER: "user",
    SubjectKind.ORG: "org",
    SubjectKind.IP: "ip",
}


#: The tables of the page, by name (``?format=csv&table=<name>``; ``series`` is the time series).
TABLES: dict[str, Callable[[ReportFilters, str, Sequence[LiveRow]], Table]] = {
    "top_consumers": top_consumers,
    "throttled_subjects": throttled_subjects,
    "throttled_endpoints": throttled_endpoints,
    "near_limit": near_limit,
    "billing_periods": billing_periods,
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
