"""The usage report in a real headless browser: Debian's Chromium driven by Playwright.

The page is served by pytest-django's ``live_server``; the screenshots are written to
test-artifacts/usage-report.png and usage-report-live.png. The second test is a fresh demo:
``seed_demo`` on an empty database, the demo's settings, API requests over HTTP, one drain as the
demo's timer runs it and more requests after it, and no roll-up.
"""

from __future__ import annotations

import csv
import io
import time
from datetime import UTC, datetime, timedelta
from importlib import import_module
from io import StringIO
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection
from django.urls import reverse

from project.payments.management.commands.seed_demo import ADMIN, DEMO_KEYS
from project.payments.models import ApiKey, hash_key
from project.settings import RATELIMITS as DEMO_RATELIMITS
from ratelimits import engine
from ratelimits.models import UsageRecord
from ratelimits.usage import drain
from ratelimits.usage.subjects import write_pending

from .support.browser import PASSWORD, launch, log_in, screenshot_path, watch
from .support.http import fetch

HOURS = range(1, 23)  # hours before the current one: inside the default 24 hours, whenever the test runs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(900)]


def seed() -> dict[str, int]:
    """An API key, a user and a client IP over the last day; returns the hours with each outcome."""
    this_hour = datetime.now(tz=UTC).replace(minute=0, second=0, microsecond=0)
    rows = []
    for k in HOURS:
        start = this_hour - timedelta(hours=k)
        common = {"granularity": "hour", "period_start": start}
        rows += [
            UsageRecord(
                **common,
                subject_kind="api_key",
                subject_id="ApiKey:7",
                organization="acme",
                tier="standard",
                endpoint="charges",
                allowed=20 + k,
                throttled=4 if k % 3 == 0 else 0,
                tokens=2 * (20 + k),
            ),
            UsageRecord(
                **common,
                subject_kind="user",
                subject_id="42",
                tier="free",
                endpoint="refunds",
                allowed=5,
                shed=2 if k % 5 == 0 else 0,
                tokens=5,
            ),
            UsageRecord(
                **common,
                subject_kind="ip",
                subject_id="203.0.113.9",
                tier="anonymous",
                endpoint="search",
                allowed=1,
                throttled=3 if k % 4 == 0 else 0,
                degraded=1 if k % 7 == 0 else 0,
                tokens=1,
            ),
        ]
    UsageRecord.objects.bulk_create(rows)
    return {
        "allowed": len(HOURS),
        "throttled": sum(1 for k in HOURS if k % 3 == 0 or k % 4 == 0),
        "shed": sum(1 for k in HOURS if k % 5 == 0),
        "degraded": sum(1 for k in HOURS if k % 7 == 0),
    }


def table_rows(page: Any, name: str) -> list[list[str]]:
    rows: list[list[str]] = page.eval_on_selector_all(
        f"#table-{name} tbody tr", "rows => rows.map(r => Array.from(r.cells, c => c.textContent.trim()))"
    )
    return rows


def bars(page: Any) -> dict[str, int]:
    counts: dict[str, int] = page.eval_on_selector_all(
        "#usage-chart g.series",
        "gs => Object.fromEntries(gs.map(g => [g.dataset.outcome, g.querySelectorAll('rect').length]))",
    )
    return counts


