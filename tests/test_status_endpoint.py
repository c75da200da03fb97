"""``GET /v1/rate_limit`` is limited like any endpoint, by a policy of its own, and refuses bad names.

Each call costs a store round trip and a database sum: it carries the rate-limit headers, gets the
usual 429 past its own limit, and answers 400 naming ``endpoint`` for a name that is no endpoint
of this project. It still spends nothing of the limits it reports.
"""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from project.payments.management.commands.seed_demo import DEMO_KEYS
from project.settings import RATELIMITS as DEMO_RATELIMITS
from ratelimits.endpoints import known_endpoints
from ratelimits.models import EndpointPolicy

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.settings import merged

pytestmark = pytest.mark.django_db

BASE = {
    "TIERS": {"free": {"rate": "3/s"}, "anon": {"rate": "2/m"}},
    "POLICIES": {
        "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
}


@pytest.fixture
def limits(settings: Any, use_redis: Any) -> dict[str, Any]:
    settings.RATELIMITS = {**settings.RATELIMITS, **BASE}
    return settings.RATELIMITS  # type: ignore[no-any-return]


def status(client: APIClient, **query: str) -> Any:
    return client.get("/v1/rate_limit", query)


def test_200_carries_the_rate_limit_headers_of_its_own_policy(limits: Any) -> None:
    ApiKeyFactory(raw="sk_status_1", tier="free")
    response = status(client_for("sk_status_1"), endpoint="customers")
    assert response.status_code == 200
    # The built-in limit of the status endpoint, when no endpoint policy gives it one.
    assert response["RateLimit-Policy"] == '"endpoint:rate_limit";q=20;w=20'
    assert response["RateLimit"] == '"endpoint:rate_limit";r=19;t=1'
    assert response["X-RateLimit-Resource"] == "endpoint:rate_limit"
    assert response["X-RateLimit-Remaining"] == "19"


def test_429_with_the_usual_contract_after_its_burst(limits: Any, settings: Any) -> None:
    settings.RATELIMITS = {**limits, "ENDPOINTS": {"rate_limit": {"rate": "3/m"}}}
    ApiKeyFactory(raw="sk_status_2", tier="free")
    client = client_for("sk_status_2")
    assert [status(client, endpoint="customers").status_code for _ in range(3)] == [200] * 3
    denied = status(client, endpoint="customers")
    assert denied.status_code == 429
    assert denied["Content-Type"] == "application/problem+json"
    assert int(denied["Retry-After"]) >= 1
    assert denied["RateLimit"].startswith('"endpoint:rate_limit";r=0;')
    body = json.loads(denied.content)
    assert body["violated-policies"] == ["endpoint:rate_limit"]
    assert body["violations"][0]["subject"] == "api_key"
    assert body["retry_after_ms"] > 0
    # Its own limit, not the caller's: the tier it reports is untouched, and other endpoints answer.
    assert client.get("/v1/customers").status_code == 200


def test_its_calls_spend_nothing_of_what_it_reports(limits: Any) -> None:
    ApiKeyFactory(raw="sk_status_3", tier="free")
    client = client_for("sk_status_3")
    for _ in range(5):
        body = status(client, endpoint="customers").json()
    assert {r["policy"]: r["remaining"] for r in body["resources"]}["tier:free"] == 3
    assert "endpoint:rate_limit" not in {r["policy"] for r in body["resources"]}  # asked about customers


def test_an_exempt_status_endpoint_is_not_limited(limits: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(limits, {"POLICIES": {"EXEMPT_ENDPOINTS": ["rate_limit"]}})
    ApiKeyFactory(raw="sk_status_4", tier="free")
    response = status(client_for("sk_status_4"), endpoint="customers")
    assert response.status_code == 200
    assert "RateLimit" not in response


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("x" * 3000, "at most 150 characters"),
        ("charges\x00", "is not an endpoint name"),
        ("\x00", "is not an endpoint name"),
        ("charges\N{GRINNING FACE}", "is not an endpoint name"),
        ("\N{PILE OF POO}", "is not an endpoint name"),
        ("charges\t", "is not an endpoint name"),
        ("/v1/charges", "is not an endpoint name"),
        ("", "is not an endpoint name"),
        ("no.such.endpoint", "is not an endpoint of this API"),
    ],
)
def test_a_bad_endpoint_name_is_a_400_naming_the_parameter(limits: Any, name: str, says: str) -> None:
    ApiKeyFactory(raw="sk_status_5", tier="free")
    response = status(client_for("sk_status_5"), endpoint=name)
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == ["endpoint"]
    assert says in body["endpoint"][0]
    assert len(body["endpoint"][0]) < 400  # a 3,000-character name is not echoed back
    assert "RateLimit" in response  # the call was decided before it was refused


def test_a_bad_method_is_a_400_naming_the_parameter(limits: Any) -> None:
    response = status(APIClient(), endpoint="customers", method="BREW")
    assert response.status_code == 400
    assert list(response.json()) == ["method"]


def test_every_route_and_policy_name_is_an_endpoint(limits: Any) -> None:
    """What the project knows: throttle scopes, ratelimit scopes, route names, and policies' endpoints."""
    EndpointPolicy.objects.create(endpoint="legacy.export", method="POST")  # a policy with no route (yet)
    known = known_endpoints()
    assert {"charges", "customers", "reports.export", "usage", "rate_limit"} <= known  # throttle scopes
    assert {"reports-export", "rate-limit", "ping", "plain", "unmarked", "admin:index"} <= known  # route names
    assert "no.such.endpoint" not in known
    client = APIClient()
    assert status(client, endpoint="reports-export").status_code == 200
    assert status(client, endpoint="plain").status_code == 200


def test_database_policies_name_endpoints_too(settings: Any, use_redis: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    EndpointPolicy.objects.create(endpoint="legacy.export", method="POST")
    assert status(APIClient(), endpoint="legacy.export", method="POST").status_code == 200
    assert status(APIClient(), endpoint="legacy.import").status_code == 400


def test_the_demo_seeds_a_cheap_policy_for_it(settings: Any, use_redis: Any) -> None:
    settings.RATELIMITS = merged(DEMO_RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": use_redis.url}})
    call_command("seed_demo", stdout=StringIO())
    policy = EndpointPolicy.objects.get(endpoint="rate_limit")
    assert (policy.per_caller_rate, policy.per_caller_burst, policy.cost) == ("60/m", 20, 1)
    raw = DEMO_KEYS[0][3]
    response = status(client_for(raw), endpoint="charges", method="POST")
    assert response.status_code == 200
    assert response["RateLimit-Policy"] == '"endpoint:rate_limit";q=20;w=20'
