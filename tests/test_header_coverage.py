"""Which responses carry the rate-limit headers (docs/contract.md): those of a request that was decided.

A request is decided once its view is known (the endpoint is named by the view); so a view's own
error responses carry the headers, and a path no route matches gets a 404 without them.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.fixture
def with_middleware(settings: Any, use_redis: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "ratelimits.middleware.RateLimitMiddleware"]
    settings.RATELIMITS = {**settings.RATELIMITS, "TIERS": {"anonymous": {"rate": "5/m"}, "authenticated": "10/m"}}


def test_a_drf_views_own_400_carries_them(with_middleware: None) -> None:
    response = Client(REMOTE_ADDR="192.0.2.30").get("/v1/usage", {"granularity": "week"})
    assert response.status_code == 400
    assert response["RateLimit"].startswith('"tier:anonymous";r=4;')


def test_an_unrouted_path_is_not_decided(with_middleware: None) -> None:
    client = Client(REMOTE_ADDR="192.0.2.31")
    missing = client.get("/no/such/path")
    assert missing.status_code == 404
    assert not missing.has_header("RateLimit") and not missing.has_header("X-RateLimit-Limit")
    # Nothing was spent for it: the next routed request is the caller's first.
    assert client.get("/t/unmarked")["RateLimit"].startswith('"tier:anonymous";r=4;')