def test_usage_report_in_chromium(chromium: str, live_server: Any, django_user_model: Any) -> None:
    # All database work happens before Playwright starts (its sync API runs an event loop here).
    django_user_model.objects.create_superuser("ops", "ops@example.com", PASSWORD)
    hours_with = seed()
    screenshot = screenshot_path("usage-report.png")
    page_url = live_server.url + reverse("admin:ratelimits_usage_report")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        problems = watch(page)
        requested: list[str] = []
        page.on("request", lambda req: requested.append(req.url))
        log_in(page, page_url, "ops")
        assert page.title().startswith("Usage report")
        page.wait_for_selector("#usage-chart")
        chart = page.evaluate(
            """() => {
                const svg = document.querySelector('#usage-chart');
                const box = svg.getBoundingClientRect();
                return {
                    role: svg.getAttribute('role'),
                    label: svg.getAttribute('aria-label'),
                    title: svg.querySelector('title').textContent,
                    desc: svg.querySelector('desc').textContent,
                    width: box.width,
                    height: box.height,
                    legend: Array.from(svg.querySelectorAll('.legend text'), t => t.textContent),
                    xLabels: svg.querySelectorAll('.x-axis text').length,
                    yLabels: svg.querySelectorAll('.y-axis text').length,
                    scripts: document.querySelectorAll('#content-main script').length,
                };
            }"""
        )
        drawn = bars(page)
        series = table_rows(page, "series")
        consumers = table_rows(page, "top_consumers")
        throttled = table_rows(page, "throttled_subjects")
        endpoints = table_rows(page, "throttled_endpoints")
        near = table_rows(page, "near_limit")
        headers = page.eval_on_selector_all(
            "#table-top_consumers thead th", "ths => ths.map(th => th.textContent.trim())"
        )
        page.screenshot(path=str(screenshot), full_page=True)

        # The CSV link downloads the table as shown.
        with page.expect_download() as download_info:
            page.click("#section-top_consumers a.csv-link")
        download = download_info.value
        downloaded = list(csv.reader(io.StringIO(Path(download.path()).read_text())))

        # Narrow the report to one endpoint with the form.
        page.fill("#id_endpoint", "refunds")
        page.click("#usage-form input[type=submit]")
        page.wait_for_url("**endpoint=refunds**")
        narrowed = bars(page)
        narrowed_consumers = table_rows(page, "top_consumers")

        # A subject's link opens its effective policy, filled in.
        page.click("#table-top_consumers tbody a")
        page.wait_for_url("**/fleetsettings/effective/**")
        effective = (page.title(), page.input_value("#id_user"), page.input_value("#id_endpoint"))

    # Downloads end their navigation as "aborted" in Chromium: that is the download, not a failure.
    problems = [
        p for p in problems if not (p.startswith("request failed:") and "format=csv" in p and "ERR_ABORTED" in p)
    ]
    assert problems == []
    assert all(url.startswith(live_server.url) for url in requested), "something was loaded from elsewhere"
    assert screenshot.stat().st_size > 10_000

    assert chart["role"] == "img" and chart["label"] == "Requests per hour by outcome" == chart["title"]
    assert chart["desc"].startswith("Stacked bars, 24 periods from ")
    assert chart["width"] > 800 and chart["height"] > 250
    assert chart["legend"][0] == f"allowed: {sum(20 + k + 5 + 1 for k in HOURS):,}"
    assert chart["xLabels"] >= 5 and chart["yLabels"] >= 3
    assert chart["scripts"] == 0
    assert drawn == hours_with  # one bar segment per hour and outcome with requests

    assert len(series) == 24
    assert headers[:4] == ["Kind", "Subject", "Organisation", "Endpoint"]
    assert [row[:4] for row in consumers] == [
        ["api_key", "ApiKey:7", "acme", "charges"],
        ["user", "42", "—", "refunds"],
        ["ip", "203.0.113.9", "—", "search"],
    ]
    assert [row[1] for row in throttled] == ["ApiKey:7", "203.0.113.9"]
    assert [row[0] for row in endpoints] == ["charges", "search"]
    assert {row[1] for row in near} == {"ApiKey:7", "203.0.113.9"}

    assert downloaded[0] == headers
    assert [row[:2] for row in downloaded[1:]] == [["api_key", "ApiKey:7"], ["user", "42"], ["ip", "203.0.113.9"]]
    assert downloaded[1][4] == consumers[0][4].replace(",", "")

    assert narrowed == {"allowed": len(HOURS), "throttled": 0, "shed": hours_with["shed"], "degraded": 0}
    assert [row[1] for row in narrowed_consumers] == ["42"]
    assert effective[0].startswith("Effective policy") and effective[1:] == ("42", "refunds")


@pytest.fixture(params=["memory", "redis"])
def fresh_demo(request: pytest.FixtureRequest, settings: Any) -> dict[str, str]:
    """``make demo`` on an empty database: its settings (on the memory backend, or the private Redis) and seed.

    Returns the subject of each demo key, by the key.
    """
    store: dict[str, Any] = {"BACKEND": "memory"}
    if request.param == "redis":
        store = {"BACKEND": "redis", "REDIS": {"URL": request.getfixturevalue("use_redis").url}}
    settings.RATELIMITS = {**DEMO_RATELIMITS, **store}
    # What `migrate` seeds, again: an earlier transactional test's flush may have emptied the tables.
    with connection.schema_editor() as editor:
        import_module("ratelimits.migrations.0002_seed_tiers").seed(apps, editor)
    call_command("seed_demo", stdout=StringIO())
    return {raw: f"ApiKey:{ApiKey.objects.get(key_hash=hash_key(raw)).pk}" for _, _, _, raw in DEMO_KEYS}


