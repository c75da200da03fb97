"""The parsers of the settings' values, and the values some of them make for the engine.

Each parser takes ``(value, field)`` and returns the parsed value, or raises a
:class:`ConfigurationError` naming ``field`` (``RATELIMITS['REDIS']['URL']``) and the value.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import redis
from django.apps import apps
from django.conf import settings as django_settings
from django.utils.module_loading import import_string

from ..choices import SHEDDABLE, FailMode, Priority
from ..exceptions import ConfigurationError
from ..rates import Rate, check_burst, parse_duration, parse_rate
from ..redis_url import check_options, parse_redis_url

if TYPE_CHECKING:
    from django.db.models import Model

HEADER_STYLES = ("ietf", "github", "both", "none")
#: What ``RateLimit-Policy`` lists: every enforced policy of the request, or the closest only.
HEADER_POLICY_CHOICES = ("all", "closest")
#: Short names for ``POLICIES['SOURCE']``, like ``BACKEND``'s ``"memory"`` and ``"redis"``.
POLICY_SOURCES = {
    "settings": "ratelimits.policies.SettingsPolicySource",
    "database": "ratelimits.store.database.DatabasePolicySource",
}
#: Paths of a policy source that the docs gave before -> where the class lives now: 0.1's, and the
#: one the docs of this release gave until the policy store had a folder of its own. Read as the new
#: path until 0.3 (``ratelimits.W022`` says so), so no module of the old path is imported.
RETIRED_POLICY_SOURCES = {
    "ratelimits.sources.DatabasePolicySource": POLICY_SOURCES["database"],
    "ratelimits.policies.database.DatabasePolicySource": POLICY_SOURCES["database"],
}
#: The subject kinds ``DIMENSIONS`` may limit.
DIMENSION_KINDS = ("ip", "user", "api_key", "org")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{field}: {value!r} must be a non-empty string")
    return value.strip()


def optional_text(value: object, field: str) -> str | None:
    return None if value is None else text(value, field)


def choice(choices: Sequence[str]) -> Callable[[object, str], str]:
    def parse(value: object, field: str) -> str:
        if value not in choices:
            raise ConfigurationError(f"{field}: {value!r} must be one of {', '.join(map(repr, choices))}")
        return str(value)

    return parse


def redis_url(value: object, field: str) -> str:
    url = text(value, field)
    try:
        parse_redis_url(url)
    except ValueError as exc:
        raise ConfigurationError(f"{field}: {url!r} is not a Redis URL: {exc}") from None
    return url


def redis_options(value: object, field: str) -> dict[str, Any]:
    try:
        return check_options(value, field)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


def redis_client(value: object, field: str) -> redis.Redis | redis.RedisCluster | None:
    """A client the project built: the object an import path names, or what that callable returns.

    A :class:`redis.Redis` (any single server or Sentinel master) or a :class:`redis.RedisCluster`.
    """
    if value is None:
        return None
    clients = (redis.Redis, redis.RedisCluster)
    try:
        found = value if isinstance(value, clients) else import_string(text(value, field))
    except ImportError as exc:
        raise ConfigurationError(f"{field}: cannot import {value!r}: {exc}") from exc
    if callable(found) and not isinstance(found, clients):
        found = found()
    if not isinstance(found, clients):
        raise ConfigurationError(
            f"{field}: {value!r} is not a redis.Redis or redis.RedisCluster client (nor a function returning one)"
        )
    return found


def cache_alias(value: object, field: str) -> str | None:
    """A ``CACHES`` alias whose Redis the limiter uses; its address is checked when the cache is read."""
    if value is None:
        return None
    alias = text(value, field)
    caches = getattr(django_settings, "CACHES", {}) or {}
    if alias not in caches:
        known = ", ".join(map(repr, caches)) or "none"
        raise ConfigurationError(f"{field}: {alias!r} is not a cache of CACHES (its aliases: {known})")
    return alias


def seconds(value: object, field: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0:
            return float(value)
        raise ConfigurationError(f"{field}: {value!r} must be a positive number of seconds or a duration like '50ms'")
    return parse_duration(value, field=field) / 1_000_000


def optional_seconds(value: object, field: str) -> float | None:
    return None if value is None else seconds(value, field)


#: The longest ``USAGE['FLUSH_EVERY']``: usage is counted by the minute, and what a worker holds
#: is what killing it loses.
FLUSH_EVERY_MAX_S = 60.0


def flush_every(value: object, field: str) -> float | None:
    found = optional_seconds(value, field)
    if found is not None and found > FLUSH_EVERY_MAX_S:
        raise ConfigurationError(
            f"{field}: {value!r} is longer than a minute: usage is counted by the minute, and what a worker "
            "holds is what killing it loses"
        )
    return found


def duration_us(value: object, field: str) -> int:
    return parse_duration(value, field=field)


def jitter_us(value: object, field: str) -> int:
    if value in ("0", "0ms", "0s", 0):
        return 0
    return parse_duration(value, field=field)


def key_prefix(value: object, field: str) -> str:
    prefix = value if isinstance(value, str) else ""
    if not prefix or "{" in prefix or "}" in prefix or " " in prefix:
        raise ConfigurationError(f"{field}: {value!r} must be a non-empty string without braces or spaces")
    return prefix


def policy_source(value: object, field: str) -> str:
    name = text(value, field)
    return POLICY_SOURCES.get(name) or RETIRED_POLICY_SOURCES.get(name, name)


def positive_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{field}: {value!r} must be a positive integer")
    return value


def optional_positive_int(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{field}: {value!r} must be a positive integer or None")
    return value


def percent(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ConfigurationError(f"{field}: {value!r} must be a percentage from 1 to 100")
    return value


def share(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigurationError(f"{field}: {value!r} must be a number in (0, 1]")
    return float(value)


def boolean(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{field}: {value!r} must be True or False")
    return value


def optional_boolean(value: object, field: str) -> bool | None:
    return None if value is None else boolean(value, field)


def mapping(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ConfigurationError(f"{field}: expected a dict with string keys, got {value!r}")
    return dict(value)


def tiers(value: object, field: str) -> dict[str, Any]:
    tiers = mapping(value, field)
    if not tiers:
        raise ConfigurationError(f"{field} must be a non-empty dict of tier name to policy")
    return tiers


def default_tiers(value: object, field: str) -> dict[str, str]:
    defaults = mapping(value, field)
    unknown = set(defaults) - {"anonymous", "authenticated"}
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}; use anonymous and authenticated")
    for kind, name in defaults.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{field}['{kind}']: {name!r} must be a tier name")
    return cast(dict[str, str], defaults)


def dimensions(value: object, field: str) -> dict[str, Any]:
    dimensions = mapping(value, field)
    for kind in dimensions:
        if kind not in DIMENSION_KINDS:
            raise ConfigurationError(f"{field}: {kind!r} must be one of {', '.join(DIMENSION_KINDS)}")
    return dimensions


def exempt_endpoints(value: object, field: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigurationError(f"{field} must be a list of endpoint names")
    for name in value:
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(f"{field}: {name!r} must be an endpoint name")
    return tuple(name.strip() for name in value)


def thresholds(value: object, field: str) -> dict[Priority, int]:
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


def quota_percents(value: object, field: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigurationError(f"{field}: {value!r} must be a list of percentages, such as [80, 100]")
    for percent in value:
        if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 100:
            # Past 100 would be a soft quota's overage, which a decision does not bring back.
            raise ConfigurationError(f"{field}: {percent!r} must be a percentage from 1 to 100")
    return tuple(sorted(set(value)))


def refusal_window(value: object, field: str) -> float:
    found = seconds(value, field)
    if found % 60 or not 60 <= found <= 3600:
        raise ConfigurationError(
            f"{field}: {value!r} must be whole minutes, from one to sixty: refusals are counted by the minute, "
            "and told at most once a clock hour"
        )
    return found


def dotted_callable(value: object, field: str) -> Callable[..., Any]:
    if callable(value):
        return value
    try:
        found = import_string(text(value, field))
    except ImportError as exc:
        raise ConfigurationError(f"{field}: cannot import {value!r}: {exc}") from exc
    if not callable(found):
        raise ConfigurationError(f"{field}: {value!r} is not callable")
    return cast(Callable[..., Any], found)


def optional_dotted_callable(value: object, field: str) -> Callable[..., Any] | None:
    return None if value is None else dotted_callable(value, field)


def model(value: object, field: str) -> type[Model] | None:
    if value is None:
        return None
    try:
        return apps.get_model(text(value, field))
    except (LookupError, ValueError) as exc:
        raise ConfigurationError(f"{field}: {value!r} is not an installed model ({exc})") from None


def networks(value: object, field: str) -> tuple[IPNetwork, ...]:
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


def meta_key(value: object, field: str) -> str:
    if not isinstance(value, str) or not _META_KEY.fullmatch(value):
        raise ConfigurationError(
            f"{field}: {value!r} must be a request.META key such as 'HTTP_X_FORWARDED_FOR' (upper case, underscores)"
        )
    return value


def ipv6_prefix(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 128:
        raise ConfigurationError(f"{field}: {value!r} must be an integer from 1 to 128")
    return value


def hash_key(value: object, field: str) -> bytes:
    if value is not None and not isinstance(value, (str, bytes)):
        raise ConfigurationError(f"{field}: {value!r} must be a string, or None to use SECRET_KEY")
    # str() of bytes too, and an empty key means SECRET_KEY: as 0.1 derived it, so keys keep their names.
    secret = value or django_settings.SECRET_KEY
    return hashlib.blake2b(str(secret).encode(), digest_size=32, person=b"ratelimits").digest()


def fail_mode(value: object, field: str) -> FailMode:
    return FailMode.parse(value, field=field)


#: The units a size may be written in (``"10MB"``): multiples of 1024, as file sizes are counted.
SIZE_UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
_SIZE = re.compile(r"(?P<count>[0-9]+)(?P<unit>[a-z]+)", re.ASCII)


def size(value: object, field: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if match is None or match["unit"] not in SIZE_UNITS or int(match["count"]) == 0:
        raise ConfigurationError(
            f"{field}: {value!r} must be a number of bytes or a size like '10MB' (B, KB, MB or GB, multiples of 1024)"
        )
    return int(match["count"]) * SIZE_UNITS[match["unit"]]


class FailedAuthLimit(NamedTuple):
    """``IDENTITY['FAILED_AUTH']``: failed authentications allowed per client IP and per credential prefix."""

    rate: Rate
    burst: int
    #: Leading characters of a presented credential counted together (0, the default: IPs only).
    prefix_length: int


def failed_auth(value: object, field: str) -> FailedAuthLimit | None:
    if value is None:
        return None
    config = mapping(value, field)
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
    #: Lease tokens in the decide call for requests a worker makes often, and spend them here.
    leases: bool = True
    #: How long a lease is spent before its unused tokens go back (seconds, at most 1).
    lease_ttl: float = 0.5
    #: The most of a limit's capacity (a bucket's burst, a window's limit) one lease takes.
    lease_share: float = 0.25
    #: The most denials one worker remembers (and credentials, and resolutions it counts for leases).
    max_entries: int = 10_000
    #: Send ``X-RateLimit-Local`` on responses decided from memory (and log them at DEBUG).
    header: bool = False


def lease_ttl(value: object, field: str) -> float:
    ttl = seconds(value, field)
    if ttl > 1:
        raise ConfigurationError(f"{field}: {value!r} is longer than the 1 s a lease may last")
    return ttl


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


def flush_interval(value: object, field: str) -> float:
    interval = seconds(value, field)
    if interval > 60:
        raise ConfigurationError(f"{field}: {interval:g} s is longer than a minute")
    return interval


class AdaptiveSettings(NamedTuple):
    """``SHEDDING['ADAPTIVE']``: how the worker shedder's capacity follows latency and errors (docs/adaptive.md)."""

    #: The least capacity it is lowered to (``None``: a quarter of ``SHEDDING['WORKER_CAPACITY']``, at least 1).
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


