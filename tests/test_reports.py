"""The admin usage report: per-period totals, bounded tables, filters, CSV exports, permissions, ranges.

Usage rows are created directly. Ranges are fixed in the past (2025-03-01 UTC), so no test
depends on the clock, except those checking the default range. Periods not rolled up yet are
summed from their minutes: the report says the same before and after the roll-up ran. Live
rows (minutes not drained yet, tests/test_usage_live.py reads them from the stores) rank as
they would once drained.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import re
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from ratelimits.models import UsageRecord
from ratelimits.reports.chart import MAX_BARS, MIN_PERIODS, chart_periods, render_chart
from ratelimits.reports.queries import (
    TABLE_LIMIT,
    TABLES,
    Caveats,
    Period,
    ReportFilters,
    caveats,
    effective_policy_url,
    near_limit,
    series_table,
    throttled_endpoints,
    throttled_subjects,
    time_series,
    top_consumers,
)
from ratelimits.usage import rollup
from ratelimits.usage.live import LiveRow

from .support.settings import merged

pytestmark = pytest.mark.django_db

START = datetime(2025, 3, 1, tzinfo=UTC)
HOUR = timedelta(hours=1)
URL = "/admin/ratelimits/fleetsettings/usage/"


def record(
    subject: str,
    start: datetime,
    *,
    endpoint: str = "charges",
    kind: str = "api_key",
    granularity: str = "hour",
    organization: str = "",
    tier: str = "",
    **counts: int,
) -> UsageRecord:
    return UsageRecord.objects.create(
        granularity=granularity,
        period_start=start,
        subject_kind=kind,
        subject_id=subject,
        endpoint=endpoint,
        organization=organization,
        tier=tier,
        **counts,
    )


def day(**fields: Any) -> ReportFilters:
    """The 24 hours from START, per hour."""
    return ReportFilters(start=START, end=START + 24 * HOUR, **fields)


def query(**params: str) -> dict[str, str]:
    return {"from": "2025-03-01 00:00", "to": "2025-03-02 00:00", **params}


def csv_of(response: Any) -> list[list[str]]:
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"].startswith("attachment; filename=")
    return list(csv.reader(io.StringIO(response.content.decode())))


@pytest.fixture
def traffic() -> None:
    """Three API keys, a user and an IP network over a few hours, on two endpoints and two organisations."""
    record("ApiKey:1", START, organization="acme", tier="free", allowed=10, throttled=5, tokens=10)
    record("ApiKey:1", START + HOUR, organization="acme", tier="free", allowed=20, throttled=1, shed=2, tokens=40)
    record("ApiKey:1", START + HOUR, endpoint="refunds", organization="acme", tier="free", allowed=3, throttled=7)
    record("ApiKey:2", START, organization="globex", tier="standard", allowed=50, degraded=4, tokens=500)
    record("ApiKey:3", START + 2 * HOUR, endpoint="refunds", tier="free", allowed=1, throttled=1, tokens=1)
    record("42", START + 2 * HOUR, kind="user", tier="free", allowed=5, shed=1, tokens=5)
    record("2001:db8::/64", START + 3 * HOUR, kind="ip", endpoint="refunds", allowed=2, throttled=6)
    # Not in the report: other granularities, and hours outside the range.
    record("ApiKey:1", START, granularity="minute", allowed=1000, throttled=1000)
    record("ApiKey:1", START, granularity="day", allowed=1000, throttled=1000)
    record("ApiKey:1", START - HOUR, allowed=1000, throttled=1000)
    record("ApiKey:1", START + 24 * HOUR, allowed=1000, throttled=1000)


@pytest.fixture
def viewer_client(django_user_model: Any) -> Client:
    """Staff allowed to view ratelimits' models (view_tier among them)."""
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="ratelimits", codename__startswith="view_")
    )
    client = Client()
    client.force_login(user)
    return client


# -- queries ------------------------------------------------------------------------------------------


