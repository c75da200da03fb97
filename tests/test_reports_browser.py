"""The usage report in a real headless browser: Debian's Chromium driven by Playwright.

The page is served by pytest-django's ``live_server``; the screenshot is written to
test-artifacts/usage-report.png.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.urls import reverse

from ratelimits.models import UsageRecord

from .support.browser import PASSWORD, launch, log_in, screenshot_path, watch

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
