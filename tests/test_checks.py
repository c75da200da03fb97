"""System checks: the exact ids each misconfiguration produces, one id per setting."""

from __future__ import annotations

import functools
import sys
from typing import Any

import pytest
import rest_framework.views
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from rest_framework.test import APIClient

from ratelimits import drf, engine
from ratelimits.checks import (
    DJANGO_RATELIMIT_SETTINGS,
    SETTING_IDS,
    check_deployment,
    check_django_ratelimit_settings,
    check_endpoints,
    check_settings,
)
from ratelimits.conf import NAMESPACES, POLICY_SOURCES, SETTINGS, Settings, conf, field_of
from ratelimits.drf import exception_handler
from ratelimits.policies import get_policy_source
from ratelimits.redis_url import target_of_cache
from ratelimits.store.database import DatabasePolicySource

from .support.redis_server import script_calls


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``{"REDIS": {"URL": value}}`` for ``("REDIS", "URL")``."""
    for key in reversed(path):
        value = {key: value}
    return value  # type: ignore[no-any-return]


def test_default_configuration_is_clean(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis"}
    assert check_settings() == []
    assert check_deployment() == []


def test_every_setting_has_an_id_of_its_own() -> None:
    assert list(SETTING_IDS) == list(SETTINGS)
    ids_of_namespaces = [namespace.id for namespace in NAMESPACES.values()]
    every = [*SETTING_IDS.values(), *ids_of_namespaces]
    assert len(set(every)) == len(every)
    assert set(DatabasePolicySource.ignored_settings) <= set(SETTINGS)


def test_the_top_level_holds_at_most_fifteen_keys() -> None:
    assert len(Settings.keys()) <= 15
    assert {"ENABLED", "BACKEND", "TIERS", "ENDPOINTS", "REDIS", "POLICIES"} <= Settings.keys()


@pytest.mark.parametrize(
    ("written", "message", "hint"),
    [
        ({"TEIRS": {}}, "RATELIMITS['TEIRS'] is not a ratelimits setting", "Did you mean 'TIERS'?"),
        (
            {"REDIS": {"URI": "redis://x:1/0"}},
            "RATELIMITS['REDIS']['URI'] is not a ratelimits setting",
            "Did you mean 'URL'?",
        ),
        (
            {"LOCAL_PATH": {"lease": True}},
            "RATELIMITS['LOCAL_PATH']['lease'] is not a ratelimits setting",
            "Did you mean 'LEASES'?",
        ),
        (
            {"RECONCILE": {"every": "1s"}},
            "RATELIMITS['RECONCILE']['every'] is not a ratelimits setting",
            None,
        ),
    ],
)
def test_unknown_keys_at_any_depth(settings: Any, written: dict[str, Any], message: str, hint: str | None) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", **written}
    messages = [m for m in check_settings() if m.id != "ratelimits.W008"]
    assert ids(messages) == ["ratelimits.E001"]
    assert messages[0].msg == message
    assert messages[0].hint == hint


#: The 0.1 names, each still read, and where each is now.
RENAMED = [
    (
        {"REDIS_URL": "redis://127.0.0.1:7000/0"},
        "RATELIMITS['REDIS_URL']",
        ("REDIS", "URL"),
        "redis://127.0.0.1:7000/0",
    ),
    ({"POLICY_SOURCE": "database"}, "RATELIMITS['POLICY_SOURCE']", ("POLICIES", "SOURCE"), POLICY_SOURCES["database"]),
    ({"HEADERS": "ietf"}, "RATELIMITS['HEADERS']", ("HEADERS", "STYLE"), "ietf"),
    ({"LOCAL_PATH": {"leases": True}}, "RATELIMITS['LOCAL_PATH']['leases']", ("LOCAL_PATH", "LEASES"), True),
    ({"RECONCILE": {"floor": 0.1}}, "RATELIMITS['RECONCILE']['floor']", ("REGIONS", "SHARE_FLOOR"), 0.1),
    (
        {"METRICS": {"flush_interval": "2s"}},
        "RATELIMITS['METRICS']['flush_interval']",
        ("METRICS", "FLUSH_INTERVAL"),
        2.0,
    ),
    (
        {"REGIONS": {"eu": {"REDIS_URL": "redis://a:1/0"}}, "REGIONS.CURRENT": None},
        "RATELIMITS['REGIONS']",
        ("REGIONS", "STORES"),
        {"eu": "redis://a:1/0"},
    ),
]


@pytest.mark.parametrize(("written", "old", "path", "value"), RENAMED, ids=[r[1] for r in RENAMED])
def test_a_0_1_name_is_read_and_warned_about(
    settings: Any, written: dict[str, Any], old: str, path: tuple[str, ...], value: Any
) -> None:
    written = {k: v for k, v in written.items() if "." not in k}
    settings.RATELIMITS = {"BACKEND": "redis", **written}
    renamed = [m for m in check_settings() if m.id == "ratelimits.W008"]
    assert [m.msg for m in renamed] == [f"{old} is the name 0.1 gave {field_of(path)}; it is read as such until 0.3"]
    assert renamed[0].hint == f"Rename it {field_of(path)}."
    assert conf.value(SETTINGS[".".join(path)]) == value


def test_the_0_1_adaptive_capacity_switches_the_feature_on(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "WORKER_CAPACITY": 8, "ADAPTIVE_CAPACITY": {"floor": 3}}
    assert sorted(m.msg.split(" is ")[0] for m in check_settings()) == [
        "RATELIMITS['ADAPTIVE_CAPACITY']",
        "RATELIMITS['ADAPTIVE_CAPACITY']['floor']",
        "RATELIMITS['WORKER_CAPACITY']",
    ]
    adaptive = conf.shedding.adaptive.settings
    assert adaptive is not None and adaptive.floor == 3


def test_a_setting_under_both_names_is_a_warning_and_the_new_one_is_read(settings: Any) -> None:
    settings.RATELIMITS = {"REDIS_URL": "redis://old:1/0", "REDIS": {"URL": "redis://new:1/0"}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.W015"]
    assert messages[0].msg == (
        "RATELIMITS['REDIS_URL'] and RATELIMITS['REDIS']['URL'] are both set; RATELIMITS['REDIS']['URL'] is read"
    )
    assert conf.redis.url == "redis://new:1/0"


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ({"LOCAL_PATH": "yes"}, "ratelimits.E143"),
        ({"REDIS": "redis://127.0.0.1:6379/0"}, "ratelimits.E152"),
        ({"SHEDDING": ["WORKER_CAPACITY", 4]}, "ratelimits.E157"),
        ({"USAGE": "yes"}, "ratelimits.E118"),
        ({"METRICS": "on"}, "ratelimits.E150"),
        ({"SHEDDING": {"ADAPTIVE": 3}}, "ratelimits.E147"),
    ],
)
def test_a_namespace_that_is_not_a_dict_is_named_once(settings: Any, written: dict[str, Any], expected: str) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", **written}
    messages = check_settings()
    assert ids(messages) == [expected]
    assert f"{NAMESPACES[next(iter(written))].field()}" in messages[0].msg
    assert "expected a dict" in messages[0].msg or "expected True, False or a dict" in messages[0].msg


#: One bad value for every setting, and the id it must be reported under.
BAD_VALUES = [
    (("ENABLED",), "no", "ratelimits.E151", "'no' must be True or False"),
    (("BACKEND",), "cassandra", "ratelimits.E101", "cannot import 'cassandra'"),
    (("BACKEND",), "ratelimits.conf.Settings", "ratelimits.E101", "is not a ratelimits Backend"),
    (("TIERS",), {"a": {"rate": "0/s"}}, "ratelimits.E110", "RATELIMITS['TIERS']['a']['rate']: '0/s'"),
    (("TIERS",), [], "ratelimits.E110", "expected a dict"),
    (
        ("TIERS",),
        {"anonymous": {"rate": "10/s", "scope": "global", "quota": "100/d"}, "authenticated": {"rate": "9/s"}},
        "ratelimits.E110",
        "['anonymous']['quota']: a global tier cannot have a quota",
    ),
    (
        ("TIERS",),
        {"anonymous": {"rate": "10/s", "scope": "planet"}, "authenticated": {"rate": "9/s"}},
        "ratelimits.E110",
        "['anonymous']['scope']: 'planet' must be 'region' or 'global'",
    ),
    (("DIMENSIONS",), {"country": "1/s"}, "ratelimits.E113", "'country' must be one of"),
    (("DIMENSIONS",), {"ip": {"rate": "1/fortnight"}}, "ratelimits.E113", "unknown unit 'fortnight'"),
    (("ENDPOINTS",), {"x": {"cost": 50}}, "ratelimits.E119", "exceeds the capacity 40 of tier:anonymous"),
    (("ENDPOINTS",), {"x": {"priority": "urgent"}}, "ratelimits.E119", "'urgent' must be one of"),
    (("ENDPOINTS",), {"x": {"counts": "failures"}}, "ratelimits.E119", "['x']['counts']: 'failures' must be one of"),
    (
        ("ENDPOINTS",),
        {"x": {"cost": 3, "max_cost": 2}},
        "ratelimits.E119",
        "['x']['max_cost']: 2 is less than the cost 3",
    ),
    (("ENDPOINTS",), {"x": {"max_cost": 0}}, "ratelimits.E119", "['x']['max_cost']: 0 must be a positive integer"),
    (("REDIS", "URL"), "redis+clusters://10.0.0.1:7000", "ratelimits.E102", "is not a Redis URL"),
    (("REDIS", "URL"), "", "ratelimits.E102", "must be a non-empty string"),
    (("REDIS", "URL"), "redis+sentinel://10.0.0.1:26379", "ratelimits.E102", "name the master's service"),
    (("REDIS", "URL"), "redis+cluster://10.0.0.1", "ratelimits.E102", "each cluster node is host:port"),
    (("REDIS", "URL"), "redis+cluster://10.0.0.1:7000/0", "ratelimits.E102", "names its startup nodes only"),
    (("REDIS", "URL"), "redis+cluster://10.0.0.1:7000?db=1", "ratelimits.E102", "names its startup nodes only"),
    (("REDIS", "URL"), "redis+sentinel://10.0.0.1/primary", "ratelimits.E102", "each sentinel is host:port"),
    (("REDIS", "URL"), "redis+sentinel://10.0.0.1:26379/primary?db=x", "ratelimits.E102", "db must be a database"),
    (("REDIS", "CACHE"), "sessions", "ratelimits.E159", "'sessions' is not a cache of CACHES"),
    (("REDIS", "CLIENT"), "no.such.module.client", "ratelimits.E141", "cannot import"),
    (("REDIS", "CLIENT"), "ratelimits.conf.conf", "ratelimits.E141", "is not a redis.Redis or redis.RedisCluster"),
    (("REDIS", "OPTIONS"), {"pasword": "x"}, "ratelimits.E140", "unknown option 'pasword'"),
    (("REDIS", "OPTIONS"), {"ssl_cert_reqs": "maybe"}, "ratelimits.E140", "must be one of required"),
    (("REDIS", "OPTIONS"), ["password"], "ratelimits.E140", "must be a dict"),
    (("REDIS", "SOCKET_TIMEOUT"), "fast", "ratelimits.E103", "is not a duration"),
    (("REDIS", "CONNECT_TIMEOUT"), -1, "ratelimits.E104", "must be a positive number"),
    (("REDIS", "KEY_PREFIX"), "rl{x}", "ratelimits.E105", "without braces"),
    (("REDIS", "CLOCK"), "ntp", "ratelimits.E106", "must be one of 'redis', 'app'"),
    (("POLICIES", "SOURCE"), "no.such.Source", "ratelimits.E107", "cannot import 'no.such.Source'"),
    (("POLICIES", "SOURCE"), "ratelimits.conf.Settings", "ratelimits.E107", "is not a policy source"),
    (("POLICIES", "DEFAULT_TIERS"), {"anonymous": "gold"}, "ratelimits.E111", "'gold' is not in RATELIMITS['TIERS']"),
    (("POLICIES", "DEFAULT_TIERS"), {"robots": "anonymous"}, "ratelimits.E111", "unknown keys robots"),
    (("POLICIES", "TIER_FUNC"), "no.such.func", "ratelimits.E112", "cannot import"),
    (("POLICIES", "EXEMPT_ENDPOINTS"), "health", "ratelimits.E120", "must be a list"),
    (("POLICIES", "POLL_INTERVAL"), "soon", "ratelimits.E108", "is not a duration"),
    (("POLICIES", "RECHECK_INTERVAL"), 0, "ratelimits.E109", "must be a positive number"),
    (("POLICIES", "LOAD_TIMEOUT"), "soon", "ratelimits.E136", "is not a duration"),
    (("POLICIES", "IMPORT_MAX_SIZE"), "10 megabytes", "ratelimits.E138", "must be a number of bytes or a size"),
    (("POLICIES", "IMPORT_MAX_SIZE"), 0, "ratelimits.E138", "must be a number of bytes"),
    (("IDENTITY", "API_KEY_FUNC"), "no.such.func", "ratelimits.E121", "cannot import"),
    (("IDENTITY", "API_KEY_MODEL"), "payments.NoSuchModel", "ratelimits.E122", "is not an installed model"),
    (("IDENTITY", "ORGANIZATION_FUNC"), 42, "ratelimits.E123", "must be a non-empty string"),
    (("IDENTITY", "TRUSTED_PROXIES"), ["10.0.0.0/33"], "ratelimits.E124", "is not an IP address or network"),
    (("IDENTITY", "TRUSTED_PROXIES"), "10.0.0.1", "ratelimits.E124", "must be a list"),
    (("IDENTITY", "CLIENT_IP_HEADER"), "X-Forwarded-For", "ratelimits.E125", "must be a request.META key"),
    (("IDENTITY", "IPV6_PREFIX"), 0, "ratelimits.E126", "from 1 to 128"),
    (("IDENTITY", "HASH_KEY"), 42, "ratelimits.E127", "must be a string, or None to use SECRET_KEY"),
    (("IDENTITY", "FAILED_AUTH"), {"rate": "10/m", "burst": 0}, "ratelimits.E137", "['burst']: 0 must be a positive"),
    (("IDENTITY", "FAILED_AUTH"), "10/m", "ratelimits.E137", "expected a dict"),
    (("HEADERS", "STYLE"), "fancy", "ratelimits.E128", "must be one of"),
    (("HEADERS", "POLICIES"), "every", "ratelimits.E148", "'every' must be one of 'all', 'closest'"),
    (("HEADERS", "PARTITION_KEY"), "yes", "ratelimits.E149", "'yes' must be True or False"),
    (("HEADERS", "RETRY_AFTER_JITTER"), "-1s", "ratelimits.E129", "is not a duration"),
    (("FAILURE", "DEFAULT_MODE"), "sometimes", "ratelimits.E130", "must be one of open, closed, local"),
    (("FAILURE", "LOCAL_SHARE"), 0, "ratelimits.E131", "must be a number in (0, 1]"),
    (("FAILURE", "BREAKER_WINDOW"), 0, "ratelimits.E132", "must be a positive integer"),
    (("FAILURE", "BREAKER_MIN_CALLS"), 2.5, "ratelimits.E133", "must be a positive integer"),
    (("FAILURE", "BREAKER_FAILURE_RATE"), 2, "ratelimits.E134", "must be a number in (0, 1]"),
    (("FAILURE", "BREAKER_COOLDOWN"), "a while", "ratelimits.E135", "is not a duration"),
    (("SHEDDING", "FLEET_CAPACITY"), 0, "ratelimits.E115", "must be a positive integer or None"),
    (("SHEDDING", "FLEET_SHARDS"), 0, "ratelimits.E142", "must be a positive integer"),
    (("SHEDDING", "FLEET_SHARDS"), True, "ratelimits.E142", "must be a positive integer"),
    (("SHEDDING", "THRESHOLDS"), {"low": 90, "normal": 50}, "ratelimits.E116", "must rise with priority"),
    (("SHEDDING", "WORKER_CAPACITY"), "8", "ratelimits.E117", "must be a positive integer or None"),
    (("SHEDDING", "SLOT_TTL"), "forever", "ratelimits.E114", "is not a duration"),
    (("SHEDDING", "ADAPTIVE", "FLOOR"), 0, "ratelimits.E160", "0 must be a positive integer"),
    (("SHEDDING", "ADAPTIVE", "TOLERANCE"), 1, "ratelimits.E161", "1 must be a number above 1"),
    (("SHEDDING", "ADAPTIVE", "WINDOW"), "soon", "ratelimits.E162", "is not a duration"),
    (("SHEDDING", "ADAPTIVE", "MIN_SAMPLES"), 0, "ratelimits.E163", "must be a positive integer"),
    (("SHEDDING", "ADAPTIVE", "ERROR_RATE"), 2, "ratelimits.E164", "2 must be a number in (0, 1]"),
    (("SHEDDING", "ADAPTIVE", "TIMEOUT"), "never", "ratelimits.E165", "is not a duration"),
    (("SHEDDING", "ADAPTIVE", "PROBE_INTERVAL"), 0, "ratelimits.E166", "must be a positive number"),
    (("SHEDDING", "TENANT_SHARE"), 0, "ratelimits.E179", "must be a percentage from 1 to 100"),
    (("SHEDDING", "BODY_TIMEOUT"), "soon", "ratelimits.E180", "is not a duration"),
    (("SHEDDING", "SLOT_LEASE"), "0s", "ratelimits.E181", "has a zero-length period"),
    (("SHEDDING", "TENANT_SHARE"), 0.5, "ratelimits.E179", "must be a percentage from 1 to 100"),
    (("USAGE", "MAX_SUBJECTS"), 0, "ratelimits.E139", "must be a positive integer"),
    (("USAGE", "MAX_SUBJECTS"), "50000", "ratelimits.E139", "must be a positive integer"),
    (("USAGE", "DRAIN_EVERY"), "often", "ratelimits.E178", "is not a duration"),
    (("USAGE", "DRAIN_EVERY"), 0, "ratelimits.E178", "must be a positive number of seconds"),
    (("USAGE", "FLUSH_EVERY"), "soon", "ratelimits.E182", "is not a duration"),
    (("USAGE", "FLUSH_EVERY"), 0, "ratelimits.E182", "must be a positive number of seconds"),
    (("USAGE", "FLUSH_EVERY"), "2m", "ratelimits.E182", "is longer than a minute"),
    (("LOCAL_PATH", "DENIALS"), "yes", "ratelimits.E167", "must be True or False"),
    (("LOCAL_PATH", "LEASES"), 1, "ratelimits.E168", "must be True or False"),
    (("LOCAL_PATH", "LEASE_TTL"), "2s", "ratelimits.E169", "longer than the 1 s a lease may last"),
    (("LOCAL_PATH", "LEASE_SHARE"), 1.5, "ratelimits.E170", "1.5 must be a number in (0, 1]"),
    (("LOCAL_PATH", "MAX_ENTRIES"), 0, "ratelimits.E171", "must be a positive integer"),
    (("LOCAL_PATH", "HEADER"), "on", "ratelimits.E172", "must be True or False"),
    (("REGIONS", "STORES"), {"eu": "http://x"}, "ratelimits.E145", "['eu']: 'http://x' is not a Redis URL"),
    (("REGIONS", "STORES"), {"eu west": "redis://x"}, "ratelimits.E145", "must be a region name"),
    (("REGIONS", "STORES"), {"eu": "redis://127.0.0.1:6379/0"}, "ratelimits.E144", "must name this deployment"),
    (("REGIONS", "CURRENT"), "eu west", "ratelimits.E144", "must be a region name"),
    (("REGIONS", "CURRENT"), "eu-west", "ratelimits.E144", "'eu-west' is not one of RATELIMITS['REGIONS']['STORES']"),
    (("REGIONS", "RECONCILE_INTERVAL"), 0, "ratelimits.E146", "0 must be a positive number of seconds"),
    (("REGIONS", "SHARE_FLOOR"), 0.5, "ratelimits.E173", "0.5 must be a share above 0 and below 0.5"),
    (("REGIONS", "STALE_AFTER"), "later", "ratelimits.E174", "is not a duration"),
    (("REGIONS", "DECAY"), -1, "ratelimits.E175", "must be a positive number"),
    (("METRICS", "MULTIPROCESS"), "yes", "ratelimits.E176", "'yes' must be True or False"),
    (("METRICS", "FLUSH_INTERVAL"), "2m", "ratelimits.E177", "120 s is longer than a minute"),
    (("METRICS", "FLUSH_INTERVAL"), 0, "ratelimits.E177", "0 must be a positive number"),
    (("USAGE", "NOTICES", "QUOTA_THRESHOLDS"), "80", "ratelimits.E185", "must be a list of percentages"),
    (("USAGE", "NOTICES", "QUOTA_THRESHOLDS"), [80, 0], "ratelimits.E185", "0 must be a percentage from 1 to 100"),
    (("USAGE", "NOTICES", "QUOTA_THRESHOLDS"), [120], "ratelimits.E185", "120 must be a percentage from 1 to 100"),
    (("USAGE", "NOTICES", "REFUSALS"), 0, "ratelimits.E186", "must be a positive integer or None"),
    (("USAGE", "NOTICES", "REFUSALS_WITHIN"), "a while", "ratelimits.E187", "is not a duration"),
    (("USAGE", "NOTICES", "REFUSALS_WITHIN"), "90s", "ratelimits.E187", "must be whole minutes, from one to sixty"),
    (("USAGE", "NOTICES", "REFUSALS_WITHIN"), "2h", "ratelimits.E187", "must be whole minutes, from one to sixty"),
    (("USAGE", "NOTICES", "EVERY"), 0, "ratelimits.E188", "must be a positive number of seconds"),
    (("USAGE", "NOTICES", "TIMEOUT"), "soon", "ratelimits.E189", "is not a duration"),
    (("USAGE", "NOTICES", "RETRY_FIRST"), -1, "ratelimits.E190", "must be a positive number of seconds"),
    (("USAGE", "NOTICES", "RETRY_LONGEST"), "later", "ratelimits.E191", "is not a duration"),
    (("USAGE", "NOTICES", "RETRY_FOR"), "ever", "ratelimits.E192", "is not a duration"),
    (("USAGE", "NOTICES", "ALLOW_PRIVATE_URLS"), "yes", "ratelimits.E193", "must be True or False"),
]


def test_the_table_covers_every_setting() -> None:
    assert {".".join(path) for path, *_ in BAD_VALUES} == set(SETTINGS)


@pytest.mark.parametrize(("path", "value", "expected", "needle"), BAD_VALUES)
def test_invalid_values_name_the_setting(
    settings: Any, path: tuple[str, ...], value: Any, expected: str, needle: str
) -> None:
    given = nested(path, value)
    if path[:2] == ("SHEDDING", "ADAPTIVE"):
        given["SHEDDING"]["WORKER_CAPACITY"] = 8  # the adaptive capacity needs its ceiling
    settings.RATELIMITS = {"BACKEND": "redis", **given}
    messages = check_settings()
    assert ids(messages) == [expected]
    field = field_of(path) if expected == SETTINGS[".".join(path)].id else "RATELIMITS['REGIONS']['CURRENT']"
    assert field in messages[0].msg
    assert needle in messages[0].msg


def test_the_adaptive_capacity_needs_a_worker_capacity_above_its_floor(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "SHEDDING": {"ADAPTIVE": True}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E147"]
    assert "set RATELIMITS['SHEDDING']['WORKER_CAPACITY'] too" in messages[0].msg
    settings.RATELIMITS = {"BACKEND": "redis", "SHEDDING": {"WORKER_CAPACITY": 4, "ADAPTIVE": {"FLOOR": 5}}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E160"]
    assert "['FLOOR']: 5 is above RATELIMITS['SHEDDING']['WORKER_CAPACITY'] (4)" in messages[0].msg
    settings.RATELIMITS = {"BACKEND": "redis", "SHEDDING": {"WORKER_CAPACITY": 4, "ADAPTIVE": {"FLOOR": 4}}}
    assert check_settings() == []


def test_several_bad_settings_are_each_reported(settings: Any) -> None:
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "USAGE": 1,
        "SHEDDING": {"WORKER_CAPACITY": -4},
        "IDENTITY": {"HASH_KEY": 7},
    }
    assert ids(check_settings()) == ["ratelimits.E127", "ratelimits.E117", "ratelimits.E118"]


@pytest.mark.django_db  # the command runs the models' checks too, which read the database
def test_a_bad_redis_url_fails_manage_py_check(settings: Any) -> None:
    settings.RATELIMITS = {"REDIS": {"URL": "http://127.0.0.1:6379"}}
    with pytest.raises(SystemCheckError, match=r"ratelimits\.E102.*RATELIMITS\['REDIS'\]\['URL'\]"):
        call_command("check")


def test_the_backend_follows_where_the_redis_is(settings: Any) -> None:
    settings.RATELIMITS = {}
    assert conf.backend == "memory"
    for written in (
        {"REDIS": {"URL": "redis://127.0.0.1:6379/3"}},
        {"REDIS_URL": "redis://127.0.0.1:6379/3"},
        {"REDIS": {"CLIENT": "tests.test_checks.make_client"}},
    ):
        settings.RATELIMITS = written
        assert conf.backend == "redis", written
    settings.CACHES = {"shared": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:6379/4"}}
    settings.RATELIMITS = {"REDIS": {"CACHE": "shared"}}
    assert conf.backend == "redis"
    assert conf.redis.address == ("redis://127.0.0.1:6379/4", {})


def make_client() -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=1)


def test_a_redis_the_memory_backend_never_uses_is_a_warning(settings: Any) -> None:
    settings.DEBUG = True
    settings.RATELIMITS = {"BACKEND": "memory", "REDIS": {"URL": "redis://127.0.0.1:6379/0"}}
    messages = check_deployment()
    assert ids(messages) == ["ratelimits.W009"]
    assert messages[0].msg.startswith(
        "RATELIMITS['REDIS']['URL'] set, but RATELIMITS['BACKEND'] is 'memory': the limiter never uses that Redis"
    )
    settings.RATELIMITS = {"REDIS": {"URL": "redis://127.0.0.1:6379/0"}}
    assert check_deployment() == []


def test_tiers_that_drop_a_default_tiers_name_say_how_to_mend_it(settings: Any) -> None:
    """TIERS replaces the default tiers whole: a project naming only its own is told which names it has."""
    settings.RATELIMITS = {"BACKEND": "redis", "TIERS": {"anonymous": {"rate": "2/m"}, "free": {"rate": "3/s"}}}
    messages = check_settings()
    assert [(m.id, m.msg) for m in messages] == [
        (
            "ratelimits.E111",
            "RATELIMITS['POLICIES']['DEFAULT_TIERS']['authenticated']: 'authenticated' is not in RATELIMITS['TIERS'] "
            "(its tiers: 'anonymous', 'free'). A project's TIERS replaces the default tiers whole: name one of its "
            "tiers here, or add a tier 'authenticated'",
        )
    ]


@pytest.mark.django_db
def test_the_policy_source_path_01_documented_still_loads_and_is_a_warning(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "POLICIES": {"SOURCE": "ratelimits.sources.DatabasePolicySource"}}
    assert conf.policies.source == "ratelimits.store.database.DatabasePolicySource"
    assert check_settings() == []
    assert isinstance(get_policy_source(), DatabasePolicySource)
    messages = check_deployment()
    assert ids(messages) == ["ratelimits.W022"]
    assert messages[0].msg == (
        "RATELIMITS['POLICIES']['SOURCE'] is 'ratelimits.sources.DatabasePolicySource', where the class used to be: "
        "it is read as 'ratelimits.store.database.DatabasePolicySource' until 0.3, then refused."
    )
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "POLICIES": {"SOURCE": "ratelimits.policies.database.DatabasePolicySource"},
    }
    assert conf.policies.source == "ratelimits.store.database.DatabasePolicySource"
    assert ids(check_deployment()) == ["ratelimits.W022"]
    settings.RATELIMITS = {"BACKEND": "redis", "POLICIES": {"SOURCE": "database"}}
    assert check_deployment() == []


def test_importing_the_01_module_of_the_database_source_warns() -> None:
    sys.modules.pop("ratelimits.sources", None)
    with pytest.warns(
        DeprecationWarning, match=r"ratelimits\.sources is deprecated .* POLICIES\['SOURCE'\] = 'database'"
    ) as warned:
        from ratelimits.sources import DatabasePolicySource as Retired
    assert Retired is DatabasePolicySource
    assert warned[0].filename == __file__  # the warning points at the import, not into ratelimits


def test_a_cache_and_a_url_are_not_both_the_limiters_redis(settings: Any) -> None:
    settings.CACHES = {"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1/1"}}
    settings.RATELIMITS = {"REDIS": {"CACHE": "default", "URL": "redis://127.0.0.1:6379/0"}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E159"]
    assert "RATELIMITS['REDIS']['CACHE'] and RATELIMITS['REDIS']['URL'] are both set" in messages[0].msg


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


def wrapping_handler(exc: Exception, context: dict[str, Any]) -> Any:
    """A project's handler that renders ours and adds its own field to everything else."""
    response = drf.problem_response(exc, context)
    if response is None:
        response = rest_framework.views.exception_handler(exc, context)
        if response is not None:
            response.data["request_id"] = "x"
    return response


