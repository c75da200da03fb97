"""The DRF throttle and the 429 contract, end to end through the demo API."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from ratelimits.throttles import RateLimitThrottle

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.settings import merged

pytestmark = pytest.mark.django_db

BASE = {
    "TIERS": {"free": {"rate": "3/s"}, "pro": {"rate": "100/s", "burst": 200}, "anon": {"rate": "2/m"}},
    "POLICIES": {
        "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
    "IDENTITY": {"ORGANIZATION_FUNC": "project.payments.auth.organization_of"},
}


@pytest.fixture
def limits(settings: Any, use_redis: Any) -> dict[str, Any]:
    settings.RATELIMITS = {**settings.RATELIMITS, **BASE}
    return settings.RATELIMITS  # type: ignore[no-any-return]


def test_success_carries_ietf_and_github_headers(limits: Any) -> None:
    ApiKeyFactory(raw="sk_pro_1", tier="pro")
    response = client_for("sk_pro_1").get("/v1/customers")
    assert response.status_code == 200
    assert response["RateLimit-Policy"] == '"tier:pro";q=200;w=2'
    assert response["RateLimit"] == '"tier:pro";r=199;t=1'
    assert response["X-RateLimit-Limit"] == "200"
    assert response["X-RateLimit-Remaining"] == "199"
    assert response["X-RateLimit-Used"] == "1"
    assert response["X-RateLimit-Resource"] == "tier:pro"
    assert int(response["X-RateLimit-Reset"]) > 1_700_000_000


def test_429_contract(limits: Any, settings: Any) -> None:
    # 3 a minute: nothing refills while the requests below are made, however slow a loaded machine makes
    # them (at 3 a second, five requests had to fit in 333 ms).
    settings.RATELIMITS = {**limits, "TIERS": {**BASE["TIERS"], "free": {"rate": "3/m"}}}
    ApiKeyFactory(raw="sk_free_1", tier="free")
    client = client_for("sk_free_1")
    statuses = [client.get("/v1/customers").status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    response = client.get("/v1/customers")
    assert response.status_code == 429
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body["status"] == 429
    assert body["type"].endswith("#quota-exceeded")
    assert 0 < body["retry_after_ms"] <= 20_000  # the next of 3 a minute
    assert [v["policy"] for v in body["violations"]] == ["tier:free"] == body["violated-policies"]
    assert body["violations"][0]["subject"] == "api_key"
    assert response["Retry-After"] == str(max(math.ceil(body["retry_after_ms"] / 1000), 1))
    assert response["RateLimit"].startswith('"tier:free";r=0;')
    assert response["X-RateLimit-Remaining"] == "0"


def test_retry_after_is_rounded_up_never_down(limits: Any, settings: Any) -> None:
    settings.RATELIMITS = {**limits, "TIERS": {**BASE["TIERS"], "free": {"rate": "2/3s"}}}
    ApiKeyFactory(raw="sk_free_2", tier="free")
    client = client_for("sk_free_2")
    sent = time.monotonic()
    client.get("/v1/customers"), client.get("/v1/customers")
    response = client.get("/v1/customers")
    between_ms = (time.monotonic() - sent) * 1000  # at least the time between the first and last decisions
    body = json.loads(response.content)
    # The next token comes 1.5 s after the first was spent: what is left of that (whole milliseconds,
    # rounded up). Usually over a second (the three requests take milliseconds), and then "2", not "1".
    assert 1500 - between_ms - 1 <= body["retry_after_ms"] <= 1500, (body, between_ms)
    assert response["Retry-After"] == str(max(math.ceil(body["retry_after_ms"] / 1000), 1))
    if between_ms < 500:
        assert response["Retry-After"] == "2"


def test_jitter_only_adds(limits: Any, settings: Any) -> None:
    # 3 a minute: the 30 requests below are all refused however slowly they are made (at 3 a second,
    # a token came back every 333 ms, and a loaded machine let one through: a 200 has no wait to read).
    settings.RATELIMITS = merged(
        limits, {"HEADERS": {"RETRY_AFTER_JITTER": "5s"}, "TIERS": {**BASE["TIERS"], "free": {"rate": "3/m"}}}
    )
    ApiKeyFactory(raw="sk_free_3", tier="free")
    client = client_for("sk_free_3")
    for _ in range(3):
        client.get("/v1/customers")
    seen = set()
    for _ in range(30):
        response = client.get("/v1/customers")
        exact = json.loads(response.content)["retry_after_ms"]
        value = int(response["Retry-After"])
        assert value >= max(math.ceil(exact / 1000), 1)
        assert value <= math.ceil((exact + 5000) / 1000)
        seen.add(value)
    assert len(seen) > 1


@pytest.mark.parametrize(
    ("style", "present", "absent"),
    [
        ("ietf", ["RateLimit", "RateLimit-Policy"], ["X-RateLimit-Limit"]),
        ("github", ["X-RateLimit-Limit", "X-RateLimit-Reset"], ["RateLimit"]),
        ("none", [], ["RateLimit", "X-RateLimit-Limit"]),
    ],
)
def test_header_style_setting(limits: Any, settings: Any, style: str, present: list[str], absent: list[str]) -> None:
    settings.RATELIMITS = merged(limits, {"HEADERS": {"STYLE": style}})
    ApiKeyFactory(raw="sk_pro_2", tier="pro")
    response = client_for("sk_pro_2").get("/v1/customers")
    for name in present:
        assert response.has_header(name)
    for name in absent:
        assert not response.has_header(name)


def ping_and_requests(rf: Any, address: str) -> tuple[Any, Callable[[], Any]]:
    """The test project's ``Ping`` view, and a maker of anonymous DRF requests to it from ``address``."""
    from rest_framework.request import Request

    from tests.views import Ping

    view = Ping()
    view.headers = {}

    def request() -> Request:
        made = Request(rf.get("/t/ping", REMOTE_ADDR=address))
        made.auth, made.user = None, None
        return made

    return view, request


