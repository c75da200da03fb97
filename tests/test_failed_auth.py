"""Failed authentication is limited per client IP and per credential prefix, before the database is asked.

The finding: DRF authenticates before throttles run, so 1,000 guessed bearer tokens from one
client got 1,000 401s at 173/s, each costing a database lookup, and no 429. Here the same flood
runs through the real middleware, DRF stack and a private Redis.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from django.core.checks import run_checks
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.checks import SETTING_IDS, W005
from ratelimits.identity import Subject, SubjectKind

from .factories import ApiKeyFactory
from .support.redis_server import RedisServer, free_port
from .support.settings import merged

pytestmark = pytest.mark.django_db

MIDDLEWARE = "ratelimits.middleware.FailedAuthenticationMiddleware"
#: A refill far slower than the test: exactly the burst of failures gets through.
BURST = 20
LIMIT = {"rate": "1/h", "burst": BURST}


def configure(settings: Any, url: str, **extra: Any) -> None:
    settings.MIDDLEWARE = [MIDDLEWARE, *settings.MIDDLEWARE]
    settings.RATELIMITS = merged(
        {
            "REDIS": {"URL": url},
            "TIERS": {"anon": {"rate": "10000/s"}, "paid": {"rate": "10000/s"}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "paid"}},
            "IDENTITY": {"FAILED_AUTH": LIMIT},
        },
        extra,
    )
    engine.reset()


def guess(address: str, token: str | None = None) -> Any:
    client = APIClient(REMOTE_ADDR=address)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token or 'sk_guess_' + secrets.token_hex(12)}")
    return client.get("/v1/customers")


def key_lookups(queries: CaptureQueriesContext) -> int:
    return sum('"payments_apikey"' in query["sql"] for query in queries.captured_queries)


def test_a_thousand_guesses_get_the_burst_of_401s_and_then_429s_without_asking_the_database(
    settings: Any, use_redis: RedisServer
) -> None:
    configure(settings, use_redis.url)
    ApiKeyFactory(raw="sk_valid_elsewhere_0001", tier="paid")
    statuses: list[int] = []
    valid: list[int] = []
    with CaptureQueriesContext(connection) as queries:
        for n in range(1000):
            reply = guess("203.0.113.50")
            statuses.append(reply.status_code)
            if n == 0:
                # A 401 the limit counted carries its headers.
                assert reply["RateLimit-Policy"] == f'"failed-auth";q={BURST};w=72000'
                assert reply["RateLimit"].startswith(f'"failed-auth";r={BURST - 1};')
            if n % 100 == 99:
                valid.append(guess(f"198.51.100.{n // 100}", "sk_valid_elsewhere_0001").status_code)
    assert statuses.count(401) == BURST
    assert statuses == [401] * BURST + [429] * (1000 - BURST)
    assert valid == [200] * 10
    # One lookup per guess up to the burst, and one more: the guess that finds the bucket empty is
    # looked up, then answered 429. After that, every guess is refused before authentication.
    assert key_lookups(queries) == BURST + 1 + len(valid)

    refused = guess("203.0.113.50")
    body = refused.json()
    assert refused.status_code == 429 and refused["Content-Type"] == "application/problem+json"
    assert body["violated-policies"] == ["failed-auth"] and body["violations"][0]["subject"] == "ip"
    assert 0 < int(refused["Retry-After"]) <= 3600
    assert refused["RateLimit-Policy"] == f'"failed-auth";q={BURST};w=72000'


def test_one_credential_prefix_guessed_from_many_addresses_is_limited_too(
    settings: Any, use_redis: RedisServer
) -> None:
    configure(settings, use_redis.url, IDENTITY={"FAILED_AUTH": {**LIMIT, "prefix_length": 12}})
    ApiKeyFactory(raw="sk_live_acme_the_real_one", tier="paid")
    statuses = [guess(f"192.0.2.{n}", f"sk_live_acme{secrets.token_hex(8)}").status_code for n in range(60)]
    assert statuses == [401] * BURST + [429] * (60 - BURST)
    assert guess("192.0.2.200").status_code == 401  # another prefix, a fresh address: not refused
    # Anyone can spend a prefix's failures: the valid key that has it still gets in, from anywhere.
    assert [guess(f"192.0.2.{n}", "sk_live_acme_the_real_one").status_code for n in (1, 201)] == [200, 200]


def test_requests_without_credentials_and_successful_ones_are_never_counted(
    settings: Any, use_redis: RedisServer
) -> None:
    configure(settings, use_redis.url)
    ApiKeyFactory(raw="sk_valid_same_ip_0001", tier="paid")
    anonymous = [APIClient(REMOTE_ADDR="203.0.113.9").get("/v1/customers").status_code for _ in range(BURST + 5)]
    valid = [guess("203.0.113.9", "sk_valid_same_ip_0001").status_code for _ in range(BURST + 5)]
    assert anonymous == [401] * (BURST + 5)  # the view wants a key, but no credential failed
    assert valid == [200] * (BURST + 5)
    digest = Subject(SubjectKind.IP, "203.0.113.9").digest
    assert not list(use_redis.client().scan_iter(match=f"rl:{{{digest}}}:failed-auth*"))


def test_without_the_store_authentication_goes_on(settings: Any) -> None:
    configure(settings, f"redis://127.0.0.1:{free_port()}/0", REDIS={"CONNECT_TIMEOUT": "20ms"})
    assert [guess("203.0.113.77").status_code for _ in range(BURST + 5)] == [401] * (BURST + 5)


def test_bad_settings_and_a_missing_middleware_fail_the_checks(settings: Any) -> None:
    settings.RATELIMITS = {"IDENTITY": {"FAILED_AUTH": {"rate": "10/m", "burst": 0}}}
    errors = [m for m in run_checks() if m.id == SETTING_IDS["IDENTITY.FAILED_AUTH"]]
    assert [m.msg for m in errors] == ["RATELIMITS['IDENTITY']['FAILED_AUTH']['burst']: 0 must be a positive integer"]
    settings.RATELIMITS = {"IDENTITY": {"FAILED_AUTH": {"rate": "10/m", "prefix": 4}}}
    assert any("unknown keys prefix" in m.msg for m in run_checks() if m.id == SETTING_IDS["IDENTITY.FAILED_AUTH"])
    settings.RATELIMITS = {"IDENTITY": {"FAILED_AUTH": LIMIT}}
    assert [m.id for m in run_checks() if m.id == W005] == [W005]
    settings.MIDDLEWARE = [MIDDLEWARE, *settings.MIDDLEWARE]
    assert not [m for m in run_checks() if m.id == W005]
