"""``RateLimit-Policy`` lists every policy a request is under, end to end through the demo API.

A real Redis decides; the DRF stack sets the headers; each header is read with an RFC 9651
parser (``http_sfv``), as a client would. The partition key ``pk`` names a caller by the keyed
hash its Redis keys carry: the same for every request and policy of the caller, other for another
caller, and never the API key nor a plain hash of it.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import http_sfv
import pytest
from django.http import HttpResponse

from ratelimits.identity import SubjectKind, subject_of

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.settings import merged

pytestmark = pytest.mark.django_db

TIERS = {
    "metered": {"rate": "1/s", "burst": 5, "quota": "1000/d", "concurrency": 4},
    "anon": {"rate": "2/m"},
}


@pytest.fixture
def metered(settings: Any, use_redis: Any) -> dict[str, Any]:
    """A tier with a per-second rate, a daily quota and a concurrency limit; API keys carry their tier.

    The rate's bucket holds 5 and refills one a second: the requests of a test come well within that.
    """
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": TIERS,
            "POLICIES": {
                "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "metered"},
                "TIER_FUNC": "project.payments.auth.tier_of",
            },
            "LOCAL_PATH": {"HEADER": True},
        },
    )
    return settings.RATELIMITS  # type: ignore[no-any-return]


def members(response: HttpResponse, field: str) -> list[tuple[str, dict[str, Any]]]:
    """A List field of ``response`` as an RFC 9651 parser reads it: each member's value and parameters."""
    parsed = http_sfv.List()
    parsed.parse(response[field].encode("ascii"))
    return [(member.value, dict(member.params)) for member in parsed]


def test_a_request_with_a_per_second_tier_and_a_daily_quota_sees_both(metered: Any) -> None:
    ApiKeyFactory(raw="sk_metered_1", tier="metered")
    client = client_for("sk_metered_1")
    first = client.get("/v1/customers")
    assert first.status_code == 200
    assert members(first, "RateLimit-Policy") == [
        ("tier:metered", {"q": 5, "w": 5}),
        ("tier:metered:quota", {"q": 1000, "w": 86400}),
        ("tier:metered:concurrency", {"q": 4, "qu": "concurrent-requests"}),
    ]
    # RateLimit names the closest only: 4 of 5 left is closer to the limit than 999 of 1000.
    assert members(first, "RateLimit") == [("tier:metered", {"r": 4, "t": 1})]
    assert first["X-RateLimit-Resource"] == "tier:metered" and first["X-RateLimit-Limit"] == "5"
    replies = [client.get("/v1/customers") for _ in range(5)]
    assert [reply.status_code for reply in replies] == [200, 200, 200, 200, 429]
    refused = replies[-1]
    assert members(refused, "RateLimit-Policy") == members(first, "RateLimit-Policy")
    [(name, params)] = members(refused, "RateLimit")
    assert name == "tier:metered" and params["r"] == 0
    # Refused again from this worker's memory of the denial, which knows the refusing policy only.
    again = client.get("/v1/customers")
    assert again.status_code == 429 and again["X-RateLimit-Local"] == "denial"
    assert [name for name, _ in members(again, "RateLimit-Policy")] == ["tier:metered"]


def test_closest_lists_the_closest_policy_only(metered: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(metered, {"HEADERS": {"POLICIES": "closest"}})
    ApiKeyFactory(raw="sk_metered_2", tier="metered")
    response = client_for("sk_metered_2").get("/v1/customers")
    assert response["RateLimit-Policy"] == '"tier:metered";q=5;w=5'
    assert response["RateLimit"] == '"tier:metered";r=4;t=1'


def partition_keys(response: HttpResponse) -> set[bytes]:
    """Every ``pk`` of the response's ``RateLimit-Policy`` and ``RateLimit``."""
    items = [*members(response, "RateLimit-Policy"), *members(response, "RateLimit")]
    return {params["pk"] for _, params in items}


def test_the_partition_key_is_the_callers_keyed_hash_and_never_its_key(metered: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(metered, {"HEADERS": {"PARTITION_KEY": True}})
    alice = ApiKeyFactory(raw="sk_alice_secret_0001", tier="metered")
    ApiKeyFactory(raw="sk_bob_secret_000002", tier="metered")
    client = client_for("sk_alice_secret_0001")
    replies = [client.get("/v1/customers") for _ in range(3)]
    seen = [partition_keys(reply) for reply in replies]
    # One key for every policy of the caller and every request: a partition a client can file under.
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 1
    [key] = seen[0]
    subject = subject_of(SubjectKind.API_KEY, f"ApiKey:{alice.pk}")
    assert key == base64.urlsafe_b64decode(subject.digest) and len(key) == 12
    assert partition_keys(client_for("sk_bob_secret_000002").get("/v1/customers")) != {key}
    raw = b"sk_alice_secret_0001"
    for plain in (raw, hashlib.sha256(raw).digest(), hashlib.blake2b(raw, digest_size=12).digest()):
        assert plain[:12] != key and raw not in key
    for field in ("RateLimit-Policy", "RateLimit"):
        text = replies[0][field]
        assert "sk_alice" not in text and base64.b64encode(raw).decode()[:12] not in text


def test_an_anonymous_callers_partition_key_is_not_its_address(metered: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(metered, {"HEADERS": {"PARTITION_KEY": True}})
    response = client_for(address="198.51.100.23").get("/v1/customers")
    [(name, params)] = members(response, "RateLimit-Policy")
    assert name == "tier:anon"
    assert params["pk"] == base64.urlsafe_b64decode(subject_of(SubjectKind.IP, "198.51.100.23").digest)
    assert "198.51.100.23" not in response["RateLimit-Policy"] and bytes([198, 51, 100, 23]) not in params["pk"]