def test_totals_per_period(traffic: None) -> None:
    series = time_series(day())
    assert [p.start for p in series] == [START + i * HOUR for i in range(24)]
    by_hour = [(p.allowed, p.throttled, p.shed, p.degraded, p.tokens, p.requests) for p in series]
    assert by_hour[0] == (60, 5, 0, 4, 510, 69)
    assert by_hour[1] == (23, 8, 2, 0, 40, 33)
    assert by_hour[2] == (6, 1, 1, 0, 6, 8)
    assert by_hour[3] == (2, 6, 0, 0, 0, 8)
    assert by_hour[4:] == [(0, 0, 0, 0, 0, 0)] * 20  # empty periods are in, as zeros

    table = series_table(series)
    assert table.header() == [
        "Period start (UTC)",
        "Requests",
        "Allowed",
        "Throttled (429)",
        "Shed (503)",
        "Degraded",
        "Tokens",
        "Live",
    ]
    assert table.csv_rows()[1] == ["2025-03-01T01:00:00Z", "33", "23", "8", "2", "0", "40", ""]


def test_periods_start_inside_the_range_and_end_before_to(traffic: None) -> None:
    # From 00:30: the period starting at 00:00 is out; to 03:00 is excluded.
    series = time_series(ReportFilters(start=START + HOUR / 2, end=START + 3 * HOUR))
    assert [p.start for p in series] == [START + HOUR, START + 2 * HOUR]
    assert [p.requests for p in series] == [33, 8]
    daily = time_series(ReportFilters(start=START, end=START + timedelta(days=3), granularity="day"))
    # The roll-up got as far as the first day: the next is summed from its hours (one, at midnight).
    assert [(p.start, p.allowed) for p in daily] == [
        (START, 1000),
        (START + timedelta(days=1), 1000),
        (START + timedelta(days=2), 0),
    ]
    minutes = time_series(ReportFilters(start=START, end=START + timedelta(minutes=5), granularity="minute"))
    assert [p.throttled for p in minutes] == [1000, 0, 0, 0, 0]


def test_top_consumers_by_requests_and_by_tokens(traffic: None) -> None:
    by_requests = top_consumers(day())
    rows = [(r["subject_id"], r["requests"], r["tokens"]) for r in by_requests.rows]
    assert rows == [
        ("ApiKey:2", 54, 500),
        ("ApiKey:1", 48, 50),
        ("2001:db8::/64", 8, 0),
        ("42", 6, 5),
        ("ApiKey:3", 2, 1),
    ]
    first = by_requests.rows[1]
    assert (first["allowed"], first["throttled"], first["shed"], first["degraded"]) == (33, 13, 2, 0)
    assert first["throttled_share"] == pytest.approx(13 / 48)
    assert (first["organization"], first["endpoint"]) == ("acme", "charges")  # its busiest endpoint

    by_tokens = top_consumers(day(), by="tokens")
    assert by_tokens.title == "Top consumers by tokens"
    assert [r["subject_id"] for r in by_tokens.rows] == ["ApiKey:2", "ApiKey:1", "42", "ApiKey:3", "2001:db8::/64"]
    with pytest.raises(ValueError, match="requests or tokens"):
        top_consumers(day(), by="bytes")


def test_throttled_tables_order_and_what_they_leave_out(traffic: None) -> None:
    subjects = throttled_subjects(day())
    # By 429s; ApiKey:2 and user 42 were never throttled (shed and degraded are not throttled).
    assert [(r["subject_id"], r["throttled"]) for r in subjects.rows] == [
        ("ApiKey:1", 13),
        ("2001:db8::/64", 6),
        ("ApiKey:3", 1),
    ]
    # The link goes to the endpoint where each was throttled most: ApiKey:1 had 7 429s on refunds, 6 on charges.
    assert subjects.rows[0]["endpoint"] == "refunds"

    near = near_limit(day())
    assert [(r["subject_id"], round(r["throttled_share"], 3)) for r in near.rows] == [
        ("2001:db8::/64", 0.75),
        ("ApiKey:3", 0.5),
        ("ApiKey:1", 0.271),
    ]

    endpoints = throttled_endpoints(day())
    assert [(r["endpoint"], r["throttled"], r["requests"]) for r in endpoints.rows] == [
        ("refunds", 14, 20),
        ("charges", 6, 98),
    ]