def call_api(port: int, raw_key: str, count: int) -> tuple[list[int], set[int]]:
    """``count`` calls of GET /v1/customers with ``raw_key``: their statuses, and the minutes they were made in."""
    minutes = {int(time.time() // 60)}
    statuses = [
        fetch(port, "GET", "/v1/customers", headers={"Authorization": f"Bearer {raw_key}"}).status for _ in range(count)
    ]
    minutes.add(int(time.time() // 60))
    engine.get_limiter().flush_usage(now=True)  # what a worker decided itself reaches the store within a second
    write_pending()  # the callers' labels, which the server writes after its first responses anyway
    return statuses, minutes


def column(rows: list[list[str]], index: int) -> list[int]:
    return [int(row[index].replace(",", "")) for row in rows]


def test_a_fresh_demo_reports_the_traffic_of_the_last_minutes_at_once(
    chromium: str, live_server: Any, fresh_demo: dict[str, str]
) -> None:
    port = urlsplit(live_server.url).port
    assert port is not None
    (free_key, standard_key) = (raw for _, _, _, raw in DEMO_KEYS)
    # Drained once, as the demo's timer does every 30 s; then more traffic, not drained yet. Nothing is rolled up.
    drained, drained_minutes = call_api(port, standard_key, 4)
    assert drain(now=time.time() + 120) >= 1
    undrained, live_minutes = call_api(port, free_key, 9)  # Acme's customer listing is held to 5, then 2/s
    statuses = drained + undrained
    assert set(statuses) <= {200, 429} and 429 in statuses
    allowed, throttled = statuses.count(200), statuses.count(429)
    traffic_minutes = {period(m, "%Y-%m-%d %H:%M") for m in drained_minutes | live_minutes}
    live_periods = {period(m, "%Y-%m-%d %H:%M") for m in live_minutes}
    live_hours = {period(m, "%Y-%m-%d %H:00") for m in live_minutes}
    screenshot = screenshot_path("usage-report-live.png")
    page_url = live_server.url + reverse("admin:ratelimits_usage_report")

    with launch(chromium) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        problems = watch(page)
        log_in(page, page_url, ADMIN[0], ADMIN[1])
        page.wait_for_selector("#usage-chart")
        granularity = page.input_value("#id_granularity")
        by_minute = table_rows(page, "series")
        totals = " ".join((page.text_content("#usage-totals") or "").split())
        live_note = " ".join((page.text_content("#usage-live") or "").split())
        chart = page.evaluate(
            """() => ({
                desc: document.querySelector('#usage-chart desc').textContent,
                bands: document.querySelectorAll('#usage-chart rect.live-band').length,
                liveBars: document.querySelectorAll('#usage-chart g.series rect[data-live]').length,
                legend: Array.from(document.querySelectorAll('#usage-chart .legend text'), t => t.textContent),
            })"""
        )
        consumers = table_rows(page, "top_consumers")
        page.screenshot(path=str(screenshot), full_page=True)

        # By hour, as the report opened before: the hour under way is summed from its minutes.
        page.select_option("#id_granularity", "hour")
        page.fill("#id_from", "")
        page.fill("#id_to", "")
        page.click("#usage-form input[type=submit]")
        page.wait_for_url("**granularity=hour**")
        by_hour = table_rows(page, "series")

    assert problems == []
    assert granularity == "minute"  # a young install: its last hour, by minute
    assert len(by_minute) == 60
    busy = [row for row in by_minute if row[1] != "0"]
    assert {row[0] for row in busy} <= traffic_minutes
    assert sum(column(busy, 1)) == len(statuses)
    assert (sum(column(busy, 2)), sum(column(busy, 3))) == (allowed, throttled)
    live = {row[0] for row in by_minute if row[-1] == "live"}
    assert live and live <= live_periods  # the minutes not drained yet, and only those
    assert totals.startswith(f"{len(statuses)} requests in the range: {allowed} allowed, {throttled} throttled")
    assert "from" in live_note and "not drained into the database yet" in live_note
    assert chart["bands"] == len(live) and chart["liveBars"] >= len(live)
    assert "live (not drained yet)" in chart["legend"]
    assert "Live (counted in the store, not drained yet)" in chart["desc"]
    assert sorted((row[1], row[4]) for row in consumers) == sorted(
        [(fresh_demo[free_key], str(len(undrained))), (fresh_demo[standard_key], str(len(drained)))]
    )
    assert screenshot.stat().st_size > 10_000

    assert len(by_hour) == 24
    assert sum(column(by_hour, 1)) == len(statuses) and sum(column(by_hour, 2)) == allowed
    live_by_hour = {row[0] for row in by_hour if row[-1] == "live"}
    assert live_by_hour and live_by_hour <= live_hours


def period(minute: int, written: str) -> str:
    """The period of ``minute`` (since the epoch) as the report's table writes its start (``written``: its format)."""
    return datetime.fromtimestamp(minute * 60, tz=UTC).strftime(written)
