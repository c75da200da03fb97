"""Settings of ratelimits: every setting of ``settings.RATELIMITS``, each declared once.

``RATELIMITS`` has fifteen keys: the few most projects set (``BACKEND``, ``TIERS``, ``ENDPOINTS``,
``DIMENSIONS``, ``ENABLED``) and namespaces that group the rest by what they tune (``REDIS``,
``POLICIES``, ``IDENTITY``, ``HEADERS``, ``FAILURE``, ``SHEDDING``, ``USAGE``, ``LOCAL_PATH``,
``REGIONS``, ``METRICS``). Each setting is one :class:`Setting` in its namespace's class below,
which gives its key, default, parser (whose errors name it), check id and documentation line:
the system checks take their ids from here, and docs/configuration.md's tables are generated
from here (``make settings-reference``; a test keeps them current).

Reading a setting on :data:`conf` (``conf.redis.url``) parses the project's value once and keeps
it as a plain attribute until a ``setting_changed`` signal for ``RATELIMITS``
(``override_settings`` in tests), so a request reads a cached value. The system checks
(:mod:`ratelimits.checks`) parse every setting at start-up: a bad value fails ``manage.py check``,
not the first request.

Settings renamed since 0.1 (``REDIS_URL``, ``POLICY_SOURCE``, ``LOCAL_PATH['leases']``...) are
still read under their old names until 0.3, each with a check warning (``ratelimits.W008``)
naming its new place.

Settings that describe policies (``TIERS``, ``ENDPOINTS``, ...) are checked here for their shape;
the checks then build the configured policy source, which checks the contents of those it reads
(rates, costs, references to tiers), and ``DIMENSIONS``, which every source reads.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeVar, cast, overload

import redis
from django.apps import apps
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from . import documentation
from .choices import SHEDDABLE, FailMode, Priority
from .exceptions import ConfigurationError
from .rates import Rate, check_burst, parse_duration, parse_rate
from .redis_url import check_options, parse_redis_url, target_of_cache

if TYPE_CHECKING:
    from django.db.models import Model

__all__ = [
    "HEADER_POLICY_CHOICES",
    "HEADER_STYLES",
    "NAMESPACES",
    "POLICY_SOURCES",
    "SETTINGS",
    "SIZE_UNITS",
    "AdaptiveSettings",
    "FailedAuthLimit",
    "Finding",
    "LocalPathSettings",
    "MetricsSettings",
    "Namespace",
    "ProcessWide",
    "ReconcileSettings",
    "Setting",
    "Settings",
    "conf",
    "field_of",
    "id_of",
    "require_app",
]

T = TypeVar("T")
N = TypeVar("N", bound="Namespace")
#: Where a value lives in ``RATELIMITS``: its keys, outermost first (``("REDIS", "URL")``).
KeyPath = tuple[str, ...]

HEADER_STYLES = ("ietf", "github", "both", "none")
#: What ``RateLimit-Policy`` lists: every enforced policy of the request, or the closest only.
HEADER_POLICY_CHOICES = ("all", "closest")
#: Short names for ``POLICIES['SOURCE']``, like ``BACKEND``'s ``"memory"`` and ``"redis"``.
POLICY_SOURCES = {
    "settings": "ratelimits.policies.SettingsPolicySource",
    "database": "ratelimits.policies.database.DatabasePolicySource",
}
#: The subject kinds ``DIMENSIONS`` may limit.
DIMENSION_KINDS = ("ip", "user", "api_key", "org")
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: The release that stops reading the names settings had in 0.1.
OLD_NAMES_UNTIL = "0.3"


def field_of(path: KeyPath) -> str:
    """How messages name a place in the settings: ``RATELIMITS['REDIS']['URL']``."""
    return "RATELIMITS" + "".join(f"[{key!r}]" for key in path)


#: A key not given in the project's settings.
_MISSING: Any = object()


class Setting(Generic[T]):
    """One setting: its key, default, parser, check id and documentation line.

    Declared as a class attribute of its :class:`Namespace`; read on the namespace's instance
    (``conf.redis.url``), it parses the project's value once and keeps the result in the instance,
    where it is a plain attribute until :meth:`Settings.clear`.
    """

    def __init__(
        self,
        default: Any,
        parser: Callable[[Any, str], T],
        *,
        id: str,
        doc: str,
        old: str | KeyPath | None = None,
        key: str | None = None,
        shown: str | None = None,
        derive: Callable[[Settings], Any] | None = None,
        after: Callable[[Any, T], T] | None = None,
    ) -> None:
        self.default = default
        #: ``(value, field) -> parsed``; raises :class:`ConfigurationError` naming ``field``.
        self.parser = parser
        #: The system check id an invalid value is reported under.
        self.id = id
        #: One line of Markdown for docs/configuration.md.
        self.doc = doc
        #: Where 0.1 read it (a top-level key, or a path): still read there until 0.3.
        self.old: KeyPath | None = (old,) if isinstance(old, str) else old
        self._key = key
        #: The default as docs/configuration.md shows it, when its ``repr`` would not say it well.
        self.shown = shown
        #: A default computed from other settings (``conf`` -> the value to parse) instead of ``default``.
        self.derive = derive
        #: ``(namespace, parsed) -> parsed``: a rule across settings (the namespace gives the others).
        self.after = after
        self.attr = ""
        #: Set when the namespaces are mounted (``_mount``): ``("REDIS", "URL")``, and its namespace.
        self.path: KeyPath = ()
        self.namespace: type[Namespace] | None = None

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @property
    def key(self) -> str:
        """Its key in its namespace: the attribute's name in upper case, unless declared otherwise."""
        return self._key or self.attr.upper()

    @property
    def name(self) -> str:
        """Its path joined by dots (``"REDIS.URL"``): what :attr:`ConfigurationError.setting` carries."""
        return ".".join(self.path)

    @property
    def field(self) -> str:
        return field_of(self.path)

    def parse(self, value: Any) -> T:
        try:
            return self.parser(value, self.field)
        except ConfigurationError as exc:
            raise ConfigurationError(str(exc), setting=self.name) from None

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, instance: Namespace, owner: type) -> T: ...

    def __get__(self, instance: Namespace | None, owner: type) -> Setting[T] | T:
        if instance is None:
            return self
        generation = instance._conf.generation
        value = instance._conf.value(self)
        if self.after is not None:
            try:
                value = self.after(instance, value)
            except ConfigurationError as exc:
                raise ConfigurationError(str(exc), setting=exc.setting or self.name) from None
        if instance._keeps(generation):
            instance.__dict__[self.attr] = value  # a plain attribute from now on, until Settings.clear()
        return value


