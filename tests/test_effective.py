"""The admin's effective policy page, ``ratelimits_effective`` and ``GET /v1/rate_limit`` agree.

With the demo's own configuration (the database source, ``POLICIES['TIER_FUNC']`` and
``IDENTITY['ORGANIZATION_FUNC']`` reading the API key, static backstops per IP and organisation)
and its seeded keys, each of the three lists the same checks, for the same caller on the same
endpoint, with the same figures. The admin page and the command know the caller only by its
identities: they must still place it as its requests are placed (the free key's own tier, its
organisation).
"""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from project.payments.management.commands.seed_demo import DEMO_KEYS
from project.payments.models import ApiKey, hash_key
from project.settings import RATELIMITS as DEMO_RATELIMITS
from ratelimits.models import EndpointPolicy, Override

from .support.settings import merged

pytestmark = pytest.mark.django_db

IP = "127.0.0.1"  # the test client's REMOTE_ADDR
ENDPOINTS = [("customers", "GET"), ("charges", "POST"), ("reports.export", "POST")]
Row = tuple[str, str, int, int, int | None]


@pytest.fixture
def demo(settings: Any, use_redis: Any) -> dict[str, tuple[str, ApiKey]]:
    """The demo's settings and seeded data, decided on the private Redis; its keys by tier."""
    settings.RATELIMITS = merged(DEMO_RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": use_redis.url}})
    call_command("seed_demo", stdout=StringIO())
    return {tier: (raw, ApiKey.objects.get(key_hash=hash_key(raw))) for _, tier, _, raw in DEMO_KEYS}


def from_status(raw: str, endpoint: str, method: str) -> list[Row]:
    client = APIClient()
    response = client.get(
        "/v1/rate_limit", {"endpoint": endpoint, "method": method}, HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["endpoint"], body["method"], body["degraded"]) == (endpoint, method, False)
    return [(r["policy"], r["subject"], r["cost"], r["limit"], r["remaining"]) for r in body["resources"]]


def from_admin(admin: Client, key: ApiKey, endpoint: str, method: str) -> list[Row]:
    query = {"api_key": f"ApiKey:{key.pk}", "ip": IP, "endpoint": endpoint, "method": method}
    response = admin.get(reverse("admin:ratelimits_effective_policy"), query)
    assert response.status_code == 200
    assert response.context["notes"] == []  # the key's object was found
    return [(r["policy"], r["subject"], r["cost"], r["limit"], r["remaining"]) for r in response.context["rows"]]


def from_command(key: ApiKey, endpoint: str, method: str) -> list[Row]:
    out = StringIO()
    subjects = ["--subject", f"api_key:ApiKey:{key.pk}", "--subject", f"ip:{IP}"]
    call_command("ratelimits_effective", *subjects, "--endpoint", endpoint, "--method", method, "--json", stdout=out)
    report = json.loads(out.getvalue())
    return [(c["policy"], c["subject"], c["cost"], c["limit"], c["remaining"]) for c in report["checks"]]


@pytest.mark.parametrize(("endpoint", "method"), ENDPOINTS)
def test_the_three_list_the_same_checks_for_the_demo_keys(
    demo: dict[str, tuple[str, ApiKey]], admin_client: Client, endpoint: str, method: str
) -> None:
    for raw, key in demo.values():
        status = from_status(raw, endpoint, method)
        assert status, (raw, endpoint)
        assert from_admin(admin_client, key, endpoint, method) == status
        assert from_command(key, endpoint, method) == status


def test_acme_on_customers_is_placed_as_its_requests_are(
    settings: Any, demo: dict[str, tuple[str, ApiKey]], admin_client: Client
) -> None:
    """The case the admin page got wrong: the override, Acme's free tier's quota and slots, its organisation."""
    raw, key = demo["free"]
    override = key_override(key)
    expected = [
        (f"override:{override}", "api_key", 1, 5),
        ("tier:free:quota", "api_key", 1, 100_000),
        ("tier:free:concurrency", "api_key", 1, 2),
        ("ip", "ip", 1, 300),
        ("org", "org", 1, 500),
        ("fleet", "fleet", 1, 4),
        ("fleet-share", "org", 1, 3),  # its organisation's half of the fleet's capacity of 6
    ]
    status = from_status(raw, "customers", "GET")
    assert [row[:4] for row in status] == expected
    assert [row[:4] for row in from_admin(admin_client, key, "customers", "GET")] == expected
    # Spend two requests through the API: all three see them. Every limit made slow first, so that
    # nothing refills between the three reads (the seeded ones refill several times a second).
    settings.RATELIMITS = {
        **settings.RATELIMITS,
        "DIMENSIONS": {"ip": {"rate": "300/h", "burst": 300}, "org": {"rate": "500/h", "burst": 500}},
    }
    Override.objects.filter(pk=override).update(rate="5/h")
    client = APIClient()
    for _ in range(2):
        assert client.get("/v1/customers", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 200
    status = from_status(raw, "customers", "GET")
    assert [row[4] for row in status] == [3, 100_000 - 2, 2, 298, 498, 4, 3]
    assert from_admin(admin_client, key, "customers", "GET") == status
    assert from_command(key, "customers", "GET") == status


def key_override(key: ApiKey) -> int:
    return Override.objects.get(subject_id=f"ApiKey:{key.pk}", endpoint="customers").pk


def test_a_key_the_admin_cannot_find_is_said_so(demo: dict[str, tuple[str, ApiKey]], admin_client: Client) -> None:
    response = admin_client.get(
        reverse("admin:ratelimits_effective_policy"),
        {"api_key": "ApiKey:999999", "endpoint": "customers", "method": "GET"},
    )
    assert response.status_code == 200
    assert response.context["notes"] == [
        "No payments.ApiKey has the identity 'ApiKey:999999': RATELIMITS['POLICIES']['TIER_FUNC'] and "
        "RATELIMITS['IDENTITY']['ORGANIZATION_FUNC'] saw no credential. "
        "A request made with the key may be placed differently."
    ]
    assert "saw no credential" in response.content.decode()


def test_while_degraded_a_local_policy_is_reported_out_of_this_workers_share(
    settings: Any, own_redis: Any, client: Client
) -> None:
    """Fail mode local decides in process against the policy scaled down: the figures say so consistently."""
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "REDIS": {"URL": own_redis.url, "SOCKET_TIMEOUT": "100ms", "CONNECT_TIMEOUT": "100ms"},
        "FAILURE": {"LOCAL_SHARE": 0.25},
        "TIERS": {"anon": {"rate": "100/h", "burst": 100, "fail_mode": "local"}, "auth": "10/s"},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "auth"}},
        "DIMENSIONS": {"ip": {"rate": "50/h", "fail_mode": "open"}},
    }
    own_redis.kill()
    body = client.get("/v1/rate_limit", {"endpoint": "customers"}).json()
    assert body["degraded"] is True
    rows = {r["policy"]: (r["limit"], r["remaining"], r["used"]) for r in body["resources"]}
    assert rows == {"tier:anon": (25, 25, 0), "ip": (50, None, None)}