def delegating_handler(exc: Exception, context: dict[str, Any]) -> Any:
    def inner() -> Any:
        return exception_handler(exc, context)

    return inner()


@functools.wraps(drf.exception_handler)
def wrapped_handler(exc: Exception, context: dict[str, Any]) -> Any:
    return drf.exception_handler(exc, context)


def labelled_handler(exc: Exception, context: dict[str, Any], *, label: str) -> Any:
    return drf.exception_handler(exc, context)


#: A handler given its options, as a project's settings module may build one.
partial_handler = functools.partial(labelled_handler, label="api")


def own_handler(exc: Exception, context: dict[str, Any]) -> Any:
    return rest_framework.views.exception_handler(exc, context)


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        ("ratelimits.drf.exception_handler", []),
        ("tests.test_checks.wrapping_handler", []),
        ("tests.test_checks.delegating_handler", []),
        ("tests.test_checks.wrapped_handler", []),
        ("tests.test_checks.partial_handler", []),
        ("tests.test_checks.own_handler", ["ratelimits.W002"]),
        ("rest_framework.views.exception_handler", ["ratelimits.W002"]),
    ],
)
def test_a_handler_that_calls_ours_is_recognised(settings: Any, handler: str, expected: list[str]) -> None:
    settings.RATELIMITS = {"BACKEND": "redis"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "EXCEPTION_HANDLER": handler}
    messages = check_deployment()
    assert ids(messages) == expected
    if expected:
        assert "ratelimits.drf.problem_response(exc, context)" in (messages[0].hint or "")


