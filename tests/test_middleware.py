"""Plain Django views: the middleware limits them, skips DRF views (the throttle owns those)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.fixture
def with_middleware(settings: Any, use_redis: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "ratelimits.middleware.RateLimitMiddleware"]
    settings.RATELIMITS = {
        **settings.RATELIMITS,
        "TIERS": {"anonymous": {"rate": "2/m"}, "authenticated": {"rate": "10/m"}},
    }


def test_middleware_limits_plain_views(with_middleware: None) -> None:
    client = Client(REMOTE_ADDR="192.0.2.10")
    first = client.get("/t/unmarked")
    assert first.status_code == 200 and first["RateLimit"].startswith('"tier:anonymous";r=1;')
    assert client.get("/t/unmarked").status_code == 200
    denied = client.get("/t/unmarked")
    assert denied.status_code == 429
    assert denied["Content-Type"] == "application/problem+json"


def test_exempt_views_are_not_limited(with_middleware: None) -> None:
    client = Client(REMOTE_ADDR="192.0.2.11")
    responses = [client.get("/t/exempt") for _ in range(5)]
    assert [r.status_code for r in responses] == [200] * 5
    assert not responses[0].has_header("RateLimit")


def test_drf_views_are_charged_once(with_middleware: None) -> None:
    client = Client(REMOTE_ADDR="192.0.2.12")
    first = client.get("/t/ping")
    assert first["RateLimit"].startswith('"tier:anonymous";r=1;')  # not r=0: one charge, not two


def test_decorated_view_under_middleware_is_charged_once(with_middleware: None) -> None:
    client = Client(REMOTE_ADDR="192.0.2.13")
    assert client.get("/t/plain")["RateLimit"].startswith('"tier:anonymous";r=1;')