def test_wait_is_exact_and_never_none_when_denied(limits: Any, rf: Any) -> None:
    view, request = ping_and_requests(rf, "198.51.100.1")

    throttle = RateLimitThrottle()
    assert throttle.allow_request(request(), view) and throttle.wait() is None
    assert RateLimitThrottle().allow_request(request(), view)
    denied = RateLimitThrottle()
    assert not denied.allow_request(request(), view)
    wait = denied.wait()
    assert wait is not None and 0 < wait <= 60
    assert wait == denied.decision.retry_after_us / 1_000_000  # type: ignore[union-attr]


def test_drfs_own_handler_writes_the_same_retry_after_jitter_and_all(limits: Any, settings: Any, rf: Any) -> None:
    """A project on DRF's default exception handler gets ``Retry-After`` from the throttle's
    ``wait()``, rounded up: with jitter asked for, it is in there too, never under the exact wait."""
    settings.RATELIMITS = merged(limits, {"HEADERS": {"RETRY_AFTER_JITTER": "3s"}})
    view, request = ping_and_requests(rf, "198.51.100.2")

    assert RateLimitThrottle().allow_request(request(), view)
    assert RateLimitThrottle().allow_request(request(), view)
    denied = RateLimitThrottle()
    assert not denied.allow_request(request(), view)
    exact = denied.decision.retry_after_us / 1_000_000  # type: ignore[union-attr]
    waits = [denied.wait() for _ in range(300)]
    assert all(w is not None and exact <= w <= exact + 3 for w in waits)
    assert len({math.ceil(w) for w in waits if w is not None}) > 1  # the header DRF writes varies


def test_anonymous_callers_are_limited_per_ip(limits: Any) -> None:
    one, two = APIClient(REMOTE_ADDR="198.51.100.7"), APIClient(REMOTE_ADDR="198.51.100.8")
    assert [one.get("/t/ping").status_code for _ in range(3)] == [200, 200, 429]
    assert two.get("/t/ping").status_code == 200


def test_rate_limit_endpoint_consumes_nothing(limits: Any) -> None:
    ApiKeyFactory(raw="sk_free_4", tier="free", organization="acme")
    client = client_for("sk_free_4")
    for _ in range(5):
        body = client.get("/v1/rate_limit?endpoint=customers").json()
    resources = {r["policy"]: r for r in body["resources"]}
    assert resources["tier:free"]["remaining"] == 3
    assert resources["tier:free"]["limit"] == 3
    assert client.get("/v1/customers").status_code == 200
    body = client.get("/v1/rate_limit?endpoint=customers").json()
    assert {r["policy"]: r for r in body["resources"]}["tier:free"]["remaining"] == 2


def test_endpoint_cost_and_limits(limits: Any, settings: Any) -> None:
    settings.RATELIMITS = {
        **limits,
        "TIERS": {**BASE["TIERS"], "free": {"rate": "20/s"}, "anon": {"rate": "2/m", "burst": 10}},
        "ENDPOINTS": {"POST reports.export": {"cost": 10, "priority": "low"}},
    }
    ApiKeyFactory(raw="sk_free_5", tier="free")
    from project.payments.views import ReportExport

    ReportExport.duration = 0
    client = client_for("sk_free_5")
    assert [client.post("/v1/reports/export").status_code for _ in range(3)] == [200, 200, 429]


