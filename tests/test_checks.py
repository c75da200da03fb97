"""System checks: the exact ids each misconfiguration produces."""

from __future__ import annotations

from typing import Any

import pytest

from ratelimits.checks import check_deployment, check_settings


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def test_default_configuration_is_clean(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis"}
    assert check_settings() == []
    assert check_deployment() == []


def test_unknown_key(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "TEIRS": {}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E001"]
    assert "TEIRS" in messages[0].msg


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("KEY_PREFIX", "rl{x}", "KEY_PREFIX"),
        ("CLOCK", "ntp", "CLOCK"),
        ("REDIS_SOCKET_TIMEOUT", "fast", "REDIS_SOCKET_TIMEOUT"),
        ("TRUSTED_PROXIES", ["10.0.0.0/33"], "TRUSTED_PROXIES"),
        ("TRUSTED_PROXIES", "10.0.0.1", "TRUSTED_PROXIES"),
        ("IPV6_PREFIX", 0, "IPV6_PREFIX"),
        ("HEADERS", "fancy", "HEADERS"),
        ("RETRY_AFTER_JITTER", "-1s", "RETRY_AFTER_JITTER"),
        ("DEFAULT_FAIL_MODE", "sometimes", "DEFAULT_FAIL_MODE"),
        ("LOCAL_FALLBACK_SHARE", 0, "LOCAL_FALLBACK_SHARE"),
        ("BREAKER_FAILURE_RATE", 2, "BREAKER_FAILURE_RATE"),
        ("BREAKER_WINDOW", 0, "BREAKER_WINDOW"),
        ("API_KEY_FUNC", "no.such.func", "API_KEY_FUNC"),
        ("TIERS", {"a": {"rate": "0/s"}}, "TIERS"),
        ("API_KEY_MODEL", "payments.NoSuchModel", "API_KEY_MODEL"),
        ("POLICY_POLL_INTERVAL", "soon", "POLICY_POLL_INTERVAL"),
    ],
)
def test_invalid_values_name_the_setting(settings: Any, key: str, value: Any, needle: str) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", key: value}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E002"]
    assert needle in messages[0].msg


def test_settings_must_be_a_dict(settings: Any) -> None:
    settings.RATELIMITS = ["BACKEND"]
    assert ids(check_settings()) == ["ratelimits.E002"]


def test_memory_backend_outside_debug_warns(settings: Any) -> None:
    settings.DEBUG = False
    settings.RATELIMITS = {"BACKEND": "memory"}
    assert ids(check_deployment()) == ["ratelimits.W001"]
    settings.DEBUG = True
    assert check_deployment() == []


def test_throttle_without_problem_handler_warns(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "EXCEPTION_HANDLER": "rest_framework.views.exception_handler"}
    assert ids(check_deployment()) == ["ratelimits.W002"]
