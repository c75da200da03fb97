"""Settings: every default is valid, values are parsed once and follow ``override_settings``."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from ratelimits.choices import FailMode, Priority
from ratelimits.conf import (
    POLICY_SOURCES,
    SETTINGS,
    LocalPathSettings,
    MetricsSettings,
    ReconcileSettings,
    Settings,
    Usage,
    conf,
)
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import Subject, SubjectKind


def test_every_default_is_valid(settings: Any) -> None:
    settings.RATELIMITS = {}
    for setting in SETTINGS.values():
        conf.read(setting)  # raises if a default does not parse


def test_typed_values() -> None:
    with override_settings(RATELIMITS={"FAILURE": {"DEFAULT_MODE": "local"}, "SHEDDING": {"THRESHOLDS": {"low": 10}}}):
        assert conf.failure.default_mode is FailMode.LOCAL
        assert conf.shedding.thresholds == {Priority.LOW: 10, Priority.NORMAL: 100, Priority.HIGH: 100}
        assert conf.redis.socket_timeout == 0.05 and conf.shedding.slot_ttl_us == 60_000_000
        assert conf.redis.use_redis_time is True and conf.headers.retry_after_jitter_us == 0


def test_values_are_cached_until_the_settings_change(settings: Any) -> None:
    settings.RATELIMITS = {"USAGE": True}
    assert conf.usage.enabled is True
    raw = settings.RATELIMITS
    raw["USAGE"] = False  # edited in place: no setting_changed signal, so the cached value stands
    assert conf.usage.enabled is True
    settings.RATELIMITS = {"USAGE": False}
    assert conf.usage.enabled is False
    settings.RATELIMITS = {"USAGE": {"MAX_SUBJECTS": 7}}
    assert conf.usage.enabled is True and conf.usage.max_subjects == 7


def test_policy_sources_have_short_names(settings: Any) -> None:
    for short, path in POLICY_SOURCES.items():
        settings.RATELIMITS = {"POLICIES": {"SOURCE": short}}
        assert conf.policies.source == path
    settings.RATELIMITS = {"POLICIES": {"SOURCE": "myapp.limits.Source"}}
    assert conf.policies.source == "myapp.limits.Source"


def test_is_set_tells_a_default_from_a_setting(settings: Any) -> None:
    settings.RATELIMITS = {"USAGE": {"MAX_SUBJECTS": 5}}
    assert conf.is_set(Usage.max_subjects) and not conf.is_set(Settings.tiers)
    settings.RATELIMITS = {"USAGE_MAX_SUBJECTS": 5}  # the 0.1 name
    assert conf.is_set(SETTINGS["USAGE.MAX_SUBJECTS"])


def test_errors_name_the_setting_and_carry_it(settings: Any) -> None:
    settings.RATELIMITS = {"FAILURE": {"BREAKER_COOLDOWN": "soon"}}
    with pytest.raises(ConfigurationError, match=r"RATELIMITS\['FAILURE'\]\['BREAKER_COOLDOWN'\]: 'soon'") as caught:
        conf.failure.breaker  # noqa: B018
    assert caught.value.setting == "FAILURE.BREAKER_COOLDOWN"
    settings.RATELIMITS = {"FAILURE": "often"}
    with pytest.raises(ConfigurationError, match=r"RATELIMITS\['FAILURE'\]: expected a dict, got 'often'") as caught:
        conf.failure.default_mode  # noqa: B018
    assert caught.value.setting == "FAILURE"
    settings.RATELIMITS = "not a dict"
    with pytest.raises(ConfigurationError, match="RATELIMITS must be a dict"):
        conf.usage.enabled  # noqa: B018


def test_breaker_min_calls_never_exceed_the_window(settings: Any) -> None:
    settings.RATELIMITS = {"FAILURE": {"BREAKER_WINDOW": 4, "BREAKER_MIN_CALLS": 10}}
    assert conf.failure.breaker == {"window": 4, "min_calls": 4, "failure_rate": 0.5, "cooldown": 2.0}


def test_the_hash_key_follows_hash_key_else_secret_key(settings: Any) -> None:
    subject = Subject(SubjectKind.IP, "198.51.100.1")
    settings.SECRET_KEY = "one"
    settings.RATELIMITS = {}
    first = Subject(SubjectKind.IP, subject.value).digest
    settings.SECRET_KEY = "two"
    second = Subject(SubjectKind.IP, subject.value).digest
    settings.RATELIMITS = {"IDENTITY": {"HASH_KEY": "pinned"}}
    pinned = Subject(SubjectKind.IP, subject.value).digest
    settings.SECRET_KEY = "three"
    assert Subject(SubjectKind.IP, subject.value).digest == pinned
    assert len({first, second, pinned}) == 3
    assert subject.value not in pinned and len(pinned) == 16


def test_the_hash_key_is_derived_as_0_1_derived_it(settings: Any) -> None:
    """Key names must survive the upgrade: an empty IDENTITY['HASH_KEY'] is SECRET_KEY; bytes hash as str() says."""
    import hashlib

    settings.SECRET_KEY = "s3cret"
    settings.RATELIMITS = {"IDENTITY": {"HASH_KEY": ""}}
    assert conf.identity.hash_key == hashlib.blake2b(b"s3cret", digest_size=32, person=b"ratelimits").digest()
    settings.RATELIMITS = {"IDENTITY": {"HASH_KEY": b"raw"}}
    assert conf.identity.hash_key == hashlib.blake2b(b"b'raw'", digest_size=32, person=b"ratelimits").digest()


def test_sizes_are_bytes_or_binary_multiples(settings: Any) -> None:
    settings.RATELIMITS = {}
    assert conf.policies.import_max_size == 10 * 1024 * 1024
    for written, size in (("512KB", 512 * 1024), ("1gb", 1024**3), ("20B", 20), (2048, 2048)):
        settings.RATELIMITS = {"POLICIES": {"IMPORT_MAX_SIZE": written}}
        assert conf.policies.import_max_size == size, written
    for bad in ("1.5MB", "10 MB", "MB", "-1KB", True, 0):
        settings.RATELIMITS = {"POLICIES": {"IMPORT_MAX_SIZE": bad}}
        with pytest.raises(ConfigurationError, match=r"RATELIMITS\['POLICIES'\]\['IMPORT_MAX_SIZE'\]"):
            conf.policies.import_max_size  # noqa: B018


def test_a_read_setting_is_a_plain_attribute_until_the_settings_change(settings: Any) -> None:
    """What a decision reads per request costs an attribute lookup, not a parse."""
    settings.RATELIMITS = {"LOCAL_PATH": {"HEADER": True}}
    assert conf.local_path.header is True
    assert vars(conf.local_path)["header"] is True
    settings.RATELIMITS = {"LOCAL_PATH": {"HEADER": False}}
    assert "local_path" not in vars(conf)
    assert conf.local_path.header is False


def test_the_namespaces_build_the_engines_values(settings: Any) -> None:
    settings.RATELIMITS = {
        "LOCAL_PATH": {"LEASES": True, "LEASE_TTL": "250ms"},
        "REGIONS": {"CURRENT": "eu", "STORES": {"eu": "redis://a:1/0", "us": "redis://b:1/0"}, "SHARE_FLOOR": 0.1},
        "METRICS": True,
    }
    assert conf.local_path.settings == LocalPathSettings(leases=True, lease_ttl=0.25)
    assert conf.regions.reconcile == ReconcileSettings(floor=0.1)
    assert conf.regions.count == 2 and conf.regions.current == "eu"
    assert conf.metrics.settings == MetricsSettings(multiprocess=False, flush_interval=1.0, declared=False)
    settings.RATELIMITS = {"METRICS": False, "SHEDDING": {"ADAPTIVE": False}}
    assert conf.metrics.settings is None and conf.shedding.adaptive.settings is None


def test_a_value_read_while_the_settings_change_is_not_kept(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread reading a setting as another thread's override_settings clears them must not keep the old value."""
    settings.RATELIMITS = {"ENABLED": True}
    read = Settings.value

    def read_then_change(self: Settings, setting: Any) -> Any:
        value = read(self, setting)
        settings.RATELIMITS = {"ENABLED": False}  # the change lands between the parse and the keeping
        return value

    monkeypatch.setattr(Settings, "value", read_then_change)
    assert conf.enabled is True  # what was read, returned to its reader...
    monkeypatch.undo()
    assert "enabled" not in vars(conf)  # ...but not kept
    assert conf.enabled is False


def test_a_headers_dict_is_never_read_as_the_0_1_string(settings: Any) -> None:
    settings.RATELIMITS = {"HEADERS": {"POLCIES": "closest"}}
    assert conf.headers.style == "both"
    assert [(f.kind, f.message, f.hint) for f in conf.findings()] == [
        ("unknown", "RATELIMITS['HEADERS']['POLCIES'] is not a ratelimits setting", "Did you mean 'POLICIES'?")
    ]


def test_the_0_1_adaptive_capacity_may_be_a_switch_and_old_keys_get_hints(settings: Any) -> None:
    settings.RATELIMITS = {"WORKER_CAPACITY": 8, "ADAPTIVE_CAPACITY": True, "RECONCILE": {"flor": 0.1}}
    assert conf.shedding.adaptive.enabled and conf.shedding.adaptive.settings is not None
    unknown = [f for f in conf.findings() if f.kind == "unknown"]
    assert [(f.message, f.hint) for f in unknown] == [
        ("RATELIMITS['RECONCILE']['flor'] is not a ratelimits setting", "Did you mean 'floor'?")
    ]
    settings.RATELIMITS = {"WORKER_CAPACITY": 8, "ADAPTIVE_CAPACITY": False}
    assert not conf.shedding.adaptive.enabled