def reads_the_user(request: Any, identity: Any) -> str | None:
    """A ``POLICIES['TIER_FUNC']`` as hosts write them: it asks the request's user first."""
    return "auth" if request.user.is_authenticated else None


def test_a_stand_in_request_carries_a_user_a_tier_func_can_ask(settings: Any, admin_client: Client) -> None:
    settings.RATELIMITS = {
        "TIERS": {"anon": "10/s", "auth": "20/s"},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}, "TIER_FUNC": reads_the_user},
    }
    query = {"api_key": "ApiKey:5", "endpoint": "customers", "method": "GET"}
    response = admin_client.get(reverse("admin:ratelimits_effective_policy"), query)
    assert response.status_code == 200
    assert [row["policy"] for row in response.context["rows"]] == ["tier:anon"]


def test_every_method_a_rule_can_name_is_explained_by_the_three(
    demo: dict[str, tuple[str, ApiKey]], admin_client: Client
) -> None:
    """A rule the admin can save for a method, each of the three can explain; a method no rule names, none takes."""
    raw, key = demo["free"]
    methods = [value for value, _ in EndpointPolicy._meta.get_field("method").choices if value != "ANY"]
    for method in methods:
        EndpointPolicy.objects.update_or_create(endpoint="customers", method=method, defaults={"cost": 2})
    for method in methods:
        status = from_status(raw, "customers", method)
        assert ("ip", "ip", 2) in [row[:3] for row in status], method  # the method's own rule
        assert from_admin(admin_client, key, "customers", method) == status
        assert from_command(key, "customers", method) == status

    response = APIClient().get(
        "/v1/rate_limit", {"endpoint": "customers", "method": "FOO"}, HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert response.status_code == 400
    assert response.json() == {"method": [f"'FOO' must be one of {', '.join(methods)}."]}
    query = {"api_key": f"ApiKey:{key.pk}", "endpoint": "customers", "method": "FOO"}
    page = admin_client.get(reverse("admin:ratelimits_effective_policy"), query)
    assert list(page.context["form"].errors) == ["method"]
    with pytest.raises(CommandError, match=f"--method: 'FOO' is not one of {', '.join(methods)}."):
        from_command(key, "customers", "FOO")