def test_every_table_holds_at_most_the_limit_in_order() -> None:
    for n in range(TABLE_LIMIT + 5):
        record(f"ApiKey:{n}", START, endpoint=f"ep-{n:02d}", allowed=100 - n, throttled=n + 1, tokens=n * 10)
    filters = day()
    consumers = top_consumers(filters).rows
    assert len(consumers) == TABLE_LIMIT
    assert [r["requests"] for r in consumers] == [101] * TABLE_LIMIT  # a tie: broken by most tokens
    assert [r["subject_id"] for r in consumers[:3]] == ["ApiKey:24", "ApiKey:23", "ApiKey:22"]
    tokens = [r["tokens"] for r in top_consumers(filters, by="tokens").rows]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] == 240 and len(tokens) == TABLE_LIMIT
    throttled = [r["throttled"] for r in throttled_subjects(filters).rows]
    assert throttled == list(range(25, 5, -1))
    shares = [r["throttled_share"] for r in near_limit(filters).rows]
    assert shares == sorted(shares, reverse=True) and len(shares) == TABLE_LIMIT
    endpoints = [r["endpoint"] for r in throttled_endpoints(filters).rows]
    assert endpoints == [f"ep-{n:02d}" for n in range(24, 4, -1)]


def test_filters_narrow_every_query(traffic: None) -> None:
    def summary(filters: ReportFilters) -> tuple[int, list[str], list[str]]:
        requests = sum(p.requests for p in time_series(filters))
        subjects = [r["subject_id"] for r in top_consumers(filters).rows]
        endpoints = [r["endpoint"] for r in throttled_endpoints(filters).rows]
        return requests, subjects, endpoints

    assert summary(day()) == (118, ["ApiKey:2", "ApiKey:1", "2001:db8::/64", "42", "ApiKey:3"], ["refunds", "charges"])
    assert summary(day(subject_kind="api_key", subject_id="ApiKey:1")) == (48, ["ApiKey:1"], ["refunds", "charges"])
    assert summary(day(subject_kind="user", subject_id="ApiKey:1")) == (0, [], [])  # the kind counts
    assert summary(day(tier="free")) == (56, ["ApiKey:1", "42", "ApiKey:3"], ["refunds", "charges"])
    assert summary(day(endpoint="refunds")) == (20, ["ApiKey:1", "2001:db8::/64", "ApiKey:3"], ["refunds"])
    assert summary(day(organization="globex")) == (54, ["ApiKey:2"], [])
    assert summary(day(organization="acme", endpoint="charges")) == (38, ["ApiKey:1"], ["charges"])


def test_subjects_link_to_their_effective_policy(traffic: None) -> None:
    effective = reverse("admin:ratelimits_effective_policy")
    links = {r["subject_id"]: r["links"].get("subject_id") for r in top_consumers(day()).rows}

    def params(link: str | None) -> dict[str, list[str]]:
        assert link is not None and link.startswith(effective + "?")
        return parse_qs(urlsplit(link).query)

    assert params(links["ApiKey:1"]) == {
        "api_key": ["ApiKey:1"],
        "org": ["acme"],
        "endpoint": ["charges"],
        "method": ["GET"],
    }
    assert params(links["42"]) == {"user": ["42"], "endpoint": ["charges"], "method": ["GET"]}
    # An aggregated IPv6 network: its address, which the effective page aggregates back to it.
    assert params(links["2001:db8::/64"]) == {"ip": ["2001:db8::"], "endpoint": ["refunds"], "method": ["GET"]}
    assert effective_policy_url("ip", "unknown", endpoint="charges") == ""


def test_the_linked_effective_policy_page_is_filled_in(admin_client: Client, traffic: None) -> None:
    link = top_consumers(day()).rows[1]["links"]["subject_id"]
    response = admin_client.get(link)
    assert response.status_code == 200
    form = response.context["form"]
    assert form.is_valid(), form.errors
    assert (form.cleaned_data["api_key"], form.cleaned_data["org"], form.cleaned_data["endpoint"]) == (
        "ApiKey:1",
        "acme",
        "charges",
    )


# -- periods not rolled up, and live rows -------------------------------------------------------------