def test_settings_the_database_source_ignores_are_named(settings: Any) -> None:
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "POLICIES": {"SOURCE": "database"},
        "TIERS": {"x": "1/s"},
        "SHEDDING": {"FLEET_CAPACITY": 9},
    }
    messages = check_deployment()
    assert ids(messages) == ["ratelimits.W003"]
    assert (
        messages[0].msg == "RATELIMITS['TIERS'], RATELIMITS['SHEDDING']['FLEET_CAPACITY'] set, but the policy source "
        "DatabasePolicySource reads its own tables instead: these decide only while the tables cannot be read "
        "(before migrate, a database outage)."
    )
    settings.RATELIMITS = {"BACKEND": "redis", "POLICIES": {"SOURCE": "database"}}
    assert check_deployment() == []


def test_the_backstops_are_checked_whatever_the_source(settings: Any) -> None:
    """The database source reads DIMENSIONS only when it first loads: the checks must not wait for that."""
    settings.RATELIMITS = {"BACKEND": "redis", "POLICIES": {"SOURCE": "database"}, "DIMENSIONS": {"ip": "1/fortnight"}}
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
    settings.RATELIMITS = {"BACKEND": "redis", "POLICIES": {"SOURCE": f"{__name__}.LegacySource"}}
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


@pytest.mark.parametrize(
    ("endpoints", "exempt", "found"),
    [
        ({"customers": {"cost": 1}, "POST charges": {}, "ping": {}}, ["rate_limit"], []),
        (
            {"custmers": {"cost": 1}},
            [],
            [
                (
                    "ratelimits.W013",
                    "RATELIMITS['ENDPOINTS']: 'custmers' matches no endpoint",
                    "Did you mean 'customers'?",
                )
            ],
        ),
        (
            {"POST /v1/charges": {"priority": "critical"}},
            [],
            [("ratelimits.E008", "'POST /v1/charges' is a URL path", "write 'POST charges'.")],
        ),
        (
            {},
            ["/t/ping", "healthz"],
            [
                ("ratelimits.E008", "RATELIMITS['POLICIES']['EXEMPT_ENDPOINTS']: '/t/ping' is a URL path", "'ping'"),
                ("ratelimits.W013", "'healthz' matches no endpoint of the project", None),
            ],
        ),
    ],
)
def test_endpoint_names_that_match_no_route_or_are_paths_are_named(
    settings: Any, endpoints: dict[str, Any], exempt: list[str], found: list[tuple[str, str, str | None]]
) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "ENDPOINTS": endpoints, "POLICIES": {"EXEMPT_ENDPOINTS": exempt}}
    messages = check_endpoints()
    assert ids(messages) == [check_id for check_id, *_ in found]
    for message, (_, text, hint) in zip(messages, found, strict=True):
        assert text in message.msg
        assert hint is None or hint in (message.hint or ""), message.hint


