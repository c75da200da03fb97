"""The customer usage API: a caller reads its own usage, never another caller's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rest_framework.test import APIClient

from ratelimits.models import UsageRecord

from .factories import ApiKeyFactory
from .support.clients import client_for

pytestmark = pytest.mark.django_db


def row(subject: str, start: datetime, granularity: str = "hour", **counts: int) -> UsageRecord:
    return UsageRecord.objects.create(
        granularity=granularity,
        period_start=start,
        subject_kind="api_key",
        subject_id=subject,
        endpoint="charges",
        **counts,
    )


@pytest.fixture
def two_callers() -> tuple[Any, Any]:
    alice, bob = ApiKeyFactory(raw="sk_alice_usage"), ApiKeyFactory(raw="sk_bob_usage")
    hour = datetime.now(tz=UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    row(f"ApiKey:{alice.pk}", hour, allowed=10, throttled=2, tokens=10)
    row(f"ApiKey:{bob.pk}", hour, allowed=99, throttled=9, tokens=99)
    return alice, bob


def test_callers_read_only_their_own_usage(two_callers: tuple[Any, Any]) -> None:
    _alice, _bob = two_callers
    mine = client_for("sk_alice_usage").get("/v1/usage").json()
    assert mine["count"] == 1
    assert (mine["results"][0]["allowed"], mine["results"][0]["throttled"]) == (10, 2)
    theirs = client_for("sk_bob_usage").get("/v1/usage").json()
    assert [r["allowed"] for r in theirs["results"]] == [99]


@pytest.mark.parametrize(
    "query",
    [
        "?subject_id=ApiKey:{bob}",
        "?subject_kind=api_key&subject_id=ApiKey:{bob}",
        "?api_key=ApiKey:{bob}",
        "?endpoint=charges&caller=ApiKey:{bob}",
    ],
)
def test_no_parameter_reaches_another_callers_usage(two_callers: tuple[Any, Any], query: str) -> None:
    _alice, bob = two_callers
    results = client_for("sk_alice_usage").get("/v1/usage" + query.format(bob=bob.pk)).json()["results"]
    assert [r["allowed"] for r in results] == [10]


def test_anonymous_callers_see_their_ip_only(two_callers: tuple[Any, Any]) -> None:
    hour = datetime.now(tz=UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    UsageRecord.objects.create(
        granularity="hour", period_start=hour, subject_kind="ip", subject_id="198.51.100.4", endpoint="ping", allowed=3
    )
    results = APIClient(REMOTE_ADDR="198.51.100.4").get("/v1/usage").json()["results"]
    assert [(r["endpoint"], r["allowed"]) for r in results] == [("ping", 3)]
    assert APIClient(REMOTE_ADDR="198.51.100.5").get("/v1/usage").json()["results"] == []


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?granularity=week", "granularity"),
        ("?from=yesterday", "from"),
        ("?from=2026-11-30T00:00:00", "from"),  # no offset
        ("?from=2026-11-30T00:00:00Z&to=2026-11-29T00:00:00Z", "to"),
        ("?granularity=minute&from=2026-01-01T00:00:00Z&to=2026-11-30T00:00:00Z", "from"),
    ],
)
def test_bad_queries_are_400_naming_the_field(two_callers: tuple[Any, Any], query: str, field: str) -> None:
    response = client_for("sk_alice_usage").get("/v1/usage" + query)
    assert response.status_code == 400
    assert field in response.json()


def test_pagination(two_callers: tuple[Any, Any]) -> None:
    alice, _ = two_callers
    start = datetime.now(tz=UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=20)
    for n in range(5):
        row(f"ApiKey:{alice.pk}", start + timedelta(hours=n), allowed=n)
    page = client_for("sk_alice_usage").get("/v1/usage?limit=2").json()
    assert page["count"] == 6 and len(page["results"]) == 2 and page["next"]
    assert [r["allowed"] for r in page["results"]] == [0, 1]  # oldest first


def test_rate_limit_status_includes_todays_usage(settings: Any) -> None:
    key = ApiKeyFactory(raw="sk_today")
    minute = datetime.now(tz=UTC).replace(second=0, microsecond=0)
    row(f"ApiKey:{key.pk}", minute, granularity="minute", allowed=4, throttled=1, tokens=4)
    body = client_for("sk_today").get("/v1/rate_limit?endpoint=charges").json()
    assert body["today"] == {"allowed": 4, "throttled": 1, "shed": 0, "degraded": 0, "tokens": 4}
