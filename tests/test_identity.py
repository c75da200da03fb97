"""Subjects of a request: client IP behind proxies, IPv6 aggregation, API keys, hashing."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import RequestFactory

from ratelimits.identity import Subject, client_ip, default_api_key, identify, normalize_ip


def ip_of(rf: RequestFactory, remote: str, forwarded: str | None = None) -> str:
    extra = {"REMOTE_ADDR": remote}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return client_ip(rf.get("/", **extra))


def test_remote_addr_is_used_without_trusted_proxies(rf: RequestFactory) -> None:
    assert ip_of(rf, "203.0.113.5", forwarded="1.1.1.1") == "203.0.113.5"


def test_ipv6_is_aggregated_to_64(rf: RequestFactory) -> None:
    assert ip_of(rf, "2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert ip_of(rf, "2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"


def test_ipv6_prefix_setting(rf: RequestFactory, settings: Any) -> None:
    settings.RATELIMITS = {"IDENTITY": {"IPV6_PREFIX": 128}}
    assert ip_of(rf, "2001:db8::1") == "2001:db8::1"


def test_ipv4_mapped_becomes_ipv4(rf: RequestFactory) -> None:
    assert ip_of(rf, "::ffff:198.51.100.3") == "198.51.100.3"


def test_missing_or_bad_remote_addr(rf: RequestFactory) -> None:
    assert ip_of(rf, "") == "unknown"
    assert ip_of(rf, "not-an-ip") == "unknown"


@pytest.mark.parametrize(
    ("forwarded", "expected"),
    [
        ("198.51.100.9", "198.51.100.9"),
        ("198.51.100.9, 10.0.0.2", "198.51.100.9"),
        ("6.6.6.6, 198.51.100.9, 10.0.0.2", "198.51.100.9"),  # the client cannot pick its own address
        ("198.51.100.9:4711", "198.51.100.9"),
        ("[2001:db8::7]:443", "2001:db8::/64"),
        ("::ffff:198.51.100.9", "198.51.100.9"),
        # Malformed hops stop the walk at the last address we can vouch for: the proxy.
        ("garbage", "10.0.0.1"),
        ("198.51.100.9, garbage", "10.0.0.1"),
        ("", "10.0.0.1"),
        ("x" * 10_000, "10.0.0.1"),
        ("garbage, 10.0.0.2", "10.0.0.2"),
    ],
)
def test_trusted_proxies(rf: RequestFactory, settings: Any, forwarded: str, expected: str) -> None:
    settings.RATELIMITS = {"IDENTITY": {"TRUSTED_PROXIES": ["10.0.0.0/8"]}}
    assert ip_of(rf, "10.0.0.1", forwarded=forwarded) == expected


def test_forged_headers_do_not_give_a_fresh_bucket_per_request(rf: RequestFactory, settings: Any) -> None:
    settings.RATELIMITS = {"IDENTITY": {"TRUSTED_PROXIES": ["10.0.0.0/8"]}}
    seen = {ip_of(rf, "10.0.0.1", forwarded=f"{n}.{n}, 198.51.100.9") for n in range(50)}
    assert seen == {"198.51.100.9"}
    bad = {ip_of(rf, "10.0.0.1", forwarded=f"junk-{n}") for n in range(50)}
    assert bad == {"10.0.0.1"}


def test_untrusted_remote_ignores_forwarded(rf: RequestFactory, settings: Any) -> None:
    settings.RATELIMITS = {"IDENTITY": {"TRUSTED_PROXIES": ["10.0.0.0/8"]}}
    assert ip_of(rf, "203.0.113.1", forwarded="198.51.100.9") == "203.0.113.1"


@pytest.mark.parametrize("raw", ["", " ", "[::1", "1.2.3", "999.0.0.1", "a" * 100, "1.2.3.4:5:6", "\x00"])
def test_normalize_rejects_garbage(raw: str) -> None:
    assert normalize_ip(raw) is None


def test_normalize_strips_zone_and_port() -> None:
    assert str(normalize_ip("fe80::1%eth0")) == "fe80::1"
    assert str(normalize_ip(" 192.0.2.1:8080 ")) == "192.0.2.1"


def test_subject_digest_is_keyed_fixed_length_and_cluster_safe(settings: Any) -> None:
    subject = Subject("ip", "203.0.113.7")
    digest = subject.digest
    assert len(digest) == 16
    assert set(digest) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert "203" not in str(subject)
    assert Subject("ip", "{evil}").digest.count("{") == 0
    assert Subject("user", "203.0.113.7").digest != digest
    settings.SECRET_KEY = "another secret"
    assert Subject("ip", "203.0.113.7").digest != digest


def test_api_key_identity() -> None:
    class Token:
        pk = 42

    assert default_api_key(Token()) == "Token:42"
    assert default_api_key("sk_raw") == "sk_raw"
    assert default_api_key("") is None


def test_with_no_api_key_a_token_holder_is_counted_as_its_user(rf: RequestFactory, settings: Any) -> None:
    """A JWT renewed every few minutes is not a caller of its own: its user is, as under DRF."""

    class User:
        pk = 7
        is_authenticated = True

    request = rf.get("/", REMOTE_ADDR="192.0.2.1")
    token = "eyJhbGciOiJIUzI1NiJ9.first"
    assert identify(request, endpoint="charges", auth=token, user=User()).caller == Subject("api_key", token)
    settings.RATELIMITS = {"IDENTITY": {"API_KEY_FUNC": "ratelimits.identity.no_api_key"}}
    identity = identify(request, endpoint="charges", auth=token, user=User())
    assert identity.caller == identity.user == Subject("user", "7") and identity.api_key is None


def test_identify_collects_subjects(rf: RequestFactory, settings: Any) -> None:
    settings.RATELIMITS = {"IDENTITY": {"ORGANIZATION_FUNC": lambda request: "acme"}}

    class User:
        pk = 7
        is_authenticated = True

    identity = identify(rf.get("/", REMOTE_ADDR="192.0.2.1"), endpoint="charges", auth="sk_1", user=User())
    assert identity.caller == Subject("api_key", "sk_1")
    assert identity.user == Subject("user", "7")
    assert identity.organization == Subject("org", "acme")
    assert identity.ip == Subject("ip", "192.0.2.1")
    assert identity.endpoint == Subject("endpoint", "charges")
    assert not identity.is_anonymous
    anonymous = identify(rf.get("/", REMOTE_ADDR="192.0.2.1"), endpoint="charges")
    assert anonymous.caller == anonymous.ip and anonymous.is_anonymous


def test_a_caller_identified_again_gets_the_same_identity_unless_a_value_or_the_hash_key_changed(
    rf: RequestFactory, settings: Any
) -> None:
    """The identity is kept under the values it is made of: the same values, the same object; any
    value (or the hash key its digests are made with) changed, another identity with its own digests."""

    class User:
        pk = 7
        is_authenticated = True

    def identified() -> Any:
        return identify(rf.get("/", REMOTE_ADDR="192.0.2.1"), endpoint="charges", auth="sk_1", user=User())

    first = identified()
    assert identified() is first
    assert identify(rf.get("/", REMOTE_ADDR="192.0.2.2"), endpoint="charges", auth="sk_1", user=User()).ip != first.ip
    assert identify(rf.get("/", REMOTE_ADDR="192.0.2.1"), endpoint="refunds", auth="sk_1", user=User()) is not first
    settings.RATELIMITS = {"IDENTITY": {"HASH_KEY": "another key entirely, for this test"}}
    again = identified()
    assert again is not first and again.caller == first.caller  # the same subjects, hashed otherwise
    assert again.caller.digest != first.caller.digest
