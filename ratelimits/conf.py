"""Settings of ratelimits: every key of ``settings.RATELIMITS``, its default and how it is validated.

Each setting is declared once in :data:`SETTINGS` with a parser whose errors name it. Values are
parsed on first use and cached until a ``setting_changed`` signal, so ``override_settings`` just
works and a request reads a cached value. The system checks (:mod:`ratelimits.checks`) parse every
setting at start-up, so a bad value fails ``manage.py check``, not the first request.

Settings that describe policies (``TIERS``, ``ENDPOINTS``, ...) are checked here for their shape;
the checks then build the configured policy source, which checks the contents of those it reads
(rates, costs, references to tiers), and ``DIMENSIONS``, which every source reads.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, cast

import redis
from django.apps import apps
from django.conf import settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from .choices import SHEDDABLE, FailMode, Priority
from .exceptions import ConfigurationError
from .rates import Rate, check_burst, parse_duration, parse_rate
from .redis_url import check_options, parse_redis_url

if TYPE_CHECKING:
    from django.db.models import Model

__all__ = [
    "HEADER_POLICY_CHOICES",
    "HEADER_STYLES",
    "POLICY_SOURCES",
    "SETTINGS",
    "SIZE_UNITS",
    "FailedAuthLimit",
    "MetricsSettings",
    "ProcessWide",
    "Setting",
    "conf",
]

T = TypeVar("T")

HEADER_STYLES = ("ietf", "github", "both", "none")
#: What ``RateLimit-Policy`` lists: every enforced policy of the request, or the closest only.
HEADER_POLICY_CHOICES = ("all", "closest")
#: Short names for ``POLICY_SOURCE``, like ``BACKEND``'s ``"memory"`` and ``"redis"``.
POLICY_SOURCES = {
    "settings": "ratelimits.policies.SettingsPolicySource",
    "database": "ratelimits.policies.database.DatabasePolicySource",
}
#: The subject kinds ``DIMENSIONS`` may limit.
DIMENSION_KINDS = ("ip", "user", "api_key", "org")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One key of ``settings.RATELIMITS``: its default and the parser that validates a value."""

    name: str
    default: Any
    #: ``(value, field) -> parsed``; raises :class:`ConfigurationError` naming ``field``.
    parser: Callable[[Any, str], T]

    @property
    def field(self) -> str:
        return f"RATELIMITS['{self.name}']"

    def parse(self, value: Any) -> T:
        try:
            return self.parser(value, self.field)
        except ConfigurationError as exc:
            raise ConfigurationError(str(exc), setting=self.name) from None


# -- parsers: (value, field) -> parsed value ----------------------------------------------------


def _text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{field}: {value!r} must be a non-empty string")
    return value.strip()


def _choice(choices: Sequence[str]) -> Callable[[object, str], str]:
    def parse(value: object, field: str) -> str:
        if value not in choices:
            raise ConfigurationError(f"{field}: {value!r} must be one of {', '.join(map(repr, choices))}")
        return str(value)

    return parse


def _redis_url(value: object, field: str) -> str:
    url = _text(value, field)
    try:
        parse_redis_url(url)
    except ValueError as exc:
        raise ConfigurationError(f"{field}: {url!r} is not a Redis URL: {exc}") from None
    return url


def _redis_options(value: object, field: str) -> dict[str, Any]:
    try:
        return check_options(value, field)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


def _redis_client(value: object, field: str) -> redis.Redis | redis.RedisCluster | None:
    """A client the project built: the object an import path names, or what that callable returns.

    A :class:`redis.Redis` (any single server or Sentinel master) or a :class:`redis.RedisCluster`.
    """
    if value is None:
        return None
    clients = (redis.Redis, redis.RedisCluster)
    try:
        found = value if isinstance(value, clients) else import_string(_text(value, field))
    except ImportError as exc:
        raise ConfigurationError(f"{field}: cannot import {value!r}: {exc}") from exc
    if callable(found) and not isinstance(found, clients):
        found = found()
    if not isinstance(found, clients):
        raise ConfigurationError(
            f"{field}: {value!r} is not a redis.Redis or redis.RedisCluster client (nor a function returning one)"
        )
    return found