@pytest.fixture
def minutes() -> int:
    """Three subjects' minute rows over 3 h 20 min from START, as the drain writes them; returns their requests."""
    rows = []
    for m in range(0, 200, 7):
        at = START + timedelta(minutes=m)
        counts = {"allowed": m % 5 + 1, "throttled": m % 3, "tokens": 2 * (m % 5 + 1)}
        rows.append(record("ApiKey:1", at, granularity="minute", organization="acme", tier="free", **counts))
        if m % 2:
            rows.append(record("42", at, kind="user", endpoint="refunds", granularity="minute", allowed=3, shed=1))
        if m % 3 == 0:
            rows.append(record("ip", at, kind="overflow", granularity="minute", allowed=2, degraded=1, tokens=2))
    return sum(row.requests for row in rows)


def everything(granularity: str, days: int) -> tuple[Any, ...]:
    """What the report shows of ``days`` from START: the series, every table, the caveats."""
    filters = ReportFilters(start=START, end=START + timedelta(days=days), granularity=granularity)
    return time_series(filters), [build(filters, "requests", ()).rows for build in TABLES.values()], caveats(filters)


def test_periods_not_rolled_up_are_summed_from_their_minutes_as_the_roll_up_sums_them(minutes: int) -> None:
    before = {granularity: everything(granularity, 2) for granularity in ("hour", "day")}
    assert sum(p.requests for p in before["hour"][0]) == minutes == sum(p.requests for p in before["day"][0])
    assert [p.requests > 0 for p in before["hour"][0][:5]] == [True, True, True, True, False]

    rollup(now=START + 2 * HOUR + timedelta(minutes=10))  # the first two hours; the rest is under way
    assert UsageRecord.objects.filter(granularity="hour").count() == 3 * 2  # three subjects, two hours
    assert {granularity: everything(granularity, 2) for granularity in ("hour", "day")} == before

    rollup(now=START + timedelta(days=1, hours=1))  # every hour, and the day
    assert UsageRecord.objects.filter(granularity="day").count() == 3
    # Minutes and the hours and the day summed from them are all there now: each is read once.
    assert {granularity: everything(granularity, 2) for granularity in ("hour", "day")} == before


def test_a_rolled_up_period_is_read_from_its_own_rows_only() -> None:
    record("ApiKey:1", START, allowed=10)  # the hour as the roll-up wrote it
    record("ApiKey:1", START + timedelta(minutes=59), granularity="minute", allowed=1)  # drained after it
    record("ApiKey:1", START + HOUR, granularity="minute", allowed=4)  # an hour not rolled up yet
    assert [p.allowed for p in time_series(day())][:3] == [10, 4, 0]
    # Where the roll-up got is the same for every subject: a filtered report adds up to the whole.
    record("42", START + HOUR + timedelta(minutes=5), kind="user", granularity="minute", allowed=2)
    apart = [
        time_series(day(subject_kind=kind, subject_id=value))
        for kind, value in (("api_key", "ApiKey:1"), ("user", "42"))
    ]
    assert [sum(p.allowed for p in series) for series in apart] == [14, 2]


def test_the_roll_up_sets_a_day_from_all_of_its_hours() -> None:
    for hour in range(24):
        record("ApiKey:1", START + hour * HOUR, allowed=1)
    rollup(now=START + timedelta(days=2, hours=10))  # its 48 hours start at 10:00 on START's day
    assert UsageRecord.objects.get(granularity="day", period_start=START).allowed == 24


