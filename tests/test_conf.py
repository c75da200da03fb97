"""Settings: every default is valid, values are parsed once and follow ``override_settings``."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from ratelimits.choices import FailMode, Priority
from ratelimits.conf import POLICY_SOURCES, SETTINGS, USAGE, conf
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import Subject, SubjectKind


def test_every_default_is_valid(settings: Any) -> None:
    settings.RATELIMITS = {}
    for setting in SETTINGS.values():
        conf.value(setting)  # raises if a default does not parse


def test_typed_values() -> None:
    with override_settings(RATELIMITS={"DEFAULT_FAIL_MODE": "local", "SHED_THRESHOLDS": {"low": 10}}):
        assert conf.default_fail_mode is FailMode.LOCAL
        assert conf.shed_thresholds == {Priority.LOW: 10, Priority.NORMAL: 100, Priority.HIGH: 100}
        assert conf.redis_socket_timeout == 0.05 and conf.slot_ttl_us == 60_000_000
        assert conf.use_redis_time is True and conf.retry_after_jitter_us == 0


def test_values_are_cached_until_the_settings_change(settings: Any) -> None:
    settings.RATELIMITS = {"USAGE": True}
    assert conf.usage_counting is True
    raw = settings.RATELIMITS
    raw["USAGE"] = False  # edited in place: no setting_changed signal, so the cached value stands
    assert conf.usage_counting is True
    settings.RATELIMITS = {"USAGE": False}
    assert conf.usage_counting is False


def test_policy_sources_have_short_names(settings: Any) -> None:
    for short, path in POLICY_SOURCES.items():
        settings.RATELIMITS = {"POLICY_SOURCE": short}
        assert conf.policy_source == path
    settings.RATELIMITS = {"POLICY_SOURCE": "myapp.limits.Source"}
    assert conf.policy_source == "myapp.limits.Source"


def test_is_set_tells_a_default_from_a_setting(settings: Any) -> None:
    settings.RATELIMITS = {"USAGE": True}
    assert conf.is_set(USAGE) and not conf.is_set(SETTINGS["TIERS"])


def test_errors_name_the_setting_and_carry_it(settings: Any) -> None:
    settings.RATELIMITS = {"BREAKER_COOLDOWN": "soon"}
    with pytest.raises(ConfigurationError, match=r"RATELIMITS\['BREAKER_COOLDOWN'\]: 'soon'") as caught:
        conf.breaker  # noqa: B018
    assert caught.value.setting == "BREAKER_COOLDOWN"
    settings.RATELIMITS = "not a dict"
    with pytest.raises(ConfigurationError, match="RATELIMITS must be a dict"):
        conf.usage_counting  # noqa: B018


def test_breaker_min_calls_never_exceed_the_window(settings: Any) -> None:
    settings.RATELIMITS = {"BREAKER_WINDOW": 4, "BREAKER_MIN_CALLS": 10}
    assert conf.breaker == {"window": 4, "min_calls": 4, "failure_rate": 0.5, "cooldown": 2.0}


def test_the_hash_key_follows_hash_key_else_secret_key(settings: Any) -> None:
    subject = Subject(SubjectKind.IP, "198.51.100.1")
    settings.SECRET_KEY = "one"
    settings.RATELIMITS = {}
    first = Subject(SubjectKind.IP, subject.value).digest
    settings.SECRET_KEY = "two"
    second = Subject(SubjectKind.IP, subject.value).digest
    settings.RATELIMITS = {"HASH_KEY": "pinned"}
    pinned = Subject(SubjectKind.IP, subject.value).digest
    settings.SECRET_KEY = "three"
    assert Subject(SubjectKind.IP, subject.value).digest == pinned
    assert len({first, second, pinned}) == 3
    assert subject.value not in pinned and len(pinned) == 16


def test_the_hash_key_is_derived_as_0_1_derived_it(settings: Any) -> None:
    """Key names must survive the upgrade: an empty HASH_KEY is SECRET_KEY, bytes are hashed as str() says."""
    import hashlib

    settings.SECRET_KEY = "s3cret"
    settings.RATELIMITS = {"HASH_KEY": ""}
    assert conf.hash_key == hashlib.blake2b(b"s3cret", digest_size=32, person=b"ratelimits").digest()
    settings.RATELIMITS = {"HASH_KEY": b"raw"}
    assert conf.hash_key == hashlib.blake2b(b"b'raw'", digest_size=32, person=b"ratelimits").digest()


def test_sizes_are_bytes_or_binary_multiples(settings: Any) -> None:
    settings.RATELIMITS = {}
    assert conf.import_max_size == 10 * 1024 * 1024
    for written, size in (("512KB", 512 * 1024), ("1gb", 1024**3), ("20B", 20), (2048, 2048)):
        settings.RATELIMITS = {"IMPORT_MAX_SIZE": written}
        assert conf.import_max_size == size, written
    for bad in ("1.5MB", "10 MB", "MB", "-1KB", True, 0):
        settings.RATELIMITS = {"IMPORT_MAX_SIZE": bad}
        with pytest.raises(ConfigurationError, match=r"RATELIMITS\['IMPORT_MAX_SIZE'\]"):
            conf.import_max_size  # noqa: B018