class Mount(Generic[N]):
    """A namespace inside another (``REDIS`` inside ``RATELIMITS``): read, it is the namespace's instance."""

    def __init__(self, namespace: type[N]) -> None:
        self.namespace = namespace
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @property
    def key(self) -> str:
        return self.attr.upper()

    @overload
    def __get__(self, instance: None, owner: type) -> Mount[N]: ...

    @overload
    def __get__(self, instance: Namespace, owner: type) -> N: ...

    def __get__(self, instance: Namespace | None, owner: type) -> Mount[N] | N:
        if instance is None:
            return self
        generation = instance._conf.generation
        namespace = self.namespace(instance._conf)
        if instance._keeps(generation):
            instance.__dict__[self.attr] = namespace
        return namespace


class Namespace:
    """A group of settings under one key of ``RATELIMITS`` (the root, :class:`Settings`, is ``RATELIMITS``)."""

    #: Its keys (``()`` for the root), set when mounted.
    path: ClassVar[KeyPath] = ()
    #: The attributes that lead to it from :data:`conf` (``("shedding", "adaptive")``), set when mounted.
    attrs: ClassVar[tuple[str, ...]] = ()
    #: The check id a value of the wrong shape is reported under (not a dict, say).
    id: ClassVar[str] = "ratelimits.E003"
    #: One line of Markdown for docs/configuration.md.
    doc: ClassVar[str] = ""
    #: A feature that can be switched off: its value may also be ``True`` (on, with the defaults) or
    #: ``False`` (off); ``switch`` is whether it is on when not given. ``None``: always on.
    switch: ClassVar[bool | None] = None
    #: Where 0.1 turned the feature on (``ADAPTIVE_CAPACITY``): a value there switches it on.
    old: ClassVar[KeyPath | None] = None
    #: The setting 0.1 wrote where the namespace now is (``HEADERS = "both"`` for ``STYLE``): a value
    #: of another shape is read as that setting.
    legacy: ClassVar[str | None] = None
    #: Whether 0.1 wrote that setting as a dict too, so a dict with none of the namespace's keys is
    #: read as it (``REGIONS = {"eu": {...}}``).
    legacy_mapping: ClassVar[bool] = False

    def __init__(self, owner: Settings) -> None:
        self._conf = owner
        #: The settings' generation this instance reads (see :meth:`Settings.clear`).
        self._born = owner.generation if owner is not self else 0

    def _keeps(self, generation: int) -> bool:
        """Whether a value read at ``generation`` may be kept here: the settings have not changed
        since, and this instance is still the one :data:`conf` reads."""
        return self._conf.generation == generation == self._born

    @classmethod
    def declared(cls) -> Iterator[Setting[Any]]:
        """Its own settings, in the order they are declared."""
        for value in vars(cls).values():
            if isinstance(value, Setting):
                yield value

    @classmethod
    def namespaces(cls) -> Iterator[type[Namespace]]:
        """The namespaces inside it, in the order they are declared."""
        for value in vars(cls).values():
            if isinstance(value, Mount):
                yield value.namespace

    @classmethod
    def keys(cls) -> set[str]:
        return {s.key for s in cls.declared()} | {n.path[-1] for n in cls.namespaces()}

    @classmethod
    def name(cls) -> str:
        return ".".join(cls.path)

    @classmethod
    def field(cls) -> str:
        return field_of(cls.path)

    @classmethod
    def _mount(cls, path: KeyPath, attrs: tuple[str, ...]) -> None:
        cls.path, cls.attrs = path, attrs
        for setting in cls.declared():
            setting.path = (*path, setting.key)
            setting.namespace = cls
        for value in vars(cls).values():
            if isinstance(value, Mount):
                value.namespace._mount((*path, value.key), (*attrs, value.attr))

    def values(self) -> dict[str, Any]:
        """Every setting of this namespace, parsed, by attribute name."""
        return {setting.attr: getattr(self, setting.attr) for setting in self.declared()}


class Switchable(Namespace):
    """A feature that can be switched off: ``True`` (on, with its defaults), ``False``, or a dict (on)."""

    switch: ClassVar[bool | None] = False

    @cached_property
    def enabled(self) -> bool:
        """Whether the feature is on."""
        return self._conf.switched_on(type(self))


@dataclass(frozen=True, slots=True)
class Finding:
    """What :meth:`Settings.findings` tells the checks about how ``RATELIMITS`` is written."""

    #: ``"unknown"`` (a key that is no setting), ``"renamed"`` (a 0.1 name) or ``"both"`` (old and new).
    kind: str
    message: str
    hint: str | None = None


# -- parsers: (value, field) -> parsed value ----------------------------------------------------


def _text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{field}: {value!r} must be a non-empty string")
    return value.strip()


def _optional_text(value: object, field: str) -> str | None:
    return None if value is None else _text(value, field)


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


def _cache_alias(value: object, field: str) -> str | None:
    """A ``CACHES`` alias whose Redis the limiter uses; its address is checked when the cache is read."""
    if value is None:
        return None
    alias = _text(value, field)
    caches = getattr(django_settings, "CACHES", {}) or {}
    if alias not in caches:
        known = ", ".join(map(repr, caches)) or "none"
        raise ConfigurationError(f"{field}: {alias!r} is not a cache of CACHES (its aliases: {known})")
    return alias


