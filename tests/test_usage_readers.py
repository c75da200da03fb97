"""One truth in every usage reader: the customer API, the admin report, its CSV and ``today`` agree.

The finding: ``GET /v1/usage?granularity=hour`` (and ``day``) answered ``count: 0`` for today
while the admin report showed 50 requests: the report summed finer rows and the minutes not
drained yet, the customer API read stored rows of the one granularity only; and
``/v1/rate_limit``'s ``today`` lagged by up to a drain. Now each reads
:mod:`ratelimits.reports.queries`: the rolled-up rows, the finer rows not rolled up yet, and the
live minutes from the store. Checked for one caller right after traffic (everything live), after
a drain (rows and live minutes mixed) and after a roll-up, on the memory backend and on Redis.
"""

from __future__ import annotations

import csv
import io
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.usage import drain, rollup
from ratelimits.usage.readers import floor_period
from ratelimits.usage.subjects import write_pending

from .factories import ApiKeyFactory
from .support.clients import client_for

REPORT = "/admin/ratelimits/fleetsettings/usage/"
#: The readers' own calls are exempt (``/v1/rate_limit`` spends nothing anyway): reading does not add to what is read.
LIMITS = {
    "TIERS": {"anonymous": {"rate": "5/m"}, "authenticated": {"rate": "3/m", "burst": 3}},
    "POLICIES": {"EXEMPT_ENDPOINTS": ["usage"]},
}
COUNTED = ("allowed", "throttled")


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, settings: Any) -> str:
    if request.param == "redis":
        request.getfixturevalue("use_redis")
    settings.RATELIMITS = {**settings.RATELIMITS, **LIMITS}
    return str(request.param)


def traffic(caller: APIClient, count: int) -> list[int]:
    """``count`` requests; their statuses, once their usage is in the store and its subject labelled."""
    statuses = [caller.get("/v1/customers").status_code for _ in range(count)]
    engine.get_limiter().flush_usage(now=True)
    write_pending()
    return statuses


def moment(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def customer_api(caller: APIClient, granularity: str, start: datetime, end: datetime) -> tuple[dict[str, int], bool]:
    """The caller's ``/v1/usage`` summed over the range, and whether any row was live."""
    response = caller.get("/v1/usage", {"granularity": granularity, "from": moment(start), "to": moment(end)})
    assert response.status_code == 200, response.content
    rows = response.json()["results"]
    return {m: sum(row[m] for row in rows) for m in COUNTED}, any(row["live"] for row in rows)


def admin_report(admin: Client, subject: str, granularity: str, start: datetime, end: datetime) -> dict[str, int]:
    """The report page's series for the subject, summed; checked against its CSV export of the same."""
    params = {"subject": subject, "granularity": granularity, "from": moment(start), "to": moment(end)}
    response = admin.get(REPORT, params)
    assert response.status_code == 200 and response.context["form"].is_valid(), response.context["form"].errors
    [series] = [s["table"] for s in response.context["sections"] if s["table"].name == "series"]
    page = {m: sum(row[m] for row in series.rows) for m in COUNTED}
    exported = admin.get(REPORT, {**params, "format": "csv", "table": "series"})
    header, *rows = csv.reader(io.StringIO(exported.content.decode()))
    columns = {name: header.index(label) for name, label in (("allowed", "Allowed"), ("throttled", "Throttled (429)"))}
    assert {m: sum(int(row[columns[m]]) for row in rows) for m in COUNTED} == page
    return page


def assert_every_reader_says(
    expected: dict[str, int], caller: APIClient, admin: Client, subject: str, *, live: bool
) -> None:
    now = datetime.now(tz=UTC)
    midnight, end = floor_period(now, "day"), floor_period(now, "minute") + timedelta(minutes=1)
    for granularity in ("minute", "hour", "day"):
        counted, any_live = customer_api(caller, granularity, midnight, end + timedelta(days=1))
        assert counted == expected, f"/v1/usage by {granularity}"
        assert any_live == live, f"/v1/usage by {granularity}: live rows"
        assert admin_report(admin, subject, granularity, midnight, end + timedelta(days=1)) == expected, granularity
    today = caller.get("/v1/rate_limit", {"endpoint": "customers"}).json()["today"]
    assert {m: today[m] for m in COUNTED} == expected, "/v1/rate_limit's today"


@pytest.mark.django_db
def test_every_reader_says_the_same_right_after_traffic_and_after_each_drain(store: str, admin_client: Client) -> None:
    key = ApiKeyFactory(raw="sk_readers_acme")
    subject = f"api_key:ApiKey:{key.pk}"
    caller = client_for("sk_readers_acme", "198.51.100.30")

    statuses = traffic(caller, 5)
    assert statuses == [200] * 3 + [429] * 2
    expected = {"allowed": 3, "throttled": 2}
    assert_every_reader_says(expected, caller, admin_client, subject, live=True)  # nothing drained: all live

    assert drain(now=time.time() + 120) >= 1
    assert_every_reader_says(expected, caller, admin_client, subject, live=False)  # all in minute rows

    assert traffic(caller, 2) == [429, 429]  # after the drain: live again, beside the drained rows
    expected = {"allowed": 3, "throttled": 4}
    assert_every_reader_says(expected, caller, admin_client, subject, live=True)

    # Drained and rolled up as an hour from now would: the hour's own row, its minutes not counted twice.
    assert drain(now=time.time() + 120) >= 1
    rollup(now=datetime.now(tz=UTC) + timedelta(hours=2))
    assert_every_reader_says(expected, caller, admin_client, subject, live=False)