def _seconds(value: object, field: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0:
            return float(value)
        raise ConfigurationError(f"{field}: {value!r} must be a positive number of seconds or a duration like '50ms'")
    return parse_duration(value, field=field) / 1_000_000


def _duration_us(value: object, field: str) -> int:
    return parse_duration(value, field=field)


def _jitter_us(value: object, field: str) -> int:
    if value in ("0", "0ms", "0s", 0):
        return 0
    return parse_duration(value, field=field)


def _key_prefix(value: object, field: str) -> str:
    prefix = value if isinstance(value, str) else ""
    if not prefix or "{" in prefix or "}" in prefix or " " in prefix:
        raise ConfigurationError(f"{field}: {value!r} must be a non-empty string without braces or spaces")
    return prefix


def _policy_source(value: object, field: str) -> str:
    name = _text(value, field)
    return POLICY_SOURCES.get(name, name)


def _positive_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{field}: {value!r} must be a positive integer")
    return value


def _optional_positive_int(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{field}: {value!r} must be a positive integer or None")
    return value


def _share(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigurationError(f"{field}: {value!r} must be a number in (0, 1]")
    return float(value)


def _boolean(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{field}: {value!r} must be True or False")
    return value


def _mapping(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ConfigurationError(f"{field}: expected a dict with string keys, got {value!r}")
    return dict(value)


def _tiers(value: object, field: str) -> dict[str, Any]:
    tiers = _mapping(value, field)
    if not tiers:
        raise ConfigurationError(f"{field} must be a non-empty dict of tier name to policy")
    return tiers


def _default_tiers(value: object, field: str) -> dict[str, str]:
    defaults = _mapping(value, field)
    unknown = set(defaults) - {"anonymous", "authenticated"}
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}; use anonymous and authenticated")
    for kind, name in defaults.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{field}['{kind}']: {name!r} must be a tier name")
    return cast(dict[str, str], defaults)


def _dimensions(value: object, field: str) -> dict[str, Any]:
    dimensions = _mapping(value, field)
    for kind in dimensions:
        if kind not in DIMENSION_KINDS:
            raise ConfigurationError(f"{field}: {kind!r} must be one of {', '.join(DIMENSION_KINDS)}")
    return dimensions


def _exempt_endpoints(value: object, field: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigurationError(f"{field} must be a list of endpoint names")
    for name in value:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f"{field}: {name!r} must be an endpoint name")
    return tuple(name.strip() for name in value)


def _thresholds(value: object, field: str) -> dict[Priority, int]:
    names = {p.value for p in SHEDDABLE}
    if not isinstance(value, Mapping) or set(value) - names:
        raise ConfigurationError(f"{field} must be a dict with keys low, normal and high (critical is never shed)")
    thresholds = {}
    for priority in SHEDDABLE:
        percent = value.get(priority.value, 100)
        if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 100:
            raise ConfigurationError(f"{field}['{priority}']: {percent!r} must be a percentage from 1 to 100")
        thresholds[priority] = percent
    if not thresholds[Priority.LOW] <= thresholds[Priority.NORMAL] <= thresholds[Priority.HIGH]:
        raise ConfigurationError(f"{field}: thresholds must rise with priority (low <= normal <= high)")
    return thresholds


def _callable(value: object, field: str) -> Callable[..., Any]:
    if callable(value):
        return value
    try:
        found = import_string(_text(value, field))
    except ImportError as exc:
        raise ConfigurationError(f"{field}: cannot import {value!r}: {exc}") from exc
    if not callable(found):
        raise ConfigurationError(f"{field}: {value!r} is not callable")
    return cast(Callable[..., Any], found)


def _optional_callable(value: object, field: str) -> Callable[..., Any] | None:
    return None if value is None else _callable(value, field)


def _model(value: object, field: str) -> type[Model] | None:
    if value is None:
        return None
    try:
        return apps.get_model(_text(value, field))
    except (LookupError, ValueError) as exc:
        raise ConfigurationError(f"{field}: {value!r} is not an installed model ({exc})") from None


def _networks(value: object, field: str) -> tuple[IPNetwork, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigurationError(f"{field} must be a list of addresses or networks")
    networks = []
    for item in value:
        try:
            networks.append(ipaddress.ip_network(str(item), strict=False))
        except ValueError:
            raise ConfigurationError(f"{field}: {item!r} is not an IP address or network") from None
    return tuple(networks)


_META_KEY = re.compile(r"[A-Z][A-Z0-9_]*", re.ASCII)


def _meta_key(value: object, field: str) -> str:
    if not isinstance(value, str) or not _META_KEY.fullmatch(value):
        raise ConfigurationError(
            f"{field}: {value!r} must be a request.META key such as 'HTTP_X_FORWARDED_FOR' (upper case, underscores)"
        )
    return value


def _ipv6_prefix(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 128:
        raise ConfigurationError(f"{field}: {value!r} must be an integer from 1 to 128")
    return value


def _hash_key(value: object, field: str) -> bytes:
    if value is not None and not isinstance(value, (str, bytes)):
        raise ConfigurationError(f"{field}: {value!r} must be a string, or None to use SECRET_KEY")
    # str() of bytes too, and an empty key means SECRET_KEY: as 0.1 derived it, so keys keep their names.
    secret = value or settings.SECRET_KEY
    return hashlib.blake2b(str(secret).encode(), digest_size=32, person=b"ratelimits").digest()


class FailedAuthLimit(NamedTuple):
    """``FAILED_AUTH``: failed authentications allowed per client IP and per credential prefix."""

    rate: Rate
    burst: int
    #: Leading characters of a presented credential counted together (0, the default: IPs only).
    prefix_length: int


def _failed_auth(value: object, field: str) -> FailedAuthLimit | None:
    if value is None:
        return None
    config = _mapping(value, field)
    unknown = set(config) - {"rate", "burst", "prefix_length"}
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}; use rate, burst, prefix_length")
    if "rate" not in config:
        raise ConfigurationError(f"{field}: 'rate' is required, e.g. {{'rate': '10/m', 'burst': 20}}")
    rate = parse_rate(config["rate"], field=f"{field}['rate']")
    burst = check_burst(rate, config.get("burst", rate.limit), field=f"{field}['burst']")
    # Off unless asked for: the prefix must tell one credential from others (a key's public id);
    # every HS256 JWT starts with the same 12 characters.
    length = config.get("prefix_length", 0)
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= 200:
        raise ConfigurationError(f"{field}['prefix_length']: {length!r} must be an integer from 0 to 200")
    return FailedAuthLimit(rate, burst, length)


class LocalPathSettings(NamedTuple):
    """``LOCAL_PATH``: what each worker answers without the store (:mod:`ratelimits.engine.local`)."""

    #: Refuse from memory a check the store denied, until its wait has passed (exact).
    denials: bool = True
    #: Lease tokens of busy token buckets in the decide call and spend them here.
    leases: bool = False
    #: How long a lease is spent before its unused tokens go back (seconds, at most 1).
    lease_ttl: float = 0.5
    #: The most of a limit's capacity (a bucket's burst, a window's limit) one lease takes.
    lease_share: float = 0.1
    #: The most denials one worker remembers (and credentials, and keys whose rate it counts).
    max_entries: int = 10_000
    #: Send ``X-RateLimit-Local`` on responses decided from memory (and log them at DEBUG).
    header: bool = False


def _fields_of(value: object, field: str, known: Sequence[str]) -> dict[str, Any]:
    """``value`` as a dict of the settings group whose keys are ``known`` (an unknown one is an error)."""
    config = _mapping(value, field)
    unknown = set(config) - set(known)
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}; use {', '.join(known)}")
    return config


def _local_path(value: object, field: str) -> LocalPathSettings:
    config = _fields_of(value, field, LocalPathSettings._fields)
    defaults = LocalPathSettings()
    ttl = _seconds(config.get("lease_ttl", defaults.lease_ttl), f"{field}['lease_ttl']")
    if ttl > 1:
        raise ConfigurationError(
            f"{field}['lease_ttl']: {config['lease_ttl']!r} is longer than the 1 s a lease may last"
        )
    return LocalPathSettings(
        denials=_boolean(config.get("denials", defaults.denials), f"{field}['denials']"),
        leases=_boolean(config.get("leases", defaults.leases), f"{field}['leases']"),
        lease_ttl=ttl,
        lease_share=_share(config.get("lease_share", defaults.lease_share), f"{field}['lease_share']"),
        max_entries=_positive_int(config.get("max_entries", defaults.max_entries), f"{field}['max_entries']"),
        header=_boolean(config.get("header", defaults.header), f"{field}['header']"),
    )


class MetricsSettings(NamedTuple):
    """``METRICS``: Prometheus metrics of the engine's decisions (:mod:`ratelimits.metrics`)."""

    #: Whether prometheus-client's multiprocess mode is on: ``PROMETHEUS_MULTIPROC_DIR`` is set.
    multiprocess: bool = False
    #: Seconds between two additions of the request path's counts to prometheus-client's metrics.
    flush_interval: float = 1.0
    #: Whether ``multiprocess`` was given (``False``: one process serves, so nothing to warn about).
    declared: bool = False


#: prometheus-client's multiprocess directory, read from the environment as prometheus-client reads it.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _metrics(value: object, field: str) -> MetricsSettings | None:
    if value is None or value is False:
        return None
    config = {} if value is True else _fields_of(value, field, ("multiprocess", "flush_interval"))
    import importlib.util

    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigurationError(f"{field}: metrics need prometheus-client; install ratelimits[metrics]")
    directory = os.environ.get(MULTIPROC_ENV, "")
    wanted = config.get("multiprocess")
    if wanted is not None:
        _boolean(wanted, f"{field}['multiprocess']")
    if wanted and not directory:
        raise ConfigurationError(
            f"{field}['multiprocess']: True, but {MULTIPROC_ENV} is not set; set it to an empty directory "
            "before the server starts (docs/metrics.md)"
        )
    if directory and wanted is not False and not os.path.isdir(directory):
        raise ConfigurationError(f"{field}: {MULTIPROC_ENV}={directory!r} is not a directory")
    interval = _seconds(config.get("flush_interval", MetricsSettings().flush_interval), f"{field}['flush_interval']")
    if interval > 60:
        raise ConfigurationError(f"{field}['flush_interval']: {interval:g} s is longer than a minute")
    return MetricsSettings(bool(directory) and wanted is not False, interval, declared=wanted is not None)


class AdaptiveSettings(NamedTuple):
    """``ADAPTIVE_CAPACITY``: how the worker shedder's capacity follows latency and errors (docs/adaptive.md)."""

    #: The least capacity it is lowered to (``None``: a quarter of ``WORKER_CAPACITY``, at least 1).
    floor: int | None = None
    #: How much slower than its usual latency an endpoint may answer before the capacity is lowered.
    tolerance: float = 1.5
    #: Seconds of responses each adjustment is made from.
    window: float = 0.5
    #: The fewest responses of an endpoint in a window for its latency to count.
    min_samples: int = 5
    #: The share of 5xx responses (and timeouts) above its usual share that lowers the capacity.
    error_rate: float = 0.05
    #: A response slower than this (seconds) counts as an error, a timeout; ``None``: none does.
    timeout: float | None = None
    #: Seconds after a cut during which the capacity stays below the level it was cut at.
    probe_interval: float = 60.0


def _adaptive(value: object, field: str) -> AdaptiveSettings | None:
    if value is None:
        return None
    config = _fields_of(value, field, AdaptiveSettings._fields)
    defaults = AdaptiveSettings()
    floor = config.get("floor", defaults.floor)
    tolerance = config.get("tolerance", defaults.tolerance)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 1 < tolerance <= 10:
        raise ConfigurationError(f"{field}['tolerance']: {tolerance!r} must be a number above 1 and at most 10")
    timeout = config.get("timeout", defaults.timeout)
    return AdaptiveSettings(
        floor=None if floor is None else _positive_int(floor, f"{field}['floor']"),
        tolerance=float(tolerance),
        window=_seconds(config.get("window", defaults.window), f"{field}['window']"),
        min_samples=_positive_int(config.get("min_samples", defaults.min_samples), f"{field}['min_samples']"),
        error_rate=_share(config.get("error_rate", defaults.error_rate), f"{field}['error_rate']"),
        timeout=None if timeout is None else _seconds(timeout, f"{field}['timeout']"),
        probe_interval=_seconds(config.get("probe_interval", defaults.probe_interval), f"{field}['probe_interval']"),
    )


#: A region's name: it appears in settings, the admin and logs, never in keys.
_REGION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,50}", re.ASCII)


def _region(value: object, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REGION_NAME.fullmatch(value):
        raise ConfigurationError(f"{field}: {value!r} must be a region name matching {_REGION_NAME.pattern}")
    return value


def _regions(value: object, field: str) -> dict[str, str]:
    """``{name: {"REDIS_URL": url}}``: every region, and where the reconciler reaches its store."""
    regions = {}
    for name, config in _mapping(value, field).items():
        _region(name, f"{field} key")
        entry = _mapping(config, f"{field}[{name!r}]")
        unknown = set(entry) - {"REDIS_URL"}
        if unknown:
            raise ConfigurationError(f"{field}[{name!r}]: unknown keys {', '.join(sorted(unknown))}; use REDIS_URL")
        if "REDIS_URL" not in entry:
            raise ConfigurationError(f"{field}[{name!r}]: 'REDIS_URL' is required")
        regions[name] = _redis_url(entry["REDIS_URL"], f"{field}[{name!r}]['REDIS_URL']")
    return dict(sorted(regions.items()))  # sorted: every process numbers the regions alike


class ReconcileSettings(NamedTuple):
    """``RECONCILE``: how the reconciler moves global policies' shares (docs/regions.md)."""

    #: Seconds between rounds (the beat schedule's; the demo's ``project/celery.py`` reads it).
    interval: float = 1.0
    #: The least share of a global limit a reachable region is given while others are busy, so a
    #: quiet region can still serve a first request (at most the even split; choose it so that
    #: ``floor x burst`` is at least one request's cost).
    floor: float = 0.05
    #: A share above the even split not written for this long (the reconciler cannot reach its
    #: region, or has stopped) starts to decay down to it; a share below it never rises unwritten.
    stale_after: float = 10.0
    #: Seconds a stale share takes to decay linearly down to the even split (1 / the number of regions).
    decay: float = 30.0


def _reconcile(value: object, field: str) -> ReconcileSettings:
    config = _fields_of(value, field, ReconcileSettings._fields)
    defaults = ReconcileSettings()
    floor = config.get("floor", defaults.floor)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor < 0.5:
        raise ConfigurationError(f"{field}['floor']: {floor!r} must be a share above 0 and below 0.5")
    return ReconcileSettings(
        interval=_seconds(config.get("interval", defaults.interval), f"{field}['interval']"),
        floor=float(floor),
        stale_after=_seconds(config.get("stale_after", defaults.stale_after), f"{field}['stale_after']"),
        decay=_seconds(config.get("decay", defaults.decay), f"{field}['decay']"),
    )


def _fail_mode(value: object, field: str) -> FailMode:
    return FailMode.parse(value, field=field)


#: The units a size may be written in (``"10MB"``): multiples of 1024, as file sizes are counted.
SIZE_UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
_SIZE = re.compile(r"(?P<count>[0-9]+)(?P<unit>[a-z]+)", re.ASCII)


def _size(value: object, field: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if match is None or match["unit"] not in SIZE_UNITS or int(match["count"]) == 0:
        raise ConfigurationError(
            f"{field}: {value!r} must be a number of bytes or a size like '10MB' (B, KB, MB or GB, multiples of 1024)"
        )
    return int(match["count"]) * SIZE_UNITS[match["unit"]]


# -- the settings -------------------------------------------------------------------------------

ENABLED = Setting("ENABLED", True, _boolean)
BACKEND = Setting("BACKEND", "memory", _text)
REDIS_URL = Setting("REDIS_URL", "redis://127.0.0.1:6379/0", _redis_url)
REDIS_SOCKET_TIMEOUT = Setting("REDIS_SOCKET_TIMEOUT", "50ms", _seconds)
REDIS_CONNECT_TIMEOUT = Setting("REDIS_CONNECT_TIMEOUT", "50ms", _seconds)
REDIS_OPTIONS = Setting("REDIS_OPTIONS", {}, _redis_options)
REDIS_CLIENT = Setting("REDIS_CLIENT", None, _redis_client)
KEY_PREFIX = Setting("KEY_PREFIX", "rl", _key_prefix)
CLOCK = Setting("CLOCK", "redis", _choice(("redis", "app")))
POLICY_SOURCE = Setting("POLICY_SOURCE", "settings", _policy_source)
POLICY_POLL_INTERVAL = Setting("POLICY_POLL_INTERVAL", "5s", _seconds)
POLICY_RECHECK_INTERVAL = Setting("POLICY_RECHECK_INTERVAL", "60s", _seconds)
POLICY_LOAD_TIMEOUT = Setting("POLICY_LOAD_TIMEOUT", "100ms", _seconds)
FAILED_AUTH = Setting("FAILED_AUTH", None, _failed_auth)
TIERS = Setting(
    "TIERS",
    {"anonymous": {"rate": "20/s", "burst": 40}, "authenticated": {"rate": "100/s", "burst": 200}},
    _tiers,
)
DEFAULT_TIERS = Setting("DEFAULT_TIERS", {"anonymous": "anonymous", "authenticated": "authenticated"}, _default_tiers)
TIER_FUNC = Setting("TIER_FUNC", None, _optional_callable)
DIMENSIONS = Setting("DIMENSIONS", {}, _dimensions)
SLOT_TTL = Setting("SLOT_TTL", "60s", _duration_us)
FLEET_CAPACITY = Setting("FLEET_CAPACITY", None, _optional_positive_int)
FLEET_SHARDS = Setting("FLEET_SHARDS", 1, _positive_int)
SHED_THRESHOLDS = Setting("SHED_THRESHOLDS", {"low": 60, "normal": 75, "high": 90}, _thresholds)
WORKER_CAPACITY = Setting("WORKER_CAPACITY", None, _optional_positive_int)
ADAPTIVE_CAPACITY = Setting("ADAPTIVE_CAPACITY", None, _adaptive)
USAGE = Setting("USAGE", True, _boolean)
USAGE_MAX_SUBJECTS = Setting("USAGE_MAX_SUBJECTS", 50_000, _positive_int)
ENDPOINTS = Setting("ENDPOINTS", {}, _mapping)
EXEMPT_ENDPOINTS = Setting("EXEMPT_ENDPOINTS", [], _exempt_endpoints)
API_KEY_FUNC = Setting("API_KEY_FUNC", "ratelimits.identity.default_api_key", _callable)
API_KEY_MODEL = Setting("API_KEY_MODEL", None, _model)
ORGANIZATION_FUNC = Setting("ORGANIZATION_FUNC", "ratelimits.identity.no_organization", _callable)
TRUSTED_PROXIES = Setting("TRUSTED_PROXIES", [], _networks)
CLIENT_IP_HEADER = Setting("CLIENT_IP_HEADER", "HTTP_X_FORWARDED_FOR", _meta_key)
IPV6_PREFIX = Setting("IPV6_PREFIX", 64, _ipv6_prefix)
HASH_KEY = Setting("HASH_KEY", None, _hash_key)
HEADERS = Setting("HEADERS", "both", _choice(HEADER_STYLES))
HEADER_POLICIES = Setting("HEADER_POLICIES", "all", _choice(HEADER_POLICY_CHOICES))
HEADER_PARTITION_KEY = Setting("HEADER_PARTITION_KEY", False, _boolean)
RETRY_AFTER_JITTER = Setting("RETRY_AFTER_JITTER", "0ms", _jitter_us)
DEFAULT_FAIL_MODE = Setting("DEFAULT_FAIL_MODE", "open", _fail_mode)
LOCAL_FALLBACK_SHARE = Setting("LOCAL_FALLBACK_SHARE", 1.0, _share)
LOCAL_PATH = Setting("LOCAL_PATH", {}, _local_path)
BREAKER_WINDOW = Setting("BREAKER_WINDOW", 20, _positive_int)
BREAKER_MIN_CALLS = Setting("BREAKER_MIN_CALLS", 5, _positive_int)
BREAKER_FAILURE_RATE = Setting("BREAKER_FAILURE_RATE", 0.5, _share)
BREAKER_COOLDOWN = Setting("BREAKER_COOLDOWN", "2s", _seconds)
IMPORT_MAX_SIZE = Setting("IMPORT_MAX_SIZE", "10MB", _size)
REGION = Setting("REGION", None, _region)
REGIONS = Setting("REGIONS", {}, _regions)
RECONCILE = Setting("RECONCILE", {}, _reconcile)
METRICS = Setting("METRICS", False, _metrics)

#: Every setting, by name, in the order docs/configuration.md lists them.
SETTINGS: dict[str, Setting[Any]] = {
    s.name: s
    for s in (
        ENABLED,
        BACKEND,
        REDIS_URL,
        REDIS_SOCKET_TIMEOUT,
        REDIS_CONNECT_TIMEOUT,
        REDIS_OPTIONS,
        REDIS_CLIENT,
        KEY_PREFIX,
        CLOCK,
        POLICY_SOURCE,
        POLICY_POLL_INTERVAL,
        POLICY_RECHECK_INTERVAL,
        POLICY_LOAD_TIMEOUT,
        TIERS,
        DEFAULT_TIERS,
        TIER_FUNC,
        DIMENSIONS,
        SLOT_TTL,
        FLEET_CAPACITY,
        FLEET_SHARDS,
        SHED_THRESHOLDS,
        WORKER_CAPACITY,
        ADAPTIVE_CAPACITY,
        USAGE,
        USAGE_MAX_SUBJECTS,
        ENDPOINTS,
        EXEMPT_ENDPOINTS,
        API_KEY_FUNC,
        API_KEY_MODEL,
        ORGANIZATION_FUNC,
        TRUSTED_PROXIES,
        CLIENT_IP_HEADER,
        IPV6_PREFIX,
        HASH_KEY,
        HEADERS,
        HEADER_POLICIES,
        HEADER_PARTITION_KEY,
        RETRY_AFTER_JITTER,
        DEFAULT_FAIL_MODE,
        LOCAL_FALLBACK_SHARE,
        LOCAL_PATH,
        BREAKER_WINDOW,
        BREAKER_MIN_CALLS,
        BREAKER_FAILURE_RATE,
        BREAKER_COOLDOWN,
        FAILED_AUTH,
        IMPORT_MAX_SIZE,
        REGION,
        REGIONS,
        RECONCILE,
        METRICS,
    )
}


class Settings:
    """Typed, validated, cached access to ``settings.RATELIMITS``."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    def clear(self) -> None:
        self._cache.clear()
        # The typed attributes below are cached in the instance on first read (a decision reads
        # a dozen of them: a plain attribute costs a twentieth of a method call).
        for name in [name for name in vars(self) if name != "_cache"]:
            self.__dict__.pop(name, None)

    @property
    def user_settings(self) -> Mapping[str, Any]:
        """``settings.RATELIMITS`` as the project wrote it (a dict, or a :class:`ConfigurationError`)."""
        value = getattr(settings, "RATELIMITS", {})
        if not isinstance(value, dict):
            raise ConfigurationError(f"RATELIMITS must be a dict, got {type(value).__name__}")
        return value

    def is_set(self, setting: Setting[Any]) -> bool:
        """Whether the project sets ``setting`` itself (rather than relying on its default)."""
        return setting.name in self.user_settings

    def value(self, setting: Setting[T]) -> T:
        """The parsed value of ``setting``; raises :class:`ConfigurationError` naming it if invalid."""
        try:
            return cast(T, self._cache[setting.name])
        except KeyError:
            pass
        parsed = self._cache[setting.name] = setting.parse(self.user_settings.get(setting.name, setting.default))
        return parsed

    # One typed attribute per setting (docs/configuration.md says what each is for), parsed on first
    # read and kept until clear().

    @cached_property
    def enabled(self) -> bool:
        """``ENABLED``: ``False`` admits every request without asking the store (a project's own test suite)."""
        return self.value(ENABLED)

    @cached_property
    def backend(self) -> str:
        return self.value(BACKEND)

    @cached_property
    def redis_url(self) -> str:
        return self.value(REDIS_URL)

    @cached_property
    def redis_socket_timeout(self) -> float:
        return self.value(REDIS_SOCKET_TIMEOUT)

    @cached_property
    def redis_connect_timeout(self) -> float:
        return self.value(REDIS_CONNECT_TIMEOUT)

    @cached_property
    def redis_options(self) -> dict[str, Any]:
        """``REDIS_OPTIONS``: credentials and TLS files added to what ``REDIS_URL`` says."""
        return self.value(REDIS_OPTIONS)

    @cached_property
    def redis_client(self) -> redis.Redis | redis.RedisCluster | None:
        """``REDIS_CLIENT``: a client the project built, used instead of one made from ``REDIS_URL``."""
        return self.value(REDIS_CLIENT)

    @cached_property
    def key_prefix(self) -> str:
        return self.value(KEY_PREFIX)

    @cached_property
    def use_redis_time(self) -> bool:
        """``CLOCK``: whether decisions read Redis ``TIME`` (else the app passes its clock)."""
        return self.value(CLOCK) == "redis"

    @cached_property
    def policy_source(self) -> str:
        """``POLICY_SOURCE`` as a dotted path (the short names resolved)."""
        return self.value(POLICY_SOURCE)

    @cached_property
    def policy_poll_interval(self) -> float:
        return self.value(POLICY_POLL_INTERVAL)

    @cached_property
    def policy_recheck_interval(self) -> float:
        return self.value(POLICY_RECHECK_INTERVAL)

    @cached_property
    def policy_load_timeout(self) -> float:
        return self.value(POLICY_LOAD_TIMEOUT)

    @cached_property
    def tiers(self) -> dict[str, Any]:
        return self.value(TIERS)

    @cached_property
    def default_tiers(self) -> dict[str, str]:
        return self.value(DEFAULT_TIERS)

    @cached_property
    def tier_func(self) -> Callable[..., str | None] | None:
        return self.value(TIER_FUNC)

    @cached_property
    def dimensions(self) -> dict[str, Any]:
        return self.value(DIMENSIONS)

    @cached_property
    def slot_ttl_us(self) -> int:
        return self.value(SLOT_TTL)

    @cached_property
    def fleet_capacity(self) -> int | None:
        return self.value(FLEET_CAPACITY)

    @cached_property
    def fleet_shards(self) -> int:
        """``FLEET_SHARDS``: how many keys the fleet's in-flight set is split over (hot-key sharding)."""
        return self.value(FLEET_SHARDS)

    @cached_property
    def shed_thresholds(self) -> dict[Priority, int]:
        return self.value(SHED_THRESHOLDS)

    @cached_property
    def worker_capacity(self) -> int | None:
        return self.value(WORKER_CAPACITY)

    @cached_property
    def adaptive_capacity(self) -> AdaptiveSettings | None:
        """``ADAPTIVE_CAPACITY``, with its floor filled in; it needs ``WORKER_CAPACITY`` (its ceiling)."""
        adaptive = self.value(ADAPTIVE_CAPACITY)
        if adaptive is None:
            return None
        ceiling = self.worker_capacity
        if ceiling is None:
            raise ConfigurationError(
                "RATELIMITS['ADAPTIVE_CAPACITY'] adapts the worker shedder's capacity: set "
                "RATELIMITS['WORKER_CAPACITY'] too (the most it may reach)",
                setting="ADAPTIVE_CAPACITY",
            )
        floor = adaptive.floor if adaptive.floor is not None else max(ceiling // 4, 1)
        if floor > ceiling:
            raise ConfigurationError(
                f"RATELIMITS['ADAPTIVE_CAPACITY']['floor']: {floor} is above RATELIMITS['WORKER_CAPACITY'] ({ceiling})",
                setting="ADAPTIVE_CAPACITY",
            )
        return adaptive._replace(floor=floor)

    @cached_property
    def usage_counting(self) -> bool:
        return self.value(USAGE)

    @cached_property
    def usage_max_subjects(self) -> int:
        """``USAGE_MAX_SUBJECTS``: the most rows (a caller on an endpoint) one minute of usage counts."""
        return self.value(USAGE_MAX_SUBJECTS)

    @cached_property
    def endpoints(self) -> dict[str, Any]:
        return self.value(ENDPOINTS)

    @cached_property
    def exempt_endpoints(self) -> tuple[str, ...]:
        return self.value(EXEMPT_ENDPOINTS)

    @cached_property
    def api_key_func(self) -> Callable[[Any], str | None]:
        return self.value(API_KEY_FUNC)

    @cached_property
    def api_key_model(self) -> type[Model] | None:
        return self.value(API_KEY_MODEL)

    @cached_property
    def organization_func(self) -> Callable[[Any], str | None]:
        return self.value(ORGANIZATION_FUNC)

    @cached_property
    def trusted_proxies(self) -> tuple[IPNetwork, ...]:
        return self.value(TRUSTED_PROXIES)

    @cached_property
    def client_ip_header(self) -> str:
        return self.value(CLIENT_IP_HEADER)

    @cached_property
    def ipv6_prefix(self) -> int:
        return self.value(IPV6_PREFIX)

    @cached_property
    def hash_key(self) -> bytes:
        return self.value(HASH_KEY)

    @cached_property
    def headers(self) -> str:
        return self.value(HEADERS)

    @cached_property
    def header_policies(self) -> str:
        return self.value(HEADER_POLICIES)

    @cached_property
    def header_partition_key(self) -> bool:
        return self.value(HEADER_PARTITION_KEY)

    @cached_property
    def retry_after_jitter_us(self) -> int:
        return self.value(RETRY_AFTER_JITTER)

    @cached_property
    def default_fail_mode(self) -> FailMode:
        return self.value(DEFAULT_FAIL_MODE)

    @cached_property
    def local_fallback_share(self) -> float:
        return self.value(LOCAL_FALLBACK_SHARE)

    @cached_property
    def local_path(self) -> LocalPathSettings:
        return self.value(LOCAL_PATH)

    @cached_property
    def failed_auth(self) -> FailedAuthLimit | None:
        return self.value(FAILED_AUTH)

    @cached_property
    def breaker(self) -> dict[str, Any]:
        """The circuit breaker's arguments (``BREAKER_*``)."""
        window = self.value(BREAKER_WINDOW)
        return {
            "window": window,
            "min_calls": min(self.value(BREAKER_MIN_CALLS), window),
            "failure_rate": self.value(BREAKER_FAILURE_RATE),
            "cooldown": self.value(BREAKER_COOLDOWN),
        }

    @cached_property
    def import_max_size(self) -> int:
        """The largest document ``ratelimits_import`` reads, in bytes."""
        return self.value(IMPORT_MAX_SIZE)

    @cached_property
    def regions(self) -> dict[str, str]:
        """Every region's store URL by name, sorted by name (``REGIONS``); empty in a one-region deployment."""
        return self.value(REGIONS)

    @cached_property
    def region(self) -> str | None:
        """This deployment's region (``REGION``): one of ``REGIONS``, or ``None`` without regions."""
        region = self.value(REGION)
        regions = self.regions
        if region is None and regions:
            raise ConfigurationError(
                "RATELIMITS['REGION'] must name this deployment's region: RATELIMITS['REGIONS'] is set",
                setting="REGION",
            )
        if region is not None and region not in regions:
            names = ", ".join(regions) or "none: set REGIONS"
            raise ConfigurationError(
                f"RATELIMITS['REGION']: {region!r} is not one of RATELIMITS['REGIONS'] ({names})", setting="REGION"
            )
        return region

    @cached_property
    def region_count(self) -> int:
        """How many regions share a global policy's limit (1 without ``REGIONS``)."""
        return max(len(self.regions), 1)

    @cached_property
    def reconcile(self) -> ReconcileSettings:
        return self.value(RECONCILE)

    @cached_property
    def metrics(self) -> MetricsSettings | None:
        """``None`` when metrics are off."""
        return self.value(METRICS)


conf = Settings()


class ProcessWide(Generic[T]):
    """One value per process built from the settings on first use, and built again after they change.

    The backend, the policy source, the limiter and the worker shedder are each one of these:
    shared by every thread of the process, cheap to read, and rebuilt on the next use after a
    ``setting_changed`` signal for ``RATELIMITS`` (``override_settings`` in tests).
    """

    _all: weakref.WeakSet[ProcessWide[Any]] = weakref.WeakSet()

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        #: ``(value,)`` once built: a value of ``None`` (no worker shedder) is still built.
        self._built: tuple[T] | None = None
        self._lock = threading.Lock()
        ProcessWide._all.add(self)

    def get(self) -> T:
        built = self._built  # one read: a reset between two reads cannot hand out nothing
        if built is None:
            with self._lock:
                built = self._built
                if built is None:
                    built = self._built = (self._build(),)
        return built[0]

    def current(self) -> T | None:
        """The value if it was built, without building it."""
        built = self._built
        return None if built is None else built[0]

    def reset(self) -> None:
        """Forget the value: the next :meth:`get` builds it again."""
        with self._lock:
            self._built = None

    @classmethod
    def reset_all(cls) -> None:
        for value in list(cls._all):
            value.reset()


def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in ("RATELIMITS", "SECRET_KEY"):
        conf.clear()
    if setting == "RATELIMITS":
        ProcessWide.reset_all()


setting_changed.connect(_reset, dispatch_uid="ratelimits.conf.reset")