def test_plain_django_view_with_decorator(limits: Any, settings: Any) -> None:
    client = APIClient(REMOTE_ADDR="192.0.2.44")
    first = client.get("/t/plain")
    assert first.status_code == 200 and first.content == b"plain ok"
    assert first["X-RateLimit-Remaining"] == "1"
    client.get("/t/plain")
    denied = client.get("/t/plain")
    assert denied.status_code == 429
    assert denied["Content-Type"] == "application/problem+json"
    assert int(denied["Retry-After"]) >= 1


@pytest.mark.parametrize(
    "forwarded",
    [
        "",
        "garbage",
        "1.2.3.4, ,",
        "\x00\xff",
        "[::1",
        "999.1.1.1",
        "a" * 5000,
        "::ffff:1.2.3.4, ::1",
        "1.2.3.4:80, [2001:db8::1]:443",
    ],
)
def test_bad_forwarded_headers_never_500(limits: Any, settings: Any, forwarded: str) -> None:
    settings.RATELIMITS = merged(limits, {"IDENTITY": {"TRUSTED_PROXIES": ["10.0.0.0/8"]}})
    response = APIClient().get("/t/ping", REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR=forwarded)
    assert response.status_code in (200, 429)


def test_retry_after_ms_is_exact_on_the_real_clock(limits: Any, settings: Any) -> None:
    """Through the whole stack on Redis TIME: early retries fail, a retry at the named time passes.

    The waits below are the behaviour under test (time passing), not synchronisation.
    """
    settings.RATELIMITS = {**limits, "TIERS": {**BASE["TIERS"], "free": {"rate": "2/s", "burst": 1}}}
    early_checked = 0
    for i in range(5):  # a caller of its own each time: a full bucket, spent by its first request
        ApiKeyFactory(raw=f"sk_free_clock_{i}", tier="free")
        client = client_for(f"sk_free_clock_{i}")
        sent = time.monotonic()
        assert client.get("/v1/customers").status_code == 200
        asked = time.monotonic()  # the denial is decided after this
        denied = client.get("/v1/customers")
        between_ms = (time.monotonic() - sent) * 1000  # at least the time between the two decisions
        if denied.status_code == 200:  # the next token came between them (a stalled thread): try again
            assert between_ms >= 500, between_ms
            continue
        assert denied.status_code == 429
        wait_ms = json.loads(denied.content)["retry_after_ms"]
        # The next token comes 500 ms after the first was spent: what is left of that after the denial
        # (whole milliseconds, rounded up).
        assert 500 - between_ms - 1 <= wait_ms <= 500, (wait_ms, between_ms)
        started = time.monotonic()  # after the server's decision, so waiting wait_ms from here is never early
        time.sleep(wait_ms / 2000)
        early = client.get("/v1/customers").status_code
        # Answered before the named time (the denial's decision, no earlier than ``asked``, plus the
        # wait it named, rounded up to the millisecond), it was decided before it: still denied, nothing
        # spent. A thread that overslept half the wait (a loaded machine) asked too late to tell.
        if time.monotonic() < asked + (wait_ms - 1) / 1000:
            assert early == 429
            early_checked += 1
        elif early == 200:
            continue  # overslept past the refill: that request took the token the next one would have
        time.sleep(max(wait_ms / 1000 - (time.monotonic() - started), 0))
        assert client.get("/v1/customers").status_code == 200
    assert early_checked >= 1  # asked early in time at least once (missing it is a rare stall, five times over)


def test_the_throttle_imports_in_a_project_without_the_auth_models() -> None:
    """DRF imports ``DEFAULT_THROTTLE_CLASSES`` while settings load: the throttle must need no models.

    (The benchmark's project has no ``django.contrib.auth``; a throttle module importing the status
    code, which reads the user model, broke it.)
    """
    code = (
        "import django; from django.conf import settings; "
        "settings.configure(INSTALLED_APPS=['rest_framework', 'ratelimits'], "
        "REST_FRAMEWORK={'DEFAULT_THROTTLE_CLASSES': ['ratelimits.throttles.RateLimitThrottle']}); "
        "django.setup(); import rest_framework.views, ratelimits.throttles"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


def test_without_the_app_installed_the_throttle_refuses_to_start_and_says_why() -> None:
    """No app, no system checks: a bad rate would be a 500 on every request. The URLconf's import fails instead."""
    code = (
        "import django; from django.conf import settings; "
        "settings.configure(INSTALLED_APPS=['rest_framework'], "
        "REST_FRAMEWORK={'DEFAULT_THROTTLE_CLASSES': ['ratelimits.throttles.RateLimitThrottle']}); "
        "django.setup(); import rest_framework.views"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "ImproperlyConfigured: ratelimits is not in INSTALLED_APPS: add 'ratelimits' there" in result.stderr