def test_live_rows_count_as_they_will_once_drained() -> None:
    # 25 subjects, every total and share distinct: no ties for the tables to break.
    for n in range(25):
        record(f"ApiKey:{n}", START, granularity="minute", allowed=100 + 10 * n, throttled=n, tokens=1000 - 7 * n)
    later = START + timedelta(minutes=30)
    live = [
        LiveRow(later, "api_key", "ApiKey:0", "charges", allowed=500, tokens=500),  # the last, to the top
        # The two most throttled, diluted: the table's last place goes to one the database ranked 21st.
        LiveRow(later, "api_key", "ApiKey:24", "charges", allowed=1000, tokens=1000),
        LiveRow(later, "api_key", "ApiKey:23", "charges", allowed=1000, tokens=1000),
        LiveRow(later, "api_key", "ApiKey:99", "refunds", allowed=1, throttled=5, tokens=1),  # only live
        LiveRow(later, "overflow", "ip", "charges", allowed=9, tokens=9),
        LiveRow(START + 25 * HOUR, "api_key", "ApiKey:7", "charges", allowed=10_000),  # outside the range
    ]
    every_filter = [day(), day(endpoint="refunds"), day(subject_kind="api_key", subject_id="ApiKey:0"), day(tier="x")]

    def report(rows: list[LiveRow]) -> list[Any]:
        return [
            (
                [dataclasses.replace(p, live=False) for p in time_series(f, rows)],
                [build(f, by, rows).rows for build in TABLES.values() for by in ("requests", "tokens")],
                caveats(f, rows),
            )
            for f in every_filter
        ]

    merged = report(live)
    assert [p.live for p in time_series(day(), live)][:2] == [True, False]
    assert top_consumers(day(), live=live).rows[0]["subject_id"] == "ApiKey:24"
    assert [row["subject_id"] for row in near_limit(day(), live=live).rows][-2:] == ["ApiKey:5", "ApiKey:4"]
    for row in live:  # drained, as the drain writes them
        record(
            row.subject_id,
            row.period_start,
            kind=row.subject_kind,
            endpoint=row.endpoint,
            granularity="minute",
            **{m: getattr(row, m) for m in ("allowed", "throttled", "shed", "degraded", "tokens")},
        )
    assert merged == report([])


# -- the page -----------------------------------------------------------------------------------------


def test_the_report_page(admin_client: Client, traffic: None) -> None:
    assert reverse("admin:ratelimits_usage_report") == URL
    response = admin_client.get(URL, query())
    assert response.status_code == 200
    html = response.content.decode()
    assert response.context["title"] == "Usage report"
    # The chart: 4 hours with traffic, one bar segment per non-zero outcome of each.
    chart = str(response.context["chart"])
    assert chart.startswith("<svg") and 'role="img"' in chart and "<title" in chart and "<desc" in chart
    assert len(re.findall(r"<rect x=", chart)) == 3 + 3 + 3 + 2 + 4  # the outcomes of 4 hours, and 4 legend swatches
    assert "<script" not in html.split('id="content-main"')[1]
    assert "http://" not in chart.replace("http://www.w3.org/2000/svg", "")
    for name in ("series", *TABLES):
        assert f'id="section-{name}"' in html and f"format=csv&amp;table={name}" in html, name
        # Every table has rows but the billing periods', which needs the report of one subject.
        assert (f'id="table-{name}"' in html) == (name != "billing_periods"), name
    assert "118 requests in the range" in html
    assert reverse("admin:ratelimits_effective_policy") + "?api_key=ApiKey%3A1" in html


def test_the_default_report_covers_the_last_24_hours(admin_client: Client) -> None:
    now = datetime.now(tz=UTC)
    record("ApiKey:1", now.replace(minute=0, second=0, microsecond=0) - HOUR, allowed=7)
    record("ApiKey:1", now - timedelta(days=2), allowed=1000)
    response = admin_client.get(URL)
    assert response.status_code == 200
    form = response.context["form"]
    assert form.cleaned_data["granularity"] == "hour"
    assert timedelta(hours=24) == form.cleaned_data["to"] - form.cleaned_data["from"]
    assert abs(form.cleaned_data["to"] - now) < timedelta(minutes=2)
    assert form["from"].value()  # shown in the form, not left blank
    series = response.context["sections"][0]["table"].rows
    assert len(series) == 24
    assert sum(row["allowed"] for row in series) == 7