def tolerance(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 < value <= 10:
        raise ConfigurationError(f"{field}: {value!r} must be a number above 1 and at most 10")
    return float(value)


#: A region's name: it appears in settings, the admin and logs, never in keys.
_REGION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,50}", re.ASCII)


def region(value: object, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REGION_NAME.fullmatch(value):
        raise ConfigurationError(f"{field}: {value!r} must be a region name matching {_REGION_NAME.pattern}")
    return value


def region_stores(value: object, field: str) -> dict[str, str]:
    """``{name: url}``: every region, and where the reconciler reaches its store. 0.1 wrote each
    store as ``{"REDIS_URL": url}``, which is still read."""
    stores = {}
    for name, config in mapping(value, field).items():
        region(name, f"{field} key")
        url = config
        if isinstance(config, Mapping):  # the 0.1 form
            entry = mapping(config, f"{field}[{name!r}]")
            unknown = set(entry) - {"REDIS_URL"}
            if unknown or "REDIS_URL" not in entry:
                raise ConfigurationError(f"{field}[{name!r}]: expected a Redis URL, got {config!r}")
            url = entry["REDIS_URL"]
        stores[name] = redis_url(url, f"{field}[{name!r}]")
    return dict(sorted(stores.items()))  # sorted: every process numbers the regions alike


def share_floor(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 0.5:
        raise ConfigurationError(f"{field}: {value!r} must be a share above 0 and below 0.5")
    return float(value)


class ReconcileSettings(NamedTuple):
    """How the reconciler moves global policies' shares (``REGIONS``; docs/regions.md)."""

    #: Seconds between rounds (the beat schedule's).
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