def test_the_database_source_ignores_endpoints_so_they_are_not_matched(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "redis", "POLICIES": {"SOURCE": "database"}, "ENDPOINTS": {"nowhere": {}}}
    assert check_endpoints() == []  # W003 says ENDPOINTS is ignored there


def test_django_redis_and_djangos_own_cache_are_read_as_the_limiters_redis() -> None:
    assert target_of_cache(
        "default",
        {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": ["rediss://cache.internal:6380/2", "rediss://replica.internal:6380/2"],
            "OPTIONS": {
                "PASSWORD": "s3cret",
                "SOCKET_TIMEOUT": 5,  # the cache's: the limiter keeps its own
                "CONNECTION_POOL_KWARGS": {"ssl_cert_reqs": None, "ssl_ca_certs": "/etc/ca.pem", "max_connections": 9},
            },
        },
    ) == (
        "rediss://cache.internal:6380/2",
        {"password": "s3cret", "ssl_cert_reqs": "none", "ssl_ca_certs": "/etc/ca.pem"},
    )
    assert target_of_cache(
        "default",
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:6379,redis://127.0.0.1:6380",
            "OPTIONS": {"db": 3, "username": "limiter", "password": "pw", "pool_class": "x"},
        },
    ) == ("redis://127.0.0.1:6379/3", {"username": "limiter", "password": "pw"})
    assert target_of_cache(
        "sessions",
        {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://user:pw@primary/1",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "SENTINELS": [("10.0.0.1", 26379), ("10.0.0.2", 26380)],
                "SENTINEL_KWARGS": {"password": "sentinel-pw"},
            },
        },
    ) == ("redis+sentinel://user:pw@10.0.0.1:26379,10.0.0.2:26380/primary?db=1", {"sentinel_password": "sentinel-pw"})
    sentinel = {"CLIENT_CLASS": "django_redis.client.SentinelClient", "SENTINELS": [("10.0.0.1", 26379)]}
    assert target_of_cache(
        "x", {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://primary?db=7", "OPTIONS": sentinel}
    ) == ("redis+sentinel://10.0.0.1:26379/primary?db=7", {})
    assert target_of_cache(
        "x",
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:6379?socket_timeout=1",
            "OPTIONS": {"db": 4},
        },
    ) == ("redis://127.0.0.1:6379/4?socket_timeout=1", {})