def test_a_young_install_gets_its_last_hour_by_minute(admin_client: Client) -> None:
    now = datetime.now(tz=UTC)
    fresh = admin_client.get(URL).context["form"].cleaned_data
    assert fresh["granularity"] == "minute" and fresh["to"] - fresh["from"] == timedelta(hours=1)
    assert abs(fresh["to"] - now) < timedelta(minutes=2)
    record("ApiKey:1", now - timedelta(minutes=30), granularity="minute", allowed=3)
    response = admin_client.get(URL)
    assert response.context["form"].cleaned_data["granularity"] == "minute"
    assert sum(row["allowed"] for row in response.context["sections"][0]["table"].rows) == 3
    # A filter alone, or a blank form, asks for no range: the report still fits the data, filtered.
    narrowed = admin_client.get(URL, {"endpoint": "charges", "from": "", "to": "", "granularity": ""})
    assert narrowed.context["form"].cleaned_data["granularity"] == "minute"
    assert narrowed.context["filters"].endpoint == "charges"
    # Anything of the range given wins: a granularity alone gets the last 24 hours of it.
    hourly = admin_client.get(URL, {"granularity": "hour"}).context["form"].cleaned_data
    assert hourly["granularity"] == "hour" and hourly["to"] - hourly["from"] == timedelta(hours=24)
    # Once a row is older than an hour, the install is not young.
    record("ApiKey:1", now - timedelta(minutes=61), granularity="minute", allowed=1)
    assert admin_client.get(URL).context["form"].cleaned_data["granularity"] == "hour"


def test_csv_export_matches_every_table(admin_client: Client, traffic: None) -> None:
    filters = day()
    page = admin_client.get(URL, query())
    for section in page.context["sections"]:
        table = section["table"]
        expected = (
            series_table(time_series(filters))
            if table.name == "series"
            else TABLES[table.name](filters, "requests", ())
        )
        rows = csv_of(admin_client.get(URL, {**query(), "format": "csv", "table": table.name}))
        assert rows[0] == table.header() == expected.header()
        assert rows[1:] == table.csv_rows() == expected.csv_rows()
        assert len(rows) - 1 == len(section["cells"])
        # The page's own link gives the same file.
        assert csv_of(admin_client.get(section["csv_url"])) == rows
    consumers = csv_of(admin_client.get(URL, {**query(), "format": "csv", "table": "top_consumers"}))
    assert consumers[1] == ["api_key", "ApiKey:2", "globex", "charges", "54", "50", "0", "0", "4", "500", "0.0000"]
    series = csv_of(admin_client.get(URL, {**query(), "format": "csv"}))  # the time series by default
    assert len(series) == 25 and series[1][0] == "2025-03-01T00:00:00Z"


def test_csv_export_follows_the_filters_and_the_ranking(admin_client: Client, traffic: None) -> None:
    rows = csv_of(admin_client.get(URL, {**query(endpoint="refunds"), "format": "csv", "table": "top_consumers"}))
    assert [row[1] for row in rows[1:]] == ["ApiKey:1", "2001:db8::/64", "ApiKey:3"]
    by_tokens = csv_of(admin_client.get(URL, {**query(by="tokens"), "format": "csv", "table": "top_consumers"}))
    assert [row[1] for row in by_tokens[1:3]] == ["ApiKey:2", "ApiKey:1"]
    assert [row[9] for row in by_tokens[1:]] == ["500", "50", "5", "1", "0"]


def test_csv_cells_never_start_a_formula(admin_client: Client) -> None:
    record("ApiKey:9", START, organization="=HYPERLINK(1)", allowed=1)
    rows = csv_of(admin_client.get(URL, {**query(), "format": "csv", "table": "top_consumers"}))
    assert rows[1][2] == "'=HYPERLINK(1)"


