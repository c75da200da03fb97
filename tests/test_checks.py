"""System checks: the exact ids each misconfiguration produces, one id per setting."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from ratelimits.checks import (
    DJANGO_RATELIMIT_SETTINGS,
    SETTING_IDS,
    check_deployment,
    check_django_ratelimit_settings,
    check_settings,
)
from ratelimits.conf import SETTINGS
from ratelimits.policies.database import DatabasePolicySource


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def test_default_configuration_is_clean(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis"}
    assert check_settings() == []
    assert check_deployment() == []


def test_every_setting_has_an_id_of_its_own() -> None:
    assert list(SETTING_IDS) == list(SETTINGS)
    assert len(set(SETTING_IDS.values())) == len(SETTING_IDS)
    assert set(DatabasePolicySource.ignored_settings) <= set(SETTINGS)


def test_unknown_key(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "TEIRS": {}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E001"]
    assert "TEIRS" in messages[0].msg
    assert messages[0].hint == "Did you mean 'TIERS'?"


#: One bad value for every setting, and the id it must be reported under.
BAD_VALUES = [
    ("ENABLED", "no", "ratelimits.E151", "'no' must be True or False"),
    ("BACKEND", "cassandra", "ratelimits.E101", "cannot import 'cassandra'"),
    ("BACKEND", "ratelimits.conf.Settings", "ratelimits.E101", "is not a ratelimits Backend"),
    ("REDIS_URL", "redis+clusters://10.0.0.1:7000", "ratelimits.E102", "is not a Redis URL"),
    ("REDIS_URL", "", "ratelimits.E102", "must be a non-empty string"),
    ("REDIS_SOCKET_TIMEOUT", "fast", "ratelimits.E103", "is not a duration"),
    ("REDIS_CONNECT_TIMEOUT", -1, "ratelimits.E104", "must be a positive number"),
    ("REDIS_URL", "redis+sentinel://10.0.0.1:26379", "ratelimits.E102", "name the master's service"),
    ("REDIS_URL", "redis+cluster://10.0.0.1", "ratelimits.E102", "each cluster node is host:port"),
    ("REDIS_URL", "redis+cluster://10.0.0.1:7000/0", "ratelimits.E102", "names its startup nodes only"),
    ("REDIS_URL", "redis+cluster://10.0.0.1:7000?db=1", "ratelimits.E102", "names its startup nodes only"),
    ("REDIS_URL", "redis+sentinel://10.0.0.1/primary", "ratelimits.E102", "each sentinel is host:port"),
    ("REDIS_URL", "redis+sentinel://10.0.0.1:26379/primary?db=x", "ratelimits.E102", "db must be a database number"),
    ("REDIS_OPTIONS", {"pasword": "x"}, "ratelimits.E140", "unknown option 'pasword'"),
    ("REDIS_OPTIONS", {"ssl_cert_reqs": "maybe"}, "ratelimits.E140", "must be one of required"),
    ("REDIS_OPTIONS", ["password"], "ratelimits.E140", "must be a dict"),
    ("REDIS_CLIENT", "no.such.module.client", "ratelimits.E141", "cannot import"),
    ("REDIS_CLIENT", "ratelimits.conf.conf", "ratelimits.E141", "is not a redis.Redis or redis.RedisCluster client"),
    ("KEY_PREFIX", "rl{x}", "ratelimits.E105", "without braces"),
    ("CLOCK", "ntp", "ratelimits.E106", "must be one of 'redis', 'app'"),
    ("POLICY_SOURCE", "no.such.Source", "ratelimits.E107", "cannot import 'no.such.Source'"),
    ("POLICY_SOURCE", "ratelimits.conf.Settings", "ratelimits.E107", "is not a policy source"),
    ("POLICY_POLL_INTERVAL", "soon", "ratelimits.E108", "is not a duration"),
    ("POLICY_RECHECK_INTERVAL", 0, "ratelimits.E109", "must be a positive number"),
    ("POLICY_LOAD_TIMEOUT", "soon", "ratelimits.E136", "is not a duration"),
    ("TIERS", {"a": {"rate": "0/s"}}, "ratelimits.E110", "RATELIMITS['TIERS']['a']['rate']: '0/s'"),
    ("TIERS", [], "ratelimits.E110", "expected a dict"),
    (
        "TIERS",
        {"anonymous": {"rate": "10/s", "scope": "global", "quota": "100/d"}, "authenticated": {"rate": "9/s"}},
        "ratelimits.E110",
        "['anonymous']['quota']: a global tier cannot have a quota",
    ),
    (
        "TIERS",
        {"anonymous": {"rate": "10/s", "scope": "planet"}, "authenticated": {"rate": "9/s"}},
        "ratelimits.E110",
        "['anonymous']['scope']: 'planet' must be 'region' or 'global'",
    ),
    ("DEFAULT_TIERS", {"anonymous": "gold"}, "ratelimits.E111", "'gold' is not in RATELIMITS['TIERS']"),
    ("DEFAULT_TIERS", {"robots": "anonymous"}, "ratelimits.E111", "unknown keys robots"),
    ("TIER_FUNC", "no.such.func", "ratelimits.E112", "cannot import"),
    ("DIMENSIONS", {"country": "1/s"}, "ratelimits.E113", "'country' must be one of"),
    ("DIMENSIONS", {"ip": {"rate": "1/fortnight"}}, "ratelimits.E113", "unknown unit 'fortnight'"),
    ("SLOT_TTL", "forever", "ratelimits.E114", "is not a duration"),
    ("FLEET_CAPACITY", 0, "ratelimits.E115", "must be a positive integer or None"),
    ("FLEET_SHARDS", 0, "ratelimits.E142", "must be a positive integer"),
    ("FLEET_SHARDS", True, "ratelimits.E142", "must be a positive integer"),
    ("SHED_THRESHOLDS", {"low": 90, "normal": 50}, "ratelimits.E116", "must rise with priority"),
    ("WORKER_CAPACITY", "8", "ratelimits.E117", "must be a positive integer or None"),
    ("ADAPTIVE_CAPACITY", {"tolerance": 1}, "ratelimits.E147", "['tolerance']: 1 must be a number above 1"),
    ("ADAPTIVE_CAPACITY", {"window": "soon"}, "ratelimits.E147", "is not a duration"),
    ("ADAPTIVE_CAPACITY", {"floor": 0}, "ratelimits.E147", "['floor']: 0 must be a positive integer"),
    ("ADAPTIVE_CAPACITY", {"error_rate": 2}, "ratelimits.E147", "['error_rate']: 2 must be a number in (0, 1]"),
    ("ADAPTIVE_CAPACITY", {"gain": 2}, "ratelimits.E147", "unknown keys gain"),
    ("ADAPTIVE_CAPACITY", {}, "ratelimits.E147", "set RATELIMITS['WORKER_CAPACITY'] too"),
    ("USAGE", "yes", "ratelimits.E118", "must be True or False"),
    ("USAGE_MAX_SUBJECTS", 0, "ratelimits.E139", "must be a positive integer"),
    ("USAGE_MAX_SUBJECTS", "50000", "ratelimits.E139", "must be a positive integer"),
    ("ENDPOINTS", {"x": {"cost": 50}}, "ratelimits.E119", "exceeds the capacity 40 of tier:anonymous"),
    ("ENDPOINTS", {"x": {"priority": "urgent"}}, "ratelimits.E119", "'urgent' must be one of"),
    ("EXEMPT_ENDPOINTS", "health", "ratelimits.E120", "must be a list"),
    ("API_KEY_FUNC", "no.such.func", "ratelimits.E121", "cannot import"),
    ("API_KEY_MODEL", "payments.NoSuchModel", "ratelimits.E122", "is not an installed model"),
    ("ORGANIZATION_FUNC", 42, "ratelimits.E123", "must be a non-empty string"),
    ("TRUSTED_PROXIES", ["10.0.0.0/33"], "ratelimits.E124", "is not an IP address or network"),
    ("TRUSTED_PROXIES", "10.0.0.1", "ratelimits.E124", "must be a list"),
    ("CLIENT_IP_HEADER", "X-Forwarded-For", "ratelimits.E125", "must be a request.META key"),
    ("IPV6_PREFIX", 0, "ratelimits.E126", "from 1 to 128"),
    ("HASH_KEY", 42, "ratelimits.E127", "must be a string, or None to use SECRET_KEY"),
    ("HEADERS", "fancy", "ratelimits.E128", "must be one of"),
    ("HEADER_POLICIES", "every", "ratelimits.E148", "'every' must be one of 'all', 'closest'"),
    ("HEADER_PARTITION_KEY", "yes", "ratelimits.E149", "'yes' must be True or False"),
    ("RETRY_AFTER_JITTER", "-1s", "ratelimits.E129", "is not a duration"),
    ("DEFAULT_FAIL_MODE", "sometimes", "ratelimits.E130", "must be one of open, closed, local"),
    ("LOCAL_FALLBACK_SHARE", 0, "ratelimits.E131", "must be a number in (0, 1]"),
    ("LOCAL_PATH", {"lease_ttl": "2s"}, "ratelimits.E143", "longer than the 1 s a lease may last"),
    ("LOCAL_PATH", {"lease": True}, "ratelimits.E143", "unknown keys lease"),
    ("LOCAL_PATH", {"lease_share": 1.5}, "ratelimits.E143", "lease_share']: 1.5 must be a number in (0, 1]"),
    ("LOCAL_PATH", {"denials": "yes"}, "ratelimits.E143", "must be True or False"),
    ("REGION", "eu west", "ratelimits.E144", "must be a region name"),
    ("REGION", "eu-west", "ratelimits.E144", "'eu-west' is not one of RATELIMITS['REGIONS'] (none: set REGIONS)"),
    (
        "REGIONS",
        {"eu": "redis://127.0.0.1:6379/0"},
        "ratelimits.E145",
        "REGIONS']['eu']: expected a dict with string keys",
    ),
    ("REGIONS", {"eu": {"URL": "redis://x"}}, "ratelimits.E145", "unknown keys URL; use REDIS_URL"),
    (
        "REGIONS",
        {"eu": {"REDIS_URL": "http://x"}},
        "ratelimits.E145",
        "REGIONS']['eu']['REDIS_URL']: 'http://x' is not a Redis URL",
    ),
    (
        "REGIONS",
        {"eu": {"REDIS_URL": "redis://127.0.0.1:6379/0"}},
        "ratelimits.E144",
        "must name this deployment's region",
    ),
    ("RECONCILE", {"floor": 0.5}, "ratelimits.E146", "floor']: 0.5 must be a share above 0 and below 0.5"),
    ("RECONCILE", {"interval": 0}, "ratelimits.E146", "interval']: 0 must be a positive number of seconds"),
    ("RECONCILE", {"every": "1s"}, "ratelimits.E146", "unknown keys every"),
    ("METRICS", {"multiprocess": "yes"}, "ratelimits.E150", "['multiprocess']: 'yes' must be True or False"),
    ("METRICS", {"flush_interval": "2m"}, "ratelimits.E150", "flush_interval']: 120 s is longer than a minute"),
    ("METRICS", {"flush_interval": 0}, "ratelimits.E150", "flush_interval']: 0 must be a positive number"),
    ("METRICS", {"port": 9100}, "ratelimits.E150", "unknown keys port"),
    ("METRICS", "on", "ratelimits.E150", "expected a dict with string keys"),
    ("BREAKER_WINDOW", 0, "ratelimits.E132", "must be a positive integer"),
    ("BREAKER_MIN_CALLS", 2.5, "ratelimits.E133", "must be a positive integer"),
    ("BREAKER_FAILURE_RATE", 2, "ratelimits.E134", "must be a number in (0, 1]"),
    ("BREAKER_COOLDOWN", "a while", "ratelimits.E135", "is not a duration"),
    ("FAILED_AUTH", {"rate": "10/m", "burst": 0}, "ratelimits.E137", "['burst']: 0 must be a positive integer"),
    ("FAILED_AUTH", "10/m", "ratelimits.E137", "expected a dict"),
    ("IMPORT_MAX_SIZE", "10 megabytes", "ratelimits.E138", "must be a number of bytes or a size like '10MB'"),
    ("IMPORT_MAX_SIZE", 0, "ratelimits.E138", "must be a number of bytes"),
]


def test_the_table_covers_every_setting() -> None:
    assert {key for key, *_ in BAD_VALUES} == set(SETTINGS)


@pytest.mark.parametrize(("key", "value", "expected", "needle"), BAD_VALUES)
def test_invalid_values_name_the_setting(settings: Any, key: str, value: Any, expected: str, needle: str) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", key: value}
    messages = check_settings()
    assert ids(messages) == [expected]
    assert f"RATELIMITS['{key}']" in messages[0].msg
    assert needle in messages[0].msg


def test_the_adaptive_floor_may_not_exceed_the_worker_capacity(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "WORKER_CAPACITY": 4, "ADAPTIVE_CAPACITY": {"floor": 5}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E147"]
    assert "['floor']: 5 is above RATELIMITS['WORKER_CAPACITY'] (4)" in messages[0].msg
    settings.RATELIMITS = {"BACKEND": "redis", "WORKER_CAPACITY": 4, "ADAPTIVE_CAPACITY": {"floor": 4}}
    assert check_settings() == []


def test_several_bad_settings_are_each_reported(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "USAGE": 1, "WORKER_CAPACITY": -4, "HASH_KEY": 7}
    assert ids(check_settings()) == ["ratelimits.E117", "ratelimits.E118", "ratelimits.E127"]


@pytest.mark.django_db  # the command runs the models' checks too, which read the database
def test_a_bad_redis_url_fails_manage_py_check(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "REDIS_URL": "http://127.0.0.1:6379"}
    with pytest.raises(SystemCheckError, match=r"ratelimits\.E102.*RATELIMITS\['REDIS_URL'\]"):
        call_command("check")


def test_settings_must_be_a_dict(settings: Any) -> None:
    settings.RATELIMITS = ["BACKEND"]
    assert ids(check_settings()) == ["ratelimits.E003"]


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


def test_settings_the_database_source_ignores_are_named(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "POLICY_SOURCE": "database", "TIERS": {"x": "1/s"}, "FLEET_CAPACITY": 9}
    messages = check_deployment()
    assert ids(messages) == ["ratelimits.W003"]
    assert (
        messages[0].msg
        == "RATELIMITS['TIERS'], RATELIMITS['FLEET_CAPACITY'] set, but the policy source DatabasePolicySource "
        "does not read them."
    )
    settings.RATELIMITS = {"BACKEND": "redis", "POLICY_SOURCE": "database"}
    assert check_deployment() == []


def test_the_backstops_are_checked_whatever_the_source(settings: Any) -> None:
    """The database source reads DIMENSIONS only when it first loads: the checks must not wait for that."""
    settings.RATELIMITS = {"BACKEND": "redis", "POLICY_SOURCE": "database", "DIMENSIONS": {"ip": "1/fortnight"}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E113"]
    assert "RATELIMITS['DIMENSIONS']['ip']: '1/fortnight' has an unknown unit 'fortnight'" in messages[0].msg


class LegacySource:
    """A 0.1 custom source: checks_for, endpoint_rule and observe only."""

    def checks_for(self, request: Any, identity: Any) -> list[Any]:
        return []

    def endpoint_rule(self, endpoint: str, method: str) -> Any:
        return None

    def observe(self, decision: Any) -> None:
        return None


def test_a_source_missing_part_of_the_protocol_is_refused_by_name(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "POLICY_SOURCE": f"{__name__}.LegacySource"}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E107"]
    assert (
        "is not a policy source (see ratelimits.policies.PolicySource): it has no snapshot, explain, "
        in messages[0].msg
    )
    assert "invalidate, ignored_settings. Subclassing ratelimits.policies.SnapshotPolicySource" in messages[0].msg


def test_django_ratelimit_settings_are_each_named_with_their_equivalent(settings: Any) -> None:
    settings.RATELIMIT_ENABLE = False
    settings.RATELIMIT_USE_CACHE = "default"
    settings.RATELIMIT_IPV6_MASK = 48
    messages = check_django_ratelimit_settings()
    assert ids(messages) == ["ratelimits.W020", "ratelimits.W020", "ratelimits.W020"]
    assert [m.msg for m in messages] == [
        "RATELIMIT_ENABLE is django-ratelimit's setting: ratelimits does not read it.",
        "RATELIMIT_USE_CACHE is django-ratelimit's setting: ratelimits does not read it.",
        "RATELIMIT_IPV6_MASK is django-ratelimit's setting: ratelimits does not read it.",
    ]
    assert messages[0].hint.startswith("Its equivalent here: RATELIMITS['ENABLED']. ")
    assert messages[1].hint.startswith("Its equivalent here: RATELIMITS['REDIS']['CACHE'] ")
    assert messages[2].hint.startswith("Its equivalent here: RATELIMITS['IDENTITY']['IPV6_PREFIX'] ")


@pytest.mark.parametrize("name", sorted(DJANGO_RATELIMIT_SETTINGS))
def test_every_django_ratelimit_setting_is_recognised(settings: Any, name: str) -> None:
    assert check_django_ratelimit_settings() == []
    setattr(settings, name, "x")
    assert ids(check_django_ratelimit_settings()) == ["ratelimits.W020"]


def test_django_ratelimits_ten_settings_are_all_in_the_table() -> None:
    assert set(DJANGO_RATELIMIT_SETTINGS) == {
        "RATELIMIT_CACHE_PREFIX",
        "RATELIMIT_ENABLE",
        "RATELIMIT_EXCEPTION_CLASS",
        "RATELIMIT_FAIL_OPEN",
        "RATELIMIT_HASH_ALGORITHM",
        "RATELIMIT_IP_META_KEY",
        "RATELIMIT_IPV4_MASK",
        "RATELIMIT_IPV6_MASK",
        "RATELIMIT_USE_CACHE",
        "RATELIMIT_VIEW",
    }