@pytest.mark.parametrize(
    ("cache", "needle"),
    [
        ({"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}, "not a Redis cache"),
        ({"BACKEND": "django_redis.cache.RedisCache", "LOCATION": 7}, "['LOCATION'] must be a Redis URL"),
        (
            {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": ["redis://a:1/0", "redis://b:1/0"],
                "OPTIONS": {"CLIENT_CLASS": "django_redis.client.ShardClient"},
            },
            "shards keys over several servers",
        ),
        ({"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "memcached://x:1"}, "the scheme must be one of"),
    ],
)
def test_a_cache_the_limiter_cannot_share_fails_the_checks_naming_it(
    settings: Any, cache: dict[str, Any], needle: str
) -> None:
    settings.CACHES = {**settings.CACHES, "shared": cache}
    settings.RATELIMITS = {"REDIS": {"CACHE": "shared"}}
    messages = check_settings()
    assert ids(messages) == ["ratelimits.E159"]
    assert messages[0].msg.startswith("RATELIMITS['REDIS']['CACHE']: CACHES['shared']") and needle in messages[0].msg


@pytest.mark.django_db
def test_the_limiter_decides_on_the_redis_of_a_django_redis_cache(settings: Any, redis_server: Any) -> None:
    settings.CACHES = {
        **settings.CACHES,
        "default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_server.url},
    }
    settings.RATELIMITS = {"REDIS": {"CACHE": "default"}, "TIERS": {"anonymous": "2/m", "authenticated": "2/m"}}
    engine.reset()
    client = APIClient(REMOTE_ADDR="198.51.100.60")
    assert client.get("/t/ping").status_code == 200  # the first also loads the scripts
    before = script_calls(redis_server)
    assert [client.get("/t/ping").status_code for _ in range(2)] == [200, 429]
    assert script_calls(redis_server) - before == 2  # decided in that Redis, one call a request
    assert check_settings() == []


def _render(exc: Exception, context: dict[str, Any]) -> Any:
    return drf.problem_response(exc, context)


def helper_handler(exc: Exception, context: dict[str, Any]) -> Any:
    """Calls ours through a helper of its module."""
    return _render(exc, context) or rest_framework.views.exception_handler(exc, context)


class HandlerObject:
    def __call__(self, exc: Exception, context: dict[str, Any]) -> Any:
        return drf.exception_handler(exc, context)


handler_object = HandlerObject()


@pytest.mark.parametrize("handler", ["tests.test_checks.helper_handler", "tests.test_checks.handler_object"])
def test_a_handler_that_reaches_ours_through_a_helper_or_an_object_is_recognised(settings: Any, handler: str) -> None:
    settings.RATELIMITS = {"BACKEND": "redis"}
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "EXCEPTION_HANDLER": handler}
    assert check_deployment() == []