def test_permissions(client: Client, viewer_client: Client, django_user_model: Any) -> None:
    assert viewer_client.get(URL).status_code == 200
    assert viewer_client.get(URL, {"format": "csv", "table": "near_limit"}).status_code == 200

    staff = django_user_model.objects.create_user("staff", password="pw", is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(codename="view_auditentry"))
    staff_client = Client()
    staff_client.force_login(staff)
    assert staff_client.get(URL).status_code == 403
    assert staff_client.get(URL, {"format": "csv", "table": "series"}).status_code == 403

    outsider = django_user_model.objects.create_user("outsider", password="pw")
    outsider_client = Client()
    outsider_client.force_login(outsider)
    for anyone in (client, outsider_client):  # not staff: the admin's login page
        response = anyone.get(URL)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        (query(to="2025-02-28 00:00"), "to", "To must be after From."),
        (query(to="2025-03-01 00:00"), "to", "To must be after From."),
        ({"from": "2025-03-01", "to": "2025-03-04", "granularity": "minute"}, "from", "at most 2 days"),
        ({"from": "2025-01-01", "to": "2025-03-01", "granularity": "hour"}, "from", "at most 31 days"),
        ({"from": "2024-01-01", "to": "2025-03-01", "granularity": "day"}, "from", "at most 366 days"),
        (query(**{"from": "yesterday"}), "from", "is not a date and time"),
        (query(to="2025-13-45 99:00"), "to", "is not a date and time"),
        ({"to": "0001-01-01 05:00"}, "to", "is out of range: give a moment from 1970-01-01 00:00 to 9999-01-01"),
        ({"from": "9999-12-31 22:00", "to": "9999-12-31 23:59"}, "from", "is out of range"),
        ({"from": "1970-01-01T01:00+02:00", "to": "1970-01-01 05:00"}, "from", "is out of range"),
        (query(granularity="week"), "granularity", "Select a valid choice"),
        (query(subject="ApiKey:1"), "subject", "give kind:id"),
        (query(subject="api_key:"), "subject", "give kind:id"),
        (query(endpoint="/v1/charges"), "endpoint", ""),
        (query(by="bytes"), "by", "Select a valid choice"),
    ],
)
def test_bad_input_is_a_form_error(admin_client: Client, params: dict[str, str], field: str, message: str) -> None:
    response = admin_client.get(URL, params)
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert field in errors, errors
    assert message in " ".join(errors[field])
    assert "chart" not in response.context
    assert "errorlist" in response.content.decode()
    csv_response = admin_client.get(URL, {**params, "format": "csv", "table": "series"})
    assert csv_response.status_code == 400
    assert csv_response.content.decode().startswith("Invalid report:")


def test_ranges_at_the_limit_and_offsets_are_accepted(admin_client: Client) -> None:
    two_days = admin_client.get(URL, {"from": "2025-03-01T00:00Z", "to": "2025-03-03T00:00Z", "granularity": "minute"})
    assert two_days.status_code == 200 and two_days.context["form"].is_valid()
    assert len(two_days.context["sections"][0]["table"].rows) == 2 * 24 * 60
    assert two_days.context["sections"][0]["cells"] == []  # not listed on the page: in the CSV
    assert "2880 periods: too many to list here" in two_days.content.decode()
    offset = admin_client.get(URL, {"from": "2025-03-01T02:00+02:00", "to": "2025-03-01T03:00+02:00"})
    assert offset.context["filters"].start == START  # 02:00 at +02:00 is midnight UTC
    assert [row["period_start"] for row in offset.context["sections"][0]["table"].rows] == [START]


def test_unknown_csv_table_is_a_bad_request(admin_client: Client) -> None:
    response = admin_client.get(URL, {**query(), "format": "csv", "table": "passwords"})
    assert response.status_code == 400
    assert "Unknown table" in response.content.decode()


# -- the chart ----------------------------------------------------------------------------------------


def test_chart_is_accessible_with_totals_and_legend(traffic: None) -> None:
    chart = str(render_chart(time_series(day()), "hour"))
    assert 'aria-label="Requests per hour by outcome"' in chart
    assert 'aria-describedby="usage-chart-desc"' in chart
    desc = re.search(r'<desc id="usage-chart-desc">(.*?)</desc>', chart)
    assert desc is not None
    assert "91 allowed, 20 throttled (429), 3 shed (503), 4 degraded" in desc.group(1)
    assert "Busiest period: 2025-03-01 00:00 with 69 requests" in desc.group(1)
    assert chart.count('class="series"') == 4  # one group per outcome
    legend = chart.split('<g class="legend">')[1]
    assert [m for m in ("allowed: 91", "throttled (429): 20", "shed (503): 3", "degraded: 4") if m in legend] == [
        "allowed: 91",
        "throttled (429): 20",
        "shed (503): 3",
        "degraded: 4",
    ]


def test_long_series_are_drawn_as_lines_and_empty_ones_say_so() -> None:
    record("ApiKey:1", START + timedelta(minutes=3), granularity="minute", allowed=5, throttled=2)
    minutes = ReportFilters(start=START, end=START + timedelta(hours=4), granularity="minute")
    series = time_series(minutes)
    assert len(series) == 240 > MAX_BARS
    chart = str(render_chart(series, "minute"))
    assert 'data-kind="lines"' in chart
    assert len(re.findall(r"<path ", chart)) == 4
    assert len(re.findall(r"<rect ", chart)) == 4  # the legend's swatches only
    next_day = ReportFilters(start=START + 24 * HOUR, end=START + 48 * HOUR)
    empty = str(render_chart(time_series(next_day), "hour"))
    assert "No usage recorded in this range" in empty
    assert 'data-kind="stacked bars"' in empty


