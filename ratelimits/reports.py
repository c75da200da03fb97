"""Usage reports for the admin: totals per period, top consumers, the most throttled, CSV exports.

Everything here reads ``UsageRecord`` rows (drained, then rolled up into hours and days by
:mod:`ratelimits.usage`): the current minute, and an hour or day not rolled up yet, are not in.
The query logic is plain functions over :class:`ReportFilters`; every table is bounded
(:data:`TABLE_LIMIT` rows). The chart is SVG drawn here, on the server: no JavaScript, nothing
loaded from elsewhere. Times are UTC throughout.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django import forms
from django.core.exceptions import PermissionDenied
from django.db.models import F, FloatField, Q, QuerySet, Sum
from django.db.models.functions import Cast, NullIf
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.dateparse import parse_datetime
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from .models import UsageRecord, validate_endpoint
from .views import MAX_RANGE

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

__all__ = [
    "TABLES",
    "TABLE_LIMIT",
    "Period",
    "ReportFilters",
    "Table",
    "UsageReportForm",
    "csv_response",
    "effective_policy_url",
    "grouped_usage",
    "near_limit",
    "render_chart",
    "series_table",
    "throttled_endpoints",
    "throttled_subjects",
    "time_series",
    "top_consumers",
    "usage_records",
    "usage_report_view",
]

#: The request outcomes, in the order the chart stacks them (bottom first).
OUTCOMES = ("allowed", "throttled", "shed", "degraded")
TOTALS = (*OUTCOMES, "tokens")
#: Rows per table.
TABLE_LIMIT = 20
#: The kinds of subject usage is counted for: the caller (API key, else user, else client IP).
CALLER_KINDS = ("api_key", "user", "ip")
STEPS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
DEFAULT_RANGE = timedelta(hours=24)

# -- queries ----------------------------------------------------------------------------------------


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
        return [[_csv_text(row[column.key]) for column in self.columns] for row in self.rows]

    def cells(self) -> list[list[Cell]]:
        """The rows as the page shows them."""
        return [
            [Cell(_display_text(row[c.key]), c.numeric, row.get("links", {}).get(c.key, "")) for c in self.columns]
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
    if kind == "api_key":
        params["api_key"] = value
    elif kind == "user":
        params["user"] = value
    elif kind == "ip" and value != "unknown":
        params["ip"] = value.split("/", 1)[0]  # an aggregated IPv6 network: its address aggregates back to it
    else:
        return ""
    if organization:
        params["org"] = organization
    if endpoint:
        params["endpoint"] = endpoint
    # Usage is not counted per method: GET, the page's own default (the admin can switch it there).
    params["method"] = "GET"
    return f"{reverse('admin:ratelimits_effective_policy')}?{urlencode(params)}"


# -- text -------------------------------------------------------------------------------------------


def format_moment(moment: datetime) -> str:
    """``2026-05-01 14:00`` (UTC; seconds only when there are any)."""
    moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S" if moment.second or moment.microsecond else "%Y-%m-%d %H:%M")


def _csv_text(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    # A spreadsheet would run a cell starting like a formula: organisations are the host's strings.
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _display_text(value: Any) -> str:
    if isinstance(value, datetime):
        return format_moment(value)
    if isinstance(value, float):
        return f"{value:.1%}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value) or "—"


def csv_response(table: Table, filters: ReportFilters) -> HttpResponse:
    """``table`` as a CSV attachment, header row first."""
    name = f"usage-{table.name}-{filters.granularity}-{filters.start:%Y%m%dT%H%M}-{filters.end:%Y%m%dT%H%M}.csv"
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    writer.writerow(table.header())
    writer.writerows(table.csv_rows())
    return response


# -- the chart --------------------------------------------------------------------------------------

#: Okabe-Ito colours: told apart with every common colour vision deficiency.
COLORS = {"allowed": "#0072B2", "throttled": "#E69F00", "shed": "#D55E00", "degraded": "#CC79A7"}
LABELS = {"allowed": "allowed", "throttled": "throttled (429)", "shed": "shed (503)", "degraded": "degraded"}
WIDTH, HEIGHT = 960, 340
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 44, 64
#: More periods than this are drawn as lines, not stacked bars (bars would be thinner than a pixel or two).
MAX_BARS = 180
#: Steps between the labelled periods, in periods.
LABEL_STEPS = {
    "minute": (1, 2, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440),
    "hour": (1, 2, 3, 6, 12, 24, 48, 72, 168, 336, 720),
    "day": (1, 2, 7, 14, 28, 56, 91, 182, 364),
}
MAX_LABELS = 8


def _compact(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:g}"


def _scale(peak: int, ticks: int = 5) -> tuple[int, int]:
    """A round top for the y axis above ``peak`` and the step between its gridlines."""
    if peak <= 0:
        return 1, 1
    raw = peak / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if raw <= m * magnitude)
    whole = max(round(step), 1)
    return whole * math.ceil(peak / whole), whole


def _label_step(count: int, granularity: str) -> int:
    for step in LABEL_STEPS[granularity]:
        if math.ceil(count / step) <= MAX_LABELS:
            return step
    return max(1, math.ceil(count / MAX_LABELS))


def _period_label(start: datetime, granularity: str) -> str:
    return f"{start:%Y-%m-%d}" if granularity == "day" else f"{start:%Y-%m-%d %H:%M}"


def render_chart(series: Sequence[Period], granularity: str) -> SafeString:
    """Requests per period as an SVG: stacked bars by outcome (lines beyond :data:`MAX_BARS` periods)."""
    count = len(series)
    bars = count <= MAX_BARS
    if bars:
        peak = max((p.requests for p in series), default=0)
    else:
        peak = max((getattr(p, m) for p in series for m in OUTCOMES), default=0)
    top, step = _scale(peak)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(count, 1)
    bottom = TOP + plot_h

    def y(value: float) -> float:
        return bottom - value / top * plot_h

    totals = {m: sum(getattr(p, m) for p in series) for m in OUTCOMES}
    kind = "stacked bars" if bars else "lines"
    title = f"Requests per {granularity} by outcome"
    if series:
        span = (
            f"from {_period_label(series[0].start, granularity)} to {_period_label(series[-1].start, granularity)} UTC"
        )
    else:
        span = "(no periods in the range)"
    desc = (
        f"{kind.capitalize()}, {count} periods {span}: "
        + ", ".join(f"{totals[m]:,} {LABELS[m]}" for m in OUTCOMES)
        + "."
    )
    busiest = max(series, key=lambda p: p.requests, default=None)
    if busiest is not None and busiest.requests:
        desc += f" Busiest period: {_period_label(busiest.start, granularity)} with {busiest.requests:,} requests."
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="usage-chart" id="usage-chart" viewBox="0 0 {WIDTH} {HEIGHT}"'
        f' role="img" aria-label="{escape(title)}" aria-describedby="usage-chart-desc" data-kind="{kind}"'
        ' font-family="inherit" font-size="12" fill="currentColor">',
        f'<title id="usage-chart-title">{escape(title)}</title>',
        f'<desc id="usage-chart-desc">{escape(desc)}</desc>',
    ]
    # Gridlines and the y axis.
    out.append('<g class="y-axis" aria-hidden="true">')
    for value in range(0, top + 1, step):
        at = y(value)
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{at:.1f}" y2="{at:.1f}" stroke="currentColor"'
            f' stroke-opacity="{0.6 if value == 0 else 0.15}"/>'
            f'<text x="{LEFT - 8}" y="{at + 4:.1f}" text-anchor="end">{_compact(value)}</text>'
        )
    out.append(
        f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{bottom}" stroke="currentColor" stroke-opacity="0.6"/>'
        f'<text transform="translate(16 {TOP + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
        f"requests per {escape(granularity)}</text></g>"
    )
    # The x axis: labels on round periods, the date under the first label of each day.
    out.append('<g class="x-axis" aria-hidden="true">')
    label_every = _label_step(count, granularity)
    unit = STEPS[granularity].total_seconds()
    last_day = ""
    for index, period in enumerate(series):
        if int(period.start.timestamp() // unit) % label_every:
            continue
        x = LEFT + (index + 0.5) * slot
        day = f"{period.start:%Y-%m-%d}"
        first, second = (day, "") if granularity == "day" else (f"{period.start:%H:%M}", day if day != last_day else "")
        last_day = day
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 5}" stroke="currentColor"'
            f' stroke-opacity="0.6"/><text x="{x:.1f}" y="{bottom + 18}" text-anchor="middle">{first}'
            + (f'<tspan x="{x:.1f}" dy="14">{second}</tspan>' if second else "")
            + "</text>"
        )
    out.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle">period start (UTC)</text></g>')
    # The data.
    if bars:
        width = max(slot * 0.8, 1.0)
        stacked = [0] * count
        for metric in OUTCOMES:
            out.append(f'<g class="series" data-outcome="{metric}" fill="{COLORS[metric]}">')
            for index, period in enumerate(series):
                value = getattr(period, metric)
                if not value:
                    continue
                low, high = y(stacked[index]), y(stacked[index] + value)
                stacked[index] += value
                x = LEFT + index * slot + (slot - width) / 2
                out.append(
                    f'<rect x="{x:.1f}" y="{high:.1f}" width="{width:.1f}" height="{max(low - high, 0.5):.1f}">'
                    f"<title>{_period_label(period.start, granularity)} UTC: {value:,} {LABELS[metric]}</title></rect>"
                )
            out.append("</g>")
    else:
        for metric in OUTCOMES:
            points = " ".join(
                f"{'M' if i == 0 else 'L'}{LEFT + (i + 0.5) * slot:.1f} {y(getattr(p, metric)):.1f}"
                for i, p in enumerate(series)
            )
            out.append(
                f'<path class="series" data-outcome="{metric}" d="{points}" fill="none" stroke="{COLORS[metric]}"'
                f' stroke-width="1.5" stroke-linejoin="round"><title>{LABELS[metric]}</title></path>'
            )
    if peak == 0:
        out.append(
            f'<text x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" class="empty">'
            "No usage recorded in this range</text>"
        )
    # The legend, with each outcome's total.
    out.append('<g class="legend">')
    x = float(LEFT)
    for metric in OUTCOMES:
        text = f"{LABELS[metric]}: {totals[metric]:,}"
        out.append(
            f'<rect x="{x:.1f}" y="14" width="12" height="12" fill="{COLORS[metric]}"/>'
            f'<text x="{x + 17:.1f}" y="24">{escape(text)}</text>'
        )
        x += 40 + 7.2 * len(text)
    out.append("</g></svg>")
    return mark_safe("".join(out))  # every interpolated string is escaped, or a number


# -- the form and the view --------------------------------------------------------------------------


def _moment_field(label: str, help_text: str) -> forms.CharField:
    return forms.CharField(
        required=False,
        label=label,
        max_length=40,
        help_text=help_text,
        widget=forms.TextInput(attrs={"placeholder": "2026-05-01 00:00", "size": 20}),
    )


class UsageReportForm(forms.Form):
    """The range (``from``, ``to``: UTC unless an offset is given), granularity and filters."""

    granularity = forms.ChoiceField(
        choices=[(g, g) for g in STEPS],
        required=False,
        help_text="Ranges may cover at most " + ", ".join(f"{d.days} days of {g}s" for g, d in MAX_RANGE.items()) + ".",
    )
    subject = forms.CharField(
        required=False,
        max_length=220,
        help_text="kind:id, e.g. api_key:ApiKey:3, user:42 or ip:203.0.113.7",
        widget=forms.TextInput(attrs={"size": 24}),
    )
    tier = forms.CharField(required=False, max_length=50)
    endpoint = forms.CharField(required=False, max_length=150, help_text="throttle_scope or route name")
    org = forms.CharField(required=False, max_length=200, label="Organisation")
    by = forms.ChoiceField(
        choices=[("requests", "requests"), ("tokens", "tokens")], required=False, label="Rank consumers by"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "from" is a Python keyword: these two are added here, first.
        self.fields = {
            "from": _moment_field("From", "UTC unless an offset is given; default: 24 hours before To."),
            "to": _moment_field("To", "Excluded; default: now."),
            **self.fields,
        }

    @classmethod
    def defaults(cls, now: datetime | None = None) -> dict[str, str]:
        """The data of the default report: the last 24 hours, per hour."""
        end = floor_period(now or datetime.now(tz=UTC), "minute") + timedelta(minutes=1)
        return {"from": format_moment(end - DEFAULT_RANGE), "to": format_moment(end), "granularity": "hour"}

    def _moment(self, name: str) -> datetime | None:
        raw = str(self.cleaned_data.get(name) or "").strip()
        if not raw:
            return None
        try:
            moment = parse_datetime(raw)
        except ValueError:
            moment = None
        if moment is None:
            raise forms.ValidationError(f"{raw!r} is not a date and time, e.g. 2026-05-01 00:00 or 2026-05-01T00:00Z.")
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)

    def clean_from(self) -> datetime | None:
        return self._moment("from")

    def clean_to(self) -> datetime | None:
        return self._moment("to")

    def clean_subject(self) -> tuple[str, str]:
        raw = str(self.cleaned_data.get("subject") or "").strip()
        if not raw:
            return "", ""
        kind, _, value = raw.partition(":")
        if kind not in CALLER_KINDS or not value.strip():
            raise forms.ValidationError(
                f"{raw!r}: give kind:id, the kind one of {', '.join(CALLER_KINDS)} (e.g. api_key:ApiKey:3)."
            )
        return kind, value.strip()

    def clean_endpoint(self) -> str:
        raw = str(self.cleaned_data.get("endpoint") or "").strip()
        if raw:
            validate_endpoint(raw)
        return raw

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        granularity = cleaned.get("granularity") or "hour"
        cleaned["granularity"] = granularity
        cleaned["by"] = cleaned.get("by") or "requests"
        if "from" not in cleaned or "to" not in cleaned:
            return cleaned  # a field error already
        end = cleaned["to"] or floor_period(datetime.now(tz=UTC), "minute") + timedelta(minutes=1)
        start = cleaned["from"] or end - DEFAULT_RANGE
        cleaned["from"], cleaned["to"] = start, end
        if end <= start:
            self.add_error("to", "To must be after From.")
        elif end - start > MAX_RANGE[granularity]:
            self.add_error(
                "from", f"A range of {granularity} rows may cover at most {MAX_RANGE[granularity].days} days."
            )
        return cleaned

    def filters(self) -> ReportFilters:
        data = self.cleaned_data
        kind, value = data["subject"]
        return ReportFilters(
            start=data["from"],
            end=data["to"],
            granularity=data["granularity"],
            subject_kind=kind,
            subject_id=value,
            tier=data["tier"].strip(),
            endpoint=data["endpoint"],
            organization=data["org"].strip(),
        )

    def query(self) -> dict[str, str]:
        """The cleaned form as query parameters: the same report, whenever it is asked for again."""
        data = self.cleaned_data
        query = {
            "from": format_moment(data["from"]),
            "to": format_moment(data["to"]),
            "granularity": data["granularity"],
            "subject": ":".join(data["subject"]) if data["subject"][0] else "",
            "tier": data["tier"].strip(),
            "endpoint": data["endpoint"],
            "org": data["org"].strip(),
            "by": data["by"],
        }
        return {name: value for name, value in query.items() if value}


def usage_report_view(model_admin: ModelAdmin[Any]) -> Callable[[HttpRequest], HttpResponse]:
    """The report page of ``model_admin``'s admin site (staff with ``ratelimits.view_tier``)."""

    def view(request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm("ratelimits.view_tier"):
            raise PermissionDenied
        fields = ("from", "to", "granularity", "subject", "tier", "endpoint", "org", "by")
        data = request.GET if any(name in request.GET for name in fields) else UsageReportForm.defaults()
        form = UsageReportForm(data)
        valid = form.is_valid()
        if request.GET.get("format") == "csv":
            return _csv_view(request, form, valid)
        context: dict[str, Any] = {
            **model_admin.admin_site.each_context(request),
            "title": "Usage report",
            "form": form,
            "opts": model_admin.model._meta,
            "limit": TABLE_LIMIT,
        }
        if valid:
            filters, query = form.filters(), form.query()
            here = reverse("admin:ratelimits_usage_report")
            series = time_series(filters)
            tables = [build(filters, form.cleaned_data["by"]) for build in TABLES.values()]
            for table in tables:
                if table.name == "throttled_endpoints":  # an endpoint narrows the report to it
                    for row in table.rows:
                        row["links"] = {"endpoint": f"{here}?{urlencode({**query, 'endpoint': row['endpoint']})}"}
            sections = [
                {
                    "table": t,
                    "cells": t.cells(),
                    "csv_url": f"{here}?{urlencode({**query, 'format': 'csv', 'table': t.name})}",
                }
                for t in [series_table(series), *tables]
            ]
            if len(series) > MAX_BARS:  # a long series is in its CSV, not in thousands of table rows
                sections[0]["cells"] = []
            context.update(
                {
                    "filters": filters,
                    "chart": render_chart(series, filters.granularity),
                    "totals": {
                        "requests": _display_text(sum(p.requests for p in series)),
                        **{m: _display_text(sum(getattr(p, m) for p in series)) for m in TOTALS},
                    },
                    "sections": sections,
                }
            )
        return TemplateResponse(request, "admin/ratelimits/usage_report.html", context)

    return view


def _csv_view(request: HttpRequest, form: UsageReportForm, valid: bool) -> HttpResponse:
    name = request.GET.get("table", "series")
    if not valid:
        errors = "; ".join(f"{field}: {' '.join(map(str, messages))}" for field, messages in form.errors.items())
        return HttpResponse(f"Invalid report: {errors}\n", status=400, content_type="text/plain; charset=utf-8")
    filters = form.filters()
    if name == "series":
        return csv_response(series_table(time_series(filters)), filters)
    build = TABLES.get(name)
    if build is None:
        choices = ", ".join(["series", *TABLES])
        return HttpResponse(f"Unknown table {name!r}: one of {choices}.\n", status=400, content_type="text/plain")
    return csv_response(build(filters, form.cleaned_data["by"]), filters)