def _seconds(value: object, field: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0:
            return float(value)
        raise ConfigurationError(f"{field}: {value!r} must be a positive number of seconds or a duration like '50ms'")
    return parse_duration(value, field=field) / 1_000_000


def _optional_seconds(value: object, field: str) -> float | None:
    return None if value is None else _seconds(value, field)


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


def _optional_boolean(value: object, field: str) -> bool | None:
    return None if value is None else _boolean(value, field)


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
    secret = value or django_settings.SECRET_KEY
    return hashlib.blake2b(str(secret).encode(), digest_size=32, person=b"ratelimits").digest()


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


class FailedAuthLimit(NamedTuple):
    """``IDENTITY['FAILED_AUTH']``: failed authentications allowed per client IP and per credential prefix."""

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


def _lease_ttl(value: object, field: str) -> float:
    ttl = _seconds(value, field)
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


def _flush_interval(value: object, field: str) -> float:
    interval = _seconds(value, field)
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


def _tolerance(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 < value <= 10:
        raise ConfigurationError(f"{field}: {value!r} must be a number above 1 and at most 10")
    return float(value)


#: A region's name: it appears in settings, the admin and logs, never in keys.
_REGION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,50}", re.ASCII)


def _region(value: object, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REGION_NAME.fullmatch(value):
        raise ConfigurationError(f"{field}: {value!r} must be a region name matching {_REGION_NAME.pattern}")
    return value


def _region_stores(value: object, field: str) -> dict[str, str]:
    """``{name: url}``: every region, and where the reconciler reaches its store. 0.1 wrote each
    store as ``{"REDIS_URL": url}``, which is still read."""
    stores = {}
    for name, config in _mapping(value, field).items():
        _region(name, f"{field} key")
        url = config
        if isinstance(config, Mapping):  # the 0.1 form
            entry = _mapping(config, f"{field}[{name!r}]")
            unknown = set(entry) - {"REDIS_URL"}
            if unknown or "REDIS_URL" not in entry:
                raise ConfigurationError(f"{field}[{name!r}]: expected a Redis URL, got {config!r}")
            url = entry["REDIS_URL"]
        stores[name] = _redis_url(url, f"{field}[{name!r}]")
    return dict(sorted(stores.items()))  # sorted: every process numbers the regions alike


def _share_floor(value: object, field: str) -> float:
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


# -- the namespaces -----------------------------------------------------------------------------


def _backend_default(conf: Settings) -> str:
    """``"redis"`` when the project says where its Redis is, else ``"memory"``."""
    redis_settings = (Redis.url, Redis.cache, Redis.client)
    return "redis" if any(conf.is_set(setting) for setting in redis_settings) else "memory"


def _one_address(namespace: Any, alias: str | None) -> str | None:
    if alias is not None and namespace._conf.is_set(Redis.url):
        raise ConfigurationError(
            f"{Redis.cache.field} and {Redis.url.field} are both set: the limiter takes its Redis from one of them"
        )
    return alias


class Redis(Namespace):
    """``REDIS``: the limiter's Redis, and how it is asked."""

    doc = "the limiter's Redis, and how it is asked"
    id = "ratelimits.E152"

    url = Setting(
        "redis://127.0.0.1:6379/0",
        _redis_url,
        id="ratelimits.E102",
        old="REDIS_URL",
        doc="the limiter's Redis: `redis://`, `rediss://` (TLS), `unix://`, "
        "`redis+sentinel://host:port[,host:port...]/service_name[?db=N]` (the master is found through the sentinels "
        "and followed through failovers; decisions never read a replica), or "
        "`redis+cluster://host:port[,host:port...]` (`rediss+cluster://` with TLS): a Redis Cluster, found through any "
        "of its startup nodes ([scaling out](scaling.md#redis-cluster)). An ACL user and password may be given as "
        "`redis://user:password@host`. "
        "It must not evict: `maxmemory-policy noeviction` (`ratelimits.W004` warns otherwise). Credentials the server "
        "refuses, or a TLS certificate that cannot be verified, fail the checks (`ratelimits.E004`)",
    )
    cache = Setting(
        None,
        _cache_alias,
        id="ratelimits.E159",
        after=_one_address,
        doc="instead of `URL`: the alias of a cache in `CACHES` (django-redis' `RedisCache`, or Django's own) whose "
        "Redis the limiter uses: its address, credentials, TLS files and Sentinel settings, so the project configures "
        "Redis once. The limiter makes its own client from them, with its own timeouts below and no retries",
    )
    client = Setting(
        None,
        _redis_client,
        id="ratelimits.E141",
        old="REDIS_CLIENT",
        doc="an import path to a `redis.Redis` or `redis.RedisCluster` client the project built, or to a function "
        "returning one; used instead of `URL`. Decisions still use `SOCKET_TIMEOUT`, `CONNECT_TIMEOUT` and no "
        "retries on their connections, whatever the client says",
    )
    options = Setting(
        {},
        _redis_options,
        id="ratelimits.E140",
        old="REDIS_OPTIONS",
        doc="added to what `URL` says: `username`, `password`, `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, "
        '`ssl_cert_reqs` (`"required"`, `"optional"` or `"none"`), `ssl_check_hostname`, and for Sentinel the '
        "sentinels' own `sentinel_username` and `sentinel_password`. Any other key fails the checks",
    )
    socket_timeout = Setting(
        "50ms",
        _seconds,
        id="ratelimits.E103",
        old="REDIS_SOCKET_TIMEOUT",
        doc="read timeout of the limiter's own client; no retries",
    )
    connect_timeout = Setting(
        "50ms",
        _seconds,
        id="ratelimits.E104",
        old="REDIS_CONNECT_TIMEOUT",
        doc="connect timeout of the limiter's own client",
    )
    key_prefix = Setting(
        "rl", _key_prefix, id="ratelimits.E105", old="KEY_PREFIX", doc="prefix of every Redis key; no braces or spaces"
    )
    clock = Setting(
        "redis",
        _choice(("redis", "app")),
        id="ratelimits.E106",
        old="CLOCK",
        doc='`"redis"`: decisions use Redis `TIME`. `"app"`: the app server\'s clock is passed in, for Redis flavours '
        "that reject `TIME` in scripts (keep app clocks in sync then)",
    )

    @cached_property
    def use_redis_time(self) -> bool:
        """Whether decisions read Redis ``TIME`` (else the app passes its clock)."""
        return self.clock == "redis"

    @cached_property
    def address(self) -> tuple[str, dict[str, Any]]:
        """Where the limiter's Redis is: a URL and the options added to it (from ``CACHE`` if set, else ``URL``)."""
        alias = self.cache
        if alias is None:
            return self.url, self.options
        try:
            url, options = target_of_cache(alias, django_settings.CACHES[alias])
        except ValueError as exc:
            raise ConfigurationError(f"{Redis.cache.field}: {exc}", setting=Redis.cache.name) from None
        return url, {**options, **self.options}


class Policies(Namespace):
    """``POLICIES``: where policies come from, and who is on which tier by default."""

    doc = "where policies come from, and who is on which tier by default"
    id = "ratelimits.E153"

    source = Setting(
        "settings",
        _policy_source,
        id="ratelimits.E107",
        old="POLICY_SOURCE",
        doc='`"settings"` (`TIERS`, `ENDPOINTS` and DRF\'s throttle rates) or `"database"` for '
        "[admin-managed policies](admin.md), or a dotted path to a class implementing "
        "`ratelimits.policies.PolicySource`. The short names stand for `ratelimits.policies.SettingsPolicySource` "
        "and `ratelimits.policies.database.DatabasePolicySource`",
    )
    default_tiers = Setting(
        {"anonymous": "anonymous", "authenticated": "authenticated"},
        _default_tiers,
        id="ratelimits.E111",
        old="DEFAULT_TIERS",
        doc="the tier of callers `TIER_FUNC` does not place: `anonymous` and `authenticated` callers",
    )
    tier_func = Setting(
        None,
        _optional_callable,
        id="ratelimits.E112",
        old="TIER_FUNC",
        doc="dotted path or callable `(request, identity) -> tier name or None`. A name that is not a tier (or, with "
        "the database source, an enabled tier) logs an error once and the caller gets the default tier",
    )
    exempt_endpoints = Setting(
        [],
        _exempt_endpoints,
        id="ratelimits.E120",
        old="EXEMPT_ENDPOINTS",
        doc="endpoints never limited (health checks, staff tools), under either source",
    )
    poll_interval = Setting(
        "5s",
        _seconds,
        id="ratelimits.E108",
        old="POLICY_POLL_INTERVAL",
        doc="database source: how often workers reload while Redis is unreachable",
    )
    recheck_interval = Setting(
        "60s",
        _seconds,
        id="ratelimits.E109",
        old="POLICY_RECHECK_INTERVAL",
        doc="database source: how often workers compare their policy version with the database's",
    )
    load_timeout = Setting(
        "100ms",
        _seconds,
        id="ratelimits.E136",
        old="POLICY_LOAD_TIMEOUT",
        doc="database source: the longest a policy reload may wait on a lock or run a statement (PostgreSQL "
        "`lock_timeout` and `statement_timeout`, SQLite's busy timeout). A reload that fails keeps the last snapshot "
        "and is retried in the background ([failure modes](failure-modes.md#a-locked-or-slow-policy-table))",
    )
    import_max_size = Setting(
        "10MB",
        _size,
        id="ratelimits.E138",
        old="IMPORT_MAX_SIZE",
        doc="the largest document `ratelimits_import` reads ([admin](admin.md#management-commands)): a number of "
        'bytes, or a size such as `"512KB"` (`B`, `KB`, `MB`, `GB`: multiples of 1024)',
    )


class Identity(Namespace):
    """``IDENTITY``: who is asking: API keys, organisations, client addresses, and how they are hashed."""

    doc = "who is asking: API keys, organisations, client addresses, and how they are hashed"
    id = "ratelimits.E154"

    api_key_func = Setting(
        "ratelimits.identity.default_api_key",
        _callable,
        id="ratelimits.E121",
        old="API_KEY_FUNC",
        doc="`(request.auth) -> str or None`: what identifies the credential DRF authenticated with. Default: model "
        "instances by class and primary key, anything else by `str()`",
    )
    api_key_model = Setting(
        None,
        _model,
        id="ratelimits.E122",
        old="API_KEY_MODEL",
        doc='`"app_label.Model"` of your API keys: the admin suggests them when picking a subject, and the effective '
        "policy page and `ratelimits_effective` find a key's object from its identifier",
    )
    organization_func = Setting(
        "ratelimits.identity.no_organization",
        _callable,
        id="ratelimits.E123",
        old="ORGANIZATION_FUNC",
        doc="`(request) -> str or None`: the caller's organisation, which `DIMENSIONS['org']` limits",
    )
    trusted_proxies = Setting(
        [],
        _networks,
        id="ratelimits.E124",
        old="TRUSTED_PROXIES",
        doc="addresses or networks of your proxies ([security](security.md))",
    )
    client_ip_header = Setting(
        "HTTP_X_FORWARDED_FOR",
        _meta_key,
        id="ratelimits.E125",
        old="CLIENT_IP_HEADER",
        doc="the `request.META` key your proxies append the client address to (upper case, underscores)",
    )
    ipv6_prefix = Setting(
        64,
        _ipv6_prefix,
        id="ratelimits.E126",
        old="IPV6_PREFIX",
        doc="IPv6 clients are limited per network of this size",
    )
    hash_key = Setting(
        None,
        _hash_key,
        id="ratelimits.E127",
        old="HASH_KEY",
        shown="`SECRET_KEY`",
        doc="key of the hash that turns identities into key names; a non-empty string",
    )
    failed_auth = Setting(
        None,
        _failed_auth,
        id="ratelimits.E137",
        old="FAILED_AUTH",
        doc='failed authentications allowed per client IP and per credential prefix, e.g. `{"rate": "10/m", "burst": '
        '20, "prefix_length": 12}` (`prefix_length`: leading characters of the credential counted together; 0 counts '
        "IPs only). Needs `ratelimits.middleware.FailedAuthenticationMiddleware` first in `MIDDLEWARE` "
        "(`ratelimits.W005` otherwise; [security](security.md#failed-authentication))",
    )


class Headers(Namespace):
    """``HEADERS``: the rate-limit headers of every response."""

    doc = "the rate-limit headers of every response ([contract](contract.md))"
    id = "ratelimits.E155"
    legacy = "style"  # 0.1: HEADERS = "both"

    style = Setting(
        "both",
        _choice(HEADER_STYLES),
        id="ratelimits.E128",
        doc='`"ietf"` (`RateLimit`, `RateLimit-Policy`), `"github"` (`X-RateLimit-*`), `"both"` or `"none"`',
    )
    policies = Setting(
        "all",
        _choice(HEADER_POLICY_CHOICES),
        id="ratelimits.E148",
        old="HEADER_POLICIES",
        doc='what `RateLimit-Policy` lists: `"all"`, every enforced policy of the request in the order of its '
        'checks; `"closest"`, only the policy `RateLimit` names. `RateLimit` and the GitHub headers always describe '
        "the closest",
    )
    partition_key = Setting(
        False,
        _boolean,
        id="ratelimits.E149",
        old="HEADER_PARTITION_KEY",
        doc="each item of `RateLimit-Policy` and `RateLimit` carries `pk`, a Byte Sequence of the keyed hash that "
        "names the policy's subject in key names (never the identity itself)",
    )
    retry_after_jitter_us = Setting(
        "0ms",
        _jitter_us,
        key="RETRY_AFTER_JITTER",
        id="ratelimits.E129",
        old="RETRY_AFTER_JITTER",
        doc="up to this much random time is *added* to `Retry-After`",
    )


def _min_calls(namespace: Any, min_calls: int) -> int:
    window: int = namespace.breaker_window
    return min(min_calls, window)  # never more than the window can hold


class Failure(Namespace):
    """``FAILURE``: what happens when the limiter's store cannot answer."""

    doc = "what happens when the limiter's store cannot answer ([failure modes](failure-modes.md))"
    id = "ratelimits.E156"

    default_mode = Setting(
        "open",
        _fail_mode,
        id="ratelimits.E130",
        old="DEFAULT_FAIL_MODE",
        doc='the fail mode of policies that name none: `"open"` (admit), `"closed"` (503) or `"local"` (decide in '
        "the process against its share)",
    )
    local_share = Setting(
        1.0,
        _share,
        id="ratelimits.E131",
        old="LOCAL_FALLBACK_SHARE",
        doc="the share of a policy one process enforces under fail mode `local` (e.g. `0.25` with four workers)",
    )
    breaker_window = Setting(
        20, _positive_int, id="ratelimits.E132", old="BREAKER_WINDOW", doc="outcomes the circuit breaker remembers"
    )
    breaker_min_calls = Setting(
        5,
        _positive_int,
        id="ratelimits.E133",
        old="BREAKER_MIN_CALLS",
        after=_min_calls,
        doc="outcomes needed before it may open (at most `BREAKER_WINDOW`)",
    )
    breaker_failure_rate = Setting(
        0.5, _share, id="ratelimits.E134", old="BREAKER_FAILURE_RATE", doc="the share of failures that opens it"
    )
    breaker_cooldown = Setting(
        "2s", _seconds, id="ratelimits.E135", old="BREAKER_COOLDOWN", doc="how long it stays open before one probe"
    )

    @cached_property
    def breaker(self) -> dict[str, Any]:
        """The circuit breaker's arguments."""
        return {
            "window": self.breaker_window,
            "min_calls": self.breaker_min_calls,
            "failure_rate": self.breaker_failure_rate,
            "cooldown": self.breaker_cooldown,
        }


_ADAPTIVE = AdaptiveSettings()


def _adaptive_floor(namespace: Any, floor: int | None) -> int | None:
    ceiling = namespace._conf.shedding.worker_capacity
    if floor is not None and ceiling is not None and floor > ceiling:
        raise ConfigurationError(
            f"{Adaptive.floor.field}: {floor} is above {Shedding.worker_capacity.field} ({ceiling})"
        )
    return floor


class Adaptive(Switchable):
    """``SHEDDING['ADAPTIVE']``: the worker shedder's capacity following latency and errors."""

    doc = (
        "`True`, or a dict, to have the worker shedder's capacity follow latency and errors "
        "([adaptive capacity](adaptive.md)); needs `WORKER_CAPACITY`, the most it reaches. Add "
        "`ratelimits.middleware.EarlyRejectionMiddleware` first in `MIDDLEWARE` for the 5xx signal (`ratelimits.W006`)"
    )
    id = "ratelimits.E147"
    switch = False
    old = ("ADAPTIVE_CAPACITY",)

    floor = Setting(
        None,
        _optional_positive_int,
        id="ratelimits.E160",
        old=("ADAPTIVE_CAPACITY", "floor"),
        after=_adaptive_floor,
        shown="a quarter of `WORKER_CAPACITY`",
        doc="the least capacity it is cut to, and where it starts; at most `WORKER_CAPACITY`",
    )
    tolerance = Setting(
        _ADAPTIVE.tolerance,
        _tolerance,
        id="ratelimits.E161",
        old=("ADAPTIVE_CAPACITY", "tolerance"),
        doc="how much slower than its usual latency an endpoint may answer before the capacity is cut (above 1, at "
        "most 10)",
    )
    window = Setting(
        "500ms",
        _seconds,
        id="ratelimits.E162",
        old=("ADAPTIVE_CAPACITY", "window"),
        doc="the responses each adjustment is made from",
    )
    min_samples = Setting(
        _ADAPTIVE.min_samples,
        _positive_int,
        id="ratelimits.E163",
        old=("ADAPTIVE_CAPACITY", "min_samples"),
        doc="responses of an endpoint it takes to judge it",
    )
    error_rate = Setting(
        _ADAPTIVE.error_rate,
        _share,
        id="ratelimits.E164",
        old=("ADAPTIVE_CAPACITY", "error_rate"),
        doc="the share of 5xx above the usual share that cuts",
    )
    timeout = Setting(
        None,
        _optional_seconds,
        id="ratelimits.E165",
        old=("ADAPTIVE_CAPACITY", "timeout"),
        doc="a response slower than this counts as an error",
    )
    probe_interval = Setting(
        "60s",
        _seconds,
        id="ratelimits.E166",
        old=("ADAPTIVE_CAPACITY", "probe_interval"),
        doc="after a cut, how long the capacity stays below the level it was cut at",
    )

    @cached_property
    def settings(self) -> AdaptiveSettings | None:
        """The adaptive capacity's parameters, its floor filled in; ``None`` when it is off."""
        if not self.enabled:
            return None
        ceiling = self._conf.shedding.worker_capacity
        if ceiling is None:
            raise ConfigurationError(
                f"{Adaptive.field()} adapts the worker shedder's capacity: set {Shedding.worker_capacity.field} too "
                "(the most it may reach)",
                setting=Adaptive.name(),
            )
        settings = AdaptiveSettings(**self.values())
        return settings._replace(floor=settings.floor if settings.floor is not None else max(ceiling // 4, 1))


class Shedding(Namespace):
    """``SHEDDING``: the fleet's and each worker's load shedders (503 by priority class)."""

    doc = "the fleet's and each worker's load shedders: 503 by priority class ([shedding](shedding.md))"
    id = "ratelimits.E157"

    fleet_capacity = Setting(
        None,
        _optional_positive_int,
        id="ratelimits.E115",
        old="FLEET_CAPACITY",
        doc="settings source: requests in flight the fleet can serve; `None` disables the fleet shedder",
    )
    fleet_shards = Setting(
        1,
        _positive_int,
        id="ratelimits.E142",
        old="FLEET_SHARDS",
        doc="both sources: how many keys the fleet's in-flight set is split over, each counting its share of every "
        "class's limit (hot-key sharding, for a Redis Cluster). Each sheddable class must keep one slot per shard",
    )
    thresholds = Setting(
        {"low": 60, "normal": 75, "high": 90},
        _thresholds,
        id="ratelimits.E116",
        old="SHED_THRESHOLDS",
        doc="the percent of capacity at which each class is shed (the fleet's, with the settings source, and each "
        "worker's)",
    )
    worker_capacity = Setting(
        None,
        _optional_positive_int,
        id="ratelimits.E117",
        old="WORKER_CAPACITY",
        doc="requests one worker process serves at once; enables the worker shedder (with `ADAPTIVE`: the most its "
        "capacity reaches)",
    )
    slot_ttl_us = Setting(
        "60s",
        _duration_us,
        key="SLOT_TTL",
        id="ratelimits.E114",
        old="SLOT_TTL",
        doc="how long a slot (a request in flight) is kept if its worker dies; well above the slowest request",
    )
    adaptive = Mount(Adaptive)


class Usage(Switchable):
    """``USAGE``: usage counted in the decision's round trip, and drained into reports."""

    doc = (
        "`True` (the default), `False`, or a dict: count every decision in the per-minute usage counters "
        "([usage](usage.md))"
    )
    id = "ratelimits.E118"
    switch = True

    max_subjects = Setting(
        50_000,
        _positive_int,
        id="ratelimits.E139",
        old="USAGE_MAX_SUBJECTS",
        doc="the most rows (a caller on an endpoint) one minute of usage counts; a new row beyond them is counted in "
        "the overflow row of its caller kind and endpoint",
    )


_LOCAL = LocalPathSettings()


class LocalPath(Namespace):
    """``LOCAL_PATH``: what each worker answers without the store."""

    doc = (
        "what each worker answers without the store ([local path](local-path.md)). Add "
        "`ratelimits.middleware.EarlyRejectionMiddleware` first in `MIDDLEWARE` to refuse remembered credentials and "
        "shed requests before authentication"
    )
    id = "ratelimits.E143"

    denials = Setting(
        _LOCAL.denials,
        _boolean,
        id="ratelimits.E167",
        old=("LOCAL_PATH", "denials"),
        doc="refuse from memory a check the store denied, until its wait has passed (exact)",
    )
    leases = Setting(
        _LOCAL.leases,
        _boolean,
        id="ratelimits.E168",
        old=("LOCAL_PATH", "leases"),
        doc="lease tokens of busy token buckets and fixed windows in the decide call and spend them locally",
    )
    lease_ttl = Setting(
        "500ms",
        _lease_ttl,
        id="ratelimits.E169",
        old=("LOCAL_PATH", "lease_ttl"),
        doc="how long a lease lasts, at most 1 s",
    )
    lease_share = Setting(
        _LOCAL.lease_share,
        _share,
        id="ratelimits.E170",
        old=("LOCAL_PATH", "lease_share"),
        doc="the most of a limit's capacity one lease takes",
    )
    max_entries = Setting(
        _LOCAL.max_entries,
        _positive_int,
        id="ratelimits.E171",
        old=("LOCAL_PATH", "max_entries"),
        doc="denials one worker remembers, and credentials and keys it counts for leases",
    )
    header = Setting(
        _LOCAL.header,
        _boolean,
        id="ratelimits.E172",
        old=("LOCAL_PATH", "header"),
        doc="`X-RateLimit-Local` on responses answered from memory, and a DEBUG log line",
    )

    @cached_property
    def settings(self) -> LocalPathSettings:
        return LocalPathSettings(**self.values())


def _this_region(namespace: Any, region: str | None) -> str | None:
    stores = namespace.stores
    if region is None and stores:
        raise ConfigurationError(
            f"{Regions.current.field} must name this deployment's region: {Regions.stores.field} is set"
        )
    if region is not None and region not in stores:
        names = ", ".join(stores) or f"none: set {Regions.stores.field}"
        raise ConfigurationError(f"{Regions.current.field}: {region!r} is not one of {Regions.stores.field} ({names})")
    return region


_RECONCILE = ReconcileSettings()


class Regions(Namespace):
    """``REGIONS``: one limit across regions, each enforcing its share."""

    doc = "one limit across regions, each region enforcing its share ([regions](regions.md))"
    id = "ratelimits.E158"
    legacy = "stores"  # 0.1: REGIONS = {"eu": {"REDIS_URL": ...}, ...}
    legacy_mapping = True

    stores = Setting(
        {},
        _region_stores,
        id="ratelimits.E145",
        doc="every region of the fleet and its store's Redis URL: "
        '`{"eu": "redis://...", "us": "redis+cluster://..."}`. With two or more, a policy with `"scope": "global"` is '
        "one limit shared by all of them",
    )
    current = Setting(
        None,
        _region,
        id="ratelimits.E144",
        old="REGION",
        after=_this_region,
        doc="this deployment's region: required, and one of `STORES`, once `STORES` is set",
    )
    reconcile_interval = Setting(
        "1s",
        _seconds,
        id="ratelimits.E146",
        old=("RECONCILE", "interval"),
        doc="seconds between two rounds of the reconciler (`ratelimits.tasks.BEAT_SCHEDULE` reads it)",
    )
    share_floor = Setting(
        _RECONCILE.floor,
        _share_floor,
        id="ratelimits.E173",
        old=("RECONCILE", "floor"),
        doc="the least share a reachable region keeps (below 0.5)",
    )
    stale_after = Setting(
        "10s",
        _seconds,
        id="ratelimits.E174",
        old=("RECONCILE", "stale_after"),
        doc="a share above the even split not rewritten for this long starts to decay down",
    )
    decay = Setting(
        "30s",
        _seconds,
        id="ratelimits.E175",
        old=("RECONCILE", "decay"),
        doc="how long a stale share takes to come down to the even split",
    )

    @cached_property
    def count(self) -> int:
        """How many regions share a global policy's limit (1 without ``STORES``)."""
        return max(len(self.stores), 1)

    @cached_property
    def reconcile(self) -> ReconcileSettings:
        return ReconcileSettings(self.reconcile_interval, self.share_floor, self.stale_after, self.decay)


class Metrics(Switchable):
    """``METRICS``: Prometheus metrics of the decisions."""

    doc = (
        "`False` (the default), `True` or a dict: Prometheus metrics of the decisions ([metrics](metrics.md)), served "
        "by `ratelimits.metrics.view`; needs prometheus-client (the `metrics` extra). Outside `DEBUG` without "
        "`PROMETHEUS_MULTIPROC_DIR`, `ratelimits.W007` warns"
    )
    id = "ratelimits.E150"
    switch = False

    multiprocess = Setting(
        None,
        _optional_boolean,
        id="ratelimits.E176",
        old=("METRICS", "multiprocess"),
        doc="`None`: on when `PROMETHEUS_MULTIPROC_DIR` is set; `True` requires it; `False` says one process serves",
    )
    flush_interval = Setting(
        "1s",
        _flush_interval,
        id="ratelimits.E177",
        old=("METRICS", "flush_interval"),
        doc="how often the request path's counts reach prometheus-client, at most a minute",
    )

    @cached_property
    def settings(self) -> MetricsSettings | None:
        """What the recorder needs, checked against the environment; ``None`` when metrics are off."""
        if not self.enabled:
            return None
        import importlib.util

        if importlib.util.find_spec("prometheus_client") is None:
            raise ConfigurationError(f"{Metrics.field()}: metrics need prometheus-client; install ratelimits[metrics]")
        directory = os.environ.get(MULTIPROC_ENV, "")
        wanted = self.multiprocess
        if wanted and not directory:
            raise ConfigurationError(
                f"{Metrics.multiprocess.field}: True, but {MULTIPROC_ENV} is not set; set it to an empty directory "
                "before the server starts (see "
                f"{documentation.page('metrics', 'several-worker-processes-multiprocess-mode')})",
                setting=Metrics.multiprocess.name,
            )
        if directory and wanted is not False and not os.path.isdir(directory):
            raise ConfigurationError(f"{Metrics.field()}: {MULTIPROC_ENV}={directory!r} is not a directory")
        return MetricsSettings(
            bool(directory) and wanted is not False, self.flush_interval, declared=wanted is not None
        )


class Settings(Namespace):
    """Typed, validated, cached access to ``settings.RATELIMITS``: the root namespace (:data:`conf`)."""

    doc = "every setting of ratelimits"

    enabled = Setting(
        True,
        _boolean,
        id="ratelimits.E151",
        doc="`False` admits every request without asking the store, and sends no rate-limit headers: for a "
        "project's own test suite ([testing](testing.md))",
    )
    backend = Setting(
        None,
        _text,
        id="ratelimits.E101",
        derive=_backend_default,
        shown='`"redis"` if `REDIS` says where, else `"memory"`',
        doc='`"redis"`, `"memory"` (one process only: warned about outside `DEBUG`, `ratelimits.W001`) or a dotted '
        "path to a `Backend` subclass",
    )
    tiers = Setting(
        {"anonymous": {"rate": "20/s", "burst": 40}, "authenticated": {"rate": "100/s", "burst": 200}},
        _tiers,
        id="ratelimits.E110",
        shown="anonymous 20/s burst 40, authenticated 100/s burst 200 (or DRF's `anon` and `user` rates)",
        doc='tier name → policy; a policy may say `"scope": "global"` (one limit across every region, '
        "[regions](regions.md))",
    )
    dimensions = Setting(
        {},
        _dimensions,
        id="ratelimits.E113",
        doc="subject kind (`ip`, `user`, `api_key`, `org`) → policy applied to every request that has that subject",
    )
    endpoints = Setting(
        {},
        _mapping,
        id="ratelimits.E119",
        shown="`{}` (or DRF's scoped rates)",
        doc="endpoint → rule ([below](#endpoints)): its cost, priority and limits",
    )
    redis = Mount(Redis)
    policies = Mount(Policies)
    identity = Mount(Identity)
    headers = Mount(Headers)
    failure = Mount(Failure)
    shedding = Mount(Shedding)
    usage = Mount(Usage)
    local_path = Mount(LocalPath)
    regions = Mount(Regions)
    metrics = Mount(Metrics)

    def __init__(self) -> None:
        #: Moved on by every :meth:`clear`: a value read before it is never kept after it.
        self.generation = 0
        super().__init__(self)
        self._values: dict[str, Any] = {}

    def _keeps(self, generation: int) -> bool:
        return self.generation == generation

    # -- reading the project's settings --------------------------------------------------------

    def clear(self) -> None:
        """Forget every parsed value: the next read parses the settings afresh.

        A thread that read a value before this and keeps it after would keep a value of the old
        settings: the generation moves first, and a value read at another generation is not kept.
        """
        self.generation += 1
        self._values.clear()
        # The namespaces and the values read through them are plain attributes of the instances.
        for name in list(self.__dict__):
            if name not in ("_values", "_conf", "_born", "generation"):
                self.__dict__.pop(name, None)

    @property
    def user_settings(self) -> Mapping[str, Any]:
        """``settings.RATELIMITS`` as the project wrote it (a dict, or a :class:`ConfigurationError`)."""
        value = getattr(django_settings, "RATELIMITS", {})
        if not isinstance(value, dict):
            raise ConfigurationError(f"RATELIMITS must be a dict, got {type(value).__name__}")
        return value

    def value(self, setting: Setting[T]) -> T:
        """The parsed value of ``setting``; raises :class:`ConfigurationError` naming it if invalid."""
        try:
            return cast(T, self._values[setting.name])
        except KeyError:
            pass
        generation = self.generation
        try:
            found = self.given(setting)
        except ConfigurationError as exc:  # a namespace on its way is not a dict
            raise ConfigurationError(str(exc), setting=exc.setting or setting.name) from None
        if found is not None:
            raw = found[0]
        elif setting.derive is not None:
            raw = setting.derive(self)
        else:
            raw = setting.default
        parsed = setting.parse(raw)
        if self.generation == generation:
            self._values[setting.name] = parsed
        return parsed

    def read(self, setting: Setting[T]) -> T:
        """``setting`` read as the code reads it (``conf.redis.url``): parsed, and checked against the others."""
        owner: Any = self
        for attr in setting.namespace.attrs if setting.namespace is not None else ():
            owner = getattr(owner, attr)
        return cast(T, getattr(owner, setting.attr))

    def namespace(self, namespace: type[N]) -> N:
        """The instance of ``namespace`` that :data:`conf` reads (``conf.shedding.adaptive``)."""
        owner: Any = self
        for attr in namespace.attrs:
            owner = getattr(owner, attr)
        return cast(N, owner)

    def is_set(self, setting: Setting[Any]) -> bool:
        """Whether the project sets ``setting`` itself (under its name, or its 0.1 name), rather than its default."""
        return self.given(setting) is not None

    def given(self, setting: Setting[Any]) -> tuple[Any, KeyPath] | None:
        """The project's value of ``setting`` and where it was written, or ``None`` if it gives none."""
        found = self._at(setting.path)
        if found is not _MISSING:
            return found, setting.path
        namespace = setting.path[:-1]
        container = self._at(namespace) if namespace else _MISSING
        if (
            container is not _MISSING
            and self._legacy_of(namespace) == setting.attr
            and self._is_legacy(namespace, container)
        ):
            return container, namespace
        if setting.old is not None:
            found = self._at(setting.old)
            if found is not _MISSING:
                return found, setting.old
        return None

    def switched_on(self, namespace: type[Namespace]) -> bool:
        """Whether a switchable namespace is on: its value, else its 0.1 name's presence, else its default."""
        if namespace.switch is None:
            return True
        value = self._at(namespace.path)
        if value is _MISSING and namespace.old is not None:
            old = self._at(namespace.old)
            value = _MISSING if old is _MISSING or old is None else old is not False
        if value is _MISSING:
            return namespace.switch
        if value is not None and not isinstance(value, (bool, Mapping)):
            raise ConfigurationError(
                f"{namespace.field()}: expected True, False or a dict, got {value!r}", setting=namespace.name()
            )
        return value is not None and value is not False

    def _at(self, path: KeyPath) -> Any:
        """The project's value at ``path``, or ``_MISSING``. A namespace on the way that is neither a
        dict nor one of its accepted shorthands is an error naming it."""
        value: Any = self.user_settings
        for depth, key in enumerate(path):
            if not isinstance(value, Mapping):
                prefix = path[:depth]
                if self._shorthand(prefix, value):
                    return _MISSING
                namespace = _NAMESPACES.get(prefix)
                expected = (
                    "True, False or a dict" if namespace is not None and namespace.switch is not None else "a dict"
                )
                raise ConfigurationError(
                    f"{field_of(prefix)}: expected {expected}, got {value!r}",
                    setting=namespace.name() if namespace is not None else None,
                )
            value = value.get(key, _MISSING)
            if value is _MISSING:
                return _MISSING
        return value

    def _shorthand(self, path: KeyPath, value: Any) -> bool:
        """Whether ``value`` at a namespace's ``path`` stands for something other than its dict of settings."""
        namespace = _NAMESPACES.get(path)
        if namespace is None:  # a 0.1 dict that switched a feature (ADAPTIVE_CAPACITY): None or a bool switches it
            return path in _OLD_CONTAINERS and (value is None or isinstance(value, bool))
        if namespace.switch is not None and (value is None or isinstance(value, bool)):
            return True
        return namespace.legacy is not None and self._is_legacy(path, value)

    @staticmethod
    def _legacy_of(path: KeyPath) -> str | None:
        namespace = _NAMESPACES.get(path)
        return namespace.legacy if namespace is not None else None

    @staticmethod
    def _is_legacy(path: KeyPath, value: Any) -> bool:
        """Whether a namespace's value is written as 0.1 wrote the setting it replaced (``HEADERS = "both"``)."""
        namespace = _NAMESPACES.get(path)
        if namespace is None or namespace.legacy is None:
            return False
        if not isinstance(value, Mapping):
            return True
        return namespace.legacy_mapping and bool(value) and not set(value) & namespace.keys()

    # -- what the checks report about the way RATELIMITS is written ----------------------------

    def findings(self) -> list[Finding]:
        """Keys that are no setting, settings under their 0.1 names, and settings given under both names."""
        found: list[Finding] = []
        self._unknown_keys((), self.user_settings, found)
        for setting in SETTINGS.values():
            new = self._at_quietly(setting.path)
            try:
                where = self.given(setting)
            except ConfigurationError:
                continue  # a namespace of the wrong shape: reported as an invalid value
            if where is None or where[1] == setting.path:
                if new is not _MISSING and setting.old is not None and self._at_quietly(setting.old) is not _MISSING:
                    found.append(
                        Finding(
                            "both",
                            f"{field_of(setting.old)} and {setting.field} are both set; {setting.field} is read",
                            f"Remove {field_of(setting.old)}, the name 0.1 gave it.",
                        )
                    )
                continue
            found.append(_renamed(where[1], setting))
        for namespace in _NAMESPACES.values():
            if namespace.old is not None and self._at_quietly(namespace.old) not in (_MISSING, None):
                found.append(_renamed(namespace.old, namespace))
        return found

    def _at_quietly(self, path: KeyPath) -> Any:
        try:
            return self._at(path)
        except ConfigurationError:
            return _MISSING

    def _unknown_keys(self, path: KeyPath, value: Any, found: list[Finding]) -> None:
        if not isinstance(value, Mapping) or (path and self._is_legacy(path, value)):
            return
        namespace = _NAMESPACES.get(path)
        if namespace is None and path not in _OLD_CONTAINERS:
            return  # a setting's own value (TIERS, OPTIONS...): its parser checks it
        current = namespace.keys() if namespace is not None else _OLD_KEYS[path]
        known = current | _OLD_KEYS.get(path, set())
        for key in value:
            if key not in known:
                close = _closest(str(key), current)
                found.append(
                    Finding(
                        "unknown",
                        f"{field_of((*path, str(key)))} is not a ratelimits setting",
                        f"Did you mean {close!r}?" if close else None,
                    )
                )
            else:
                self._unknown_keys((*path, key), value[key], found)


def _renamed(old: KeyPath, new: Setting[Any] | type[Namespace]) -> Finding:
    field = new.field if isinstance(new, Setting) else new.field()
    return Finding(
        "renamed",
        f"{field_of(old)} is the name 0.1 gave {field}; it is read as such until {OLD_NAMES_UNTIL}",
        f"Rename it {field}.",
    )


def _closest(key: str, known: set[str]) -> str | None:
    """The known key closest to ``key``, whatever their case (0.1's nested keys were lower case)."""
    by_upper = {name.upper(): name for name in known}
    close = difflib.get_close_matches(key.upper(), sorted(by_upper), n=1)
    return by_upper[close[0]] if close else None


def _every(namespace: type[Namespace]) -> Iterator[type[Namespace]]:
    yield namespace
    for inner in namespace.namespaces():
        yield from _every(inner)


Settings._mount((), ())
#: Every namespace, by its path (``()`` is ``RATELIMITS`` itself).
_NAMESPACES: dict[KeyPath, type[Namespace]] = {namespace.path: namespace for namespace in _every(Settings)}
#: Every setting, by its name (``"REDIS.URL"``), in the order docs/configuration.md lists them.
SETTINGS: dict[str, Setting[Any]] = {
    setting.name: setting for namespace in _every(Settings) for setting in namespace.declared()
}
#: Keys 0.1 gave settings, under the path that holds them (``() -> {"REDIS_URL", ...}``).
_OLD_KEYS: dict[KeyPath, set[str]] = {}
for _path in [s.old for s in SETTINGS.values() if s.old] + [n.old for n in _NAMESPACES.values() if n.old]:
    for _depth in range(len(_path)):
        _OLD_KEYS.setdefault(_path[:_depth], set()).add(_path[_depth])
#: Dicts 0.1 had that are no namespace now (``RECONCILE``, ``ADAPTIVE_CAPACITY``): their keys are checked too.
_OLD_CONTAINERS = {path for path in _OLD_KEYS if path and path not in _NAMESPACES}

#: Every namespace, by its name (``"SHEDDING.ADAPTIVE"``).
NAMESPACES: dict[str, type[Namespace]] = {
    namespace.name(): namespace for namespace in _NAMESPACES.values() if namespace.path
}


def id_of(name: str) -> str | None:
    """The check id of a setting or namespace named as :attr:`ConfigurationError.setting` names it."""
    if name in SETTINGS:
        return SETTINGS[name].id
    return NAMESPACES[name].id if name in NAMESPACES else None


conf = Settings()


def require_app() -> None:
    """Refuse to limit anything, with the reason, when ``ratelimits`` is not in ``INSTALLED_APPS``.

    Without the app no system check runs (a bad setting would surface as a 500 on every request)
    and the admin's tables do not exist. Asked where the engine starts (the policy source is built,
    a middleware is made, the throttle is imported); before the app registry is ready it cannot
    be told, and the next of those asks again.
    """
    if apps.apps_ready and not apps.is_installed("ratelimits"):
        raise ImproperlyConfigured(
            "ratelimits is not in INSTALLED_APPS: add 'ratelimits' there (after 'rest_framework'), then run "
            "manage.py migrate and manage.py check"
        )


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
    if setting in ("RATELIMITS", "SECRET_KEY", "CACHES"):
        conf.clear()
    if setting in ("RATELIMITS", "CACHES"):
        ProcessWide.reset_all()


setting_changed.connect(_reset, dispatch_uid="ratelimits.conf.reset")


def reference() -> str:
    """docs/configuration.md's tables of every setting, in Markdown, written from the declarations above."""
    sections = []
    for namespace in _every(Settings):
        if namespace is Settings:
            title, intro = "The top level", "`RATELIMITS` itself: the settings most projects set, and the namespaces."
        else:
            title = namespace.path[-1] + "".join(f" (in {key})" for key in reversed(namespace.path[:-1]))
            intro = namespace.doc[0].upper() + namespace.doc[1:] + "."
        rows = ["| setting | default | meaning | 0.1 name | id |", "|---|---|---|---|---|"]
        for setting in namespace.declared():
            old = setting.old or (namespace.path if namespace.legacy == setting.attr else None)
            was = f"`{field_of(old).removeprefix('RATELIMITS')}`" if old else ""
            rows.append(f"| `{setting.key}` | {_shown(setting)} | {setting.doc} | {was} | `{setting.id}` |")
        for inner in namespace.namespaces():
            rows.append(f"| `{inner.path[-1]}` | | a namespace ([below](#{_anchor(inner)})) | | `{inner.id}` |")
        sections.append(f"### {title}\n\n{intro}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


def _shown(setting: Setting[Any]) -> str:
    if setting.shown is not None:
        return setting.shown
    default = setting.default
    if isinstance(default, str):
        return f'`"{default}"`'
    if isinstance(default, (dict, list)) and not default:
        return f"`{default!r}`"
    return f"`{default!r}`".replace("'", '"')


def _anchor(namespace: type[Namespace]) -> str:
    """The anchor of the namespace's heading (``### ADAPTIVE (in SHEDDING)``), as MkDocs and GitHub make it."""
    inner, *outer = reversed(namespace.path)
    return "-".join([inner.lower(), *(f"in-{key.lower()}" for key in outer)])