def test_the_page_says_how_much_is_in_overflow_rows_and_under_digests(settings: Any, admin_client: Client) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"MAX_SUBJECTS": 2500}})
    record("ApiKey:1", START, allowed=10)
    record("ip", START, kind="overflow", endpoint="charges", allowed=1200, throttled=34)
    record("digest:AAAAAAAAAAAAAAAA", START + HOUR, kind="ip", allowed=5, throttled=2)
    assert caveats(day()) == Caveats(overflow=1234, unresolved=7)
    html = admin_client.get(URL, query()).content.decode()
    overflow = html.split('id="usage-overflow"')[1].split("</p>")[0]
    assert "1,234 of these requests" in overflow and "2,500 subjects" in overflow
    assert "7 of these requests" in html.split('id="usage-unresolved"')[1].split("</p>")[0]
    # The rows themselves are listed, each under its marker, and link to no effective policy.
    top = top_consumers(day())
    assert [(r["subject_kind"], r["subject_id"], r["links"]) for r in top.rows] == [
        ("overflow", "ip", {}),
        ("api_key", "ApiKey:1", {"subject_id": effective_policy_url("api_key", "ApiKey:1", endpoint="charges")}),
        ("ip", "digest:AAAAAAAAAAAAAAAA", {}),
    ]


def test_the_page_says_nothing_of_overflow_when_there_is_none(admin_client: Client, traffic: None) -> None:
    assert caveats(day()) == Caveats()
    html = admin_client.get(URL, query()).content.decode()
    assert 'id="usage-overflow"' not in html and 'id="usage-unresolved"' not in html


def test_the_chart_starts_at_the_traffic_when_the_range_begins_empty(admin_client: Client) -> None:
    end = START + timedelta(days=1)
    record("ApiKey:1", end - timedelta(minutes=3), granularity="minute", allowed=5)
    series = time_series(ReportFilters(start=START, end=end, granularity="minute"))
    shown = chart_periods(series)
    assert len(series) == 1440 and list(shown) == series[-MIN_PERIODS:]
    # The first period with requests, when more than MIN_PERIODS come after it; nothing left out when the start is busy.
    record("ApiKey:1", end - timedelta(hours=2), granularity="minute", allowed=1)
    series = time_series(ReportFilters(start=START, end=end, granularity="minute"))
    assert chart_periods(series)[0].start == end - timedelta(hours=2) and len(chart_periods(series)) == 120
    assert chart_periods(series[-200:]) == series[-120:]
    assert chart_periods(time_series(day())) == time_series(day())  # nothing recorded: nothing to start at

    response = admin_client.get(URL, {"from": "2025-03-01 00:00", "to": "2025-03-02 00:00", "granularity": "minute"})
    html = response.content.decode()
    assert 'data-kind="stacked bars"' in str(response.context["chart"])  # 120 periods: bars, not a one-pixel line
    assert "The 1,320 periods before the first, in which nothing was recorded, are not drawn." in html
    assert "The chart starts at 2025-03-01 22:00" in html.split('id="usage-chart-starts"')[1].split("</p>")[0]
    assert len(response.context["sections"][0]["table"].rows) == 1440  # the table and its CSV have every period


def test_live_periods_are_marked_in_the_chart_and_the_table() -> None:
    series = [Period(START + i * HOUR, allowed=i) for i in range(3)] + [Period(START + 3 * HOUR, allowed=2, live=True)]
    chart = str(render_chart(series, "hour"))
    assert chart.count('class="live-band"') == 1 and chart.count('data-live="1"') == 1
    assert "live (not drained yet)" in chart.split('<g class="legend">')[1]
    assert "Live (counted in the store, not drained yet): 2025-03-01 03:00." in chart
    assert "live" not in str(render_chart(series[:3], "hour"))
    assert [row[-1] for row in series_table(series).csv_rows()] == ["", "", "", "live"]
