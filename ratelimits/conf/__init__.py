"""Settings of ratelimits: every setting of ``settings.RATELIMITS``, each declared once.

``RATELIMITS`` has fifteen keys: the few most projects set (``BACKEND``, ``TIERS``, ``ENDPOINTS``,
``DIMENSIONS``, ``ENABLED``) and namespaces that group the rest by what they tune (``REDIS``,
``POLICIES``, ``IDENTITY``, ``HEADERS``, ``FAILURE``, ``SHEDDING``, ``USAGE``, ``LOCAL_PATH``,
``REGIONS``, ``METRICS``). Each setting is one :class:`Setting` in its namespace's class below,
which gives its key, default, parser (whose errors name it), check id and documentation line:
the system checks take their ids from here, and docs/configuration.md's tables are generated
from here (``make settings-reference``; a test keeps them current). What a declaration is
(``Setting``, ``Namespace``, ``Mount``, reading the project's dict, old names) lives in
:mod:`.declaration`; the parsers that turn a value into what the package uses, in :mod:`.parsers`.

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

import os
from functools import cached_property
from typing import Any, cast

from django.apps import apps
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from .. import documentation
from .._process import ProcessWide
from ..exceptions import ConfigurationError
from ..redis_url import target_of_cache
from . import parsers as parse
from .declaration import Finding, KeyPath, Mount, Namespace, Root, Setting, Switchable, field_of
from .declaration import reference as _reference
from .parsers import (
    HEADER_POLICY_CHOICES,
    HEADER_STYLES,
    MULTIPROC_ENV,
    POLICY_SOURCES,
    RETIRED_POLICY_SOURCES,
    SIZE_UNITS,
    AdaptiveSettings,
    FailedAuthLimit,
    LocalPathSettings,
    MetricsSettings,
    ReconcileSettings,
)

__all__ = [
    "HEADER_POLICY_CHOICES",
    "HEADER_STYLES",
    "MULTIPROC_ENV",
    "NAMESPACES",
    "POLICY_SOURCES",
    "RETIRED_POLICY_SOURCES",
    "SETTINGS",
    "SIZE_UNITS",
    "AdaptiveSettings",
    "FailedAuthLimit",
    "Finding",
    "KeyPath",
    "LocalPathSettings",
    "MetricsSettings",
    "Namespace",
    "ReconcileSettings",
    "Setting",
    "Settings",
    "conf",
    "field_of",
    "id_of",
    "reference",
    "require_app",
]


def _root(namespace: Namespace) -> Settings:
    """The settings a namespace belongs to, as the top level declares them."""
    return cast(Settings, namespace._conf)


def _backend_default(conf: Root) -> str:
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
        parse.redis_url,
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
        parse.cache_alias,
        id="ratelimits.E159",
        after=_one_address,
        doc="instead of `URL`: the alias of a cache in `CACHES` (django-redis' `RedisCache`, or Django's own) whose "
        "Redis the limiter uses: its address, credentials, TLS files and Sentinel settings, so the project configures "
        "Redis once. The limiter makes its own client from them, with its own timeouts below and no retries",
    )
    client = Setting(
        None,
        parse.redis_client,
        id="ratelimits.E141",
        old="REDIS_CLIENT",
        doc="an import path to a `redis.Redis` or `redis.RedisCluster` client the project built, or to a function "
        "returning one; used instead of `URL`. Decisions still use `SOCKET_TIMEOUT`, `CONNECT_TIMEOUT` and no "
        "retries on their connections, whatever the client says",
    )
    options = Setting(
        {},
        parse.redis_options,
        id="ratelimits.E140",
        old="REDIS_OPTIONS",
        doc="added to what `URL` says: `username`, `password`, `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, "
        '`ssl_cert_reqs` (`"required"`, `"optional"` or `"none"`), `ssl_check_hostname`, and for Sentinel the '
        "sentinels' own `sentinel_username` and `sentinel_password`. Any other key fails the checks",
    )
    socket_timeout = Setting(
        "50ms",
        parse.seconds,
        id="ratelimits.E103",
        old="REDIS_SOCKET_TIMEOUT",
        doc="read timeout of the limiter's own client; no retries",
    )
    connect_timeout = Setting(
        "50ms",
        parse.seconds,
        id="ratelimits.E104",
        old="REDIS_CONNECT_TIMEOUT",
        doc="connect timeout of the limiter's own client",
    )
    key_prefix = Setting(
        "rl",
        parse.key_prefix,
        id="ratelimits.E105",
        old="KEY_PREFIX",
        doc="prefix of every Redis key; no braces or spaces",
    )
    clock = Setting(
        "redis",
        parse.choice(("redis", "app")),
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
        parse.policy_source,
        id="ratelimits.E107",
        old="POLICY_SOURCE",
        doc='`"settings"` (`TIERS`, `ENDPOINTS` and DRF\'s throttle rates) or `"database"` for '
        "[admin-managed policies](admin.md), or a dotted path to a class implementing "
        "`ratelimits.policies.PolicySource`. The short names stand for `ratelimits.policies.SettingsPolicySource` "
        "and `ratelimits.store.database.DatabasePolicySource`",
    )
    default_tiers = Setting(
        {"anonymous": "anonymous", "authenticated": "authenticated"},
        parse.default_tiers,
        id="ratelimits.E111",
        old="DEFAULT_TIERS",
        doc="the tier of callers `TIER_FUNC` does not place: `anonymous` and `authenticated` callers",
    )
    tier_func = Setting(
        None,
        parse.optional_dotted_callable,
        id="ratelimits.E112",
        old="TIER_FUNC",
        doc="dotted path or callable `(request, identity) -> tier name or None`. A name that is not a tier (or, with "
        "the database source, an enabled tier) logs an error once and the caller gets the default tier",
    )
    exempt_endpoints = Setting(
        [],
        parse.exempt_endpoints,
        id="ratelimits.E120",
        old="EXEMPT_ENDPOINTS",
        doc="endpoints never limited (health checks, staff tools), under either source",
    )
    poll_interval = Setting(
        "5s",
        parse.seconds,
        id="ratelimits.E108",
        old="POLICY_POLL_INTERVAL",
        doc="database source: how often workers reload while Redis is unreachable",
    )
    recheck_interval = Setting(
        "60s",
        parse.seconds,
        id="ratelimits.E109",
        old="POLICY_RECHECK_INTERVAL",
        doc="database source: how often workers compare their policy version with the database's",
    )
    load_timeout = Setting(
        "100ms",
        parse.seconds,
        id="ratelimits.E136",
        old="POLICY_LOAD_TIMEOUT",
        doc="database source: the longest a policy reload may wait on a lock or run a statement (PostgreSQL "
        "`lock_timeout` and `statement_timeout`, SQLite's busy timeout). A reload that fails keeps the last snapshot "
        "and is retried in the background ([failure modes](failure-modes.md#a-locked-or-slow-policy-table))",
    )
    import_max_size = Setting(
        "10MB",
        parse.size,
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
        parse.dotted_callable,
        id="ratelimits.E121",
        old="API_KEY_FUNC",
        doc="`(request.auth) -> str or None`: what identifies the credential DRF authenticated with. Default: model "
        "instances by class and primary key, anything else by `str()`",
    )
    api_key_model = Setting(
        None,
        parse.model,
        id="ratelimits.E122",
        old="API_KEY_MODEL",
        doc='`"app_label.Model"` of your API keys: the admin suggests them when picking a subject, and the effective '
        "policy page and `ratelimits_effective` find a key's object from its identifier",
    )
    organization_func = Setting(
        "ratelimits.identity.no_organization",
        parse.dotted_callable,
        id="ratelimits.E123",
        old="ORGANIZATION_FUNC",
        doc="`(request) -> str or None`: the caller's organisation, which `DIMENSIONS['org']` limits",
    )
    trusted_proxies = Setting(
        [],
        parse.networks,
        id="ratelimits.E124",
        old="TRUSTED_PROXIES",
        doc="addresses or networks of your proxies ([security](security.md))",
    )
    client_ip_header = Setting(
        "HTTP_X_FORWARDED_FOR",
        parse.meta_key,
        id="ratelimits.E125",
        old="CLIENT_IP_HEADER",
        doc="the `request.META` key your proxies append the client address to (upper case, underscores)",
    )
    ipv6_prefix = Setting(
        64,
        parse.ipv6_prefix,
        id="ratelimits.E126",
        old="IPV6_PREFIX",
        doc="IPv6 clients are limited per network of this size",
    )
    hash_key = Setting(
        None,
        parse.hash_key,
        id="ratelimits.E127",
        old="HASH_KEY",
        shown="`SECRET_KEY`",
        doc="key of the hash that turns identities into key names; a non-empty string",
    )
    failed_auth = Setting(
        None,
        parse.failed_auth,
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
        parse.choice(HEADER_STYLES),
        id="ratelimits.E128",
        doc='`"ietf"` (`RateLimit`, `RateLimit-Policy`), `"github"` (`X-RateLimit-*`), `"both"` or `"none"`',
    )
    policies = Setting(
        "all",
        parse.choice(HEADER_POLICY_CHOICES),
        id="ratelimits.E148",
        old="HEADER_POLICIES",
        doc='what `RateLimit-Policy` lists: `"all"`, every enforced policy of the request in the order of its '
        'checks; `"closest"`, only the policy `RateLimit` names. `RateLimit` and the GitHub headers always describe '
        "the closest",
    )
    partition_key = Setting(
        False,
        parse.boolean,
        id="ratelimits.E149",
        old="HEADER_PARTITION_KEY",
        doc="each item of `RateLimit-Policy` and `RateLimit` carries `pk`, a Byte Sequence of the keyed hash that "
        "names the policy's subject in key names (never the identity itself)",
    )
    retry_after_jitter_us = Setting(
        "0ms",
        parse.jitter_us,
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
        parse.fail_mode,
        id="ratelimits.E130",
        old="DEFAULT_FAIL_MODE",
        doc='the fail mode of policies that name none: `"open"` (admit), `"closed"` (503) or `"local"` (decide in '
        "the process against its share)",
    )
    local_share = Setting(
        1.0,
        parse.share,
        id="ratelimits.E131",
        old="LOCAL_FALLBACK_SHARE",
        doc="the share of a policy one process enforces under fail mode `local` (e.g. `0.25` with four workers)",
    )
    breaker_window = Setting(
        20, parse.positive_int, id="ratelimits.E132", old="BREAKER_WINDOW", doc="outcomes the circuit breaker remembers"
    )
    breaker_min_calls = Setting(
        5,
        parse.positive_int,
        id="ratelimits.E133",
        old="BREAKER_MIN_CALLS",
        after=_min_calls,
        doc="outcomes needed before it may open (at most `BREAKER_WINDOW`)",
    )
    breaker_failure_rate = Setting(
        0.5, parse.share, id="ratelimits.E134", old="BREAKER_FAILURE_RATE", doc="the share of failures that opens it"
    )
    breaker_cooldown = Setting(
        "2s", parse.seconds, id="ratelimits.E135", old="BREAKER_COOLDOWN", doc="how long it stays open before one probe"
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
    ceiling = _root(namespace).shedding.worker_capacity
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
        parse.optional_positive_int,
        id="ratelimits.E160",
        old=("ADAPTIVE_CAPACITY", "floor"),
        after=_adaptive_floor,
        shown="a quarter of `WORKER_CAPACITY`",
        doc="the least capacity it is cut to, and where it starts; at most `WORKER_CAPACITY`",
    )
    tolerance = Setting(
        _ADAPTIVE.tolerance,
        parse.tolerance,
        id="ratelimits.E161",
        old=("ADAPTIVE_CAPACITY", "tolerance"),
        doc="how much slower than its usual latency an endpoint may answer before the capacity is cut (above 1, at "
        "most 10)",
    )
    window = Setting(
        "500ms",
        parse.seconds,
        id="ratelimits.E162",
        old=("ADAPTIVE_CAPACITY", "window"),
        doc="the responses each adjustment is made from",
    )
    min_samples = Setting(
        _ADAPTIVE.min_samples,
        parse.positive_int,
        id="ratelimits.E163",
        old=("ADAPTIVE_CAPACITY", "min_samples"),
        doc="responses of an endpoint it takes to judge it",
    )
    error_rate = Setting(
        _ADAPTIVE.error_rate,
        parse.share,
        id="ratelimits.E164",
        old=("ADAPTIVE_CAPACITY", "error_rate"),
        doc="the share of 5xx above the usual share that cuts",
    )
    timeout = Setting(
        None,
        parse.optional_seconds,
        id="ratelimits.E165",
        old=("ADAPTIVE_CAPACITY", "timeout"),
        doc="a response slower than this counts as an error",
    )
    probe_interval = Setting(
        "60s",
        parse.seconds,
        id="ratelimits.E166",
        old=("ADAPTIVE_CAPACITY", "probe_interval"),
        doc="after a cut, how long the capacity stays below the level it was cut at",
    )

    @cached_property
    def settings(self) -> AdaptiveSettings | None:
        """The adaptive capacity's parameters, its floor filled in; ``None`` when it is off."""
        if not self.enabled:
            return None
        ceiling = _root(self).shedding.worker_capacity
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
        parse.optional_positive_int,
        id="ratelimits.E115",
        old="FLEET_CAPACITY",
        doc="settings source: requests in flight the fleet can serve; `None` disables the fleet shedder",
    )
    fleet_shards = Setting(
        1,
        parse.positive_int,
        id="ratelimits.E142",
        old="FLEET_SHARDS",
        doc="both sources: how many keys the fleet's in-flight set is split over, each counting its share of every "
        "class's limit (hot-key sharding, for a Redis Cluster). Each sheddable class must keep one slot per shard",
    )
    thresholds = Setting(
        {"low": 60, "normal": 75, "high": 90},
        parse.thresholds,
        id="ratelimits.E116",
        old="SHED_THRESHOLDS",
        doc="the percent of capacity at which each class is shed (the fleet's, with the settings source, and each "
        "worker's)",
    )
    tenant_share = Setting(
        50,
        parse.percent,
        id="ratelimits.E179",
        doc="both sources: the percent of the fleet's capacity one tenant (its organisation, else the caller) may "
        "hold in flight; beyond it the tenant's own requests are limited (429), never everyone's shed (503). "
        "100: no tenant cap",
    )
    worker_capacity = Setting(
        None,
        parse.optional_positive_int,
        id="ratelimits.E117",
        old="WORKER_CAPACITY",
        doc="requests one worker process serves at once; enables the worker shedder (with `ADAPTIVE`: the most its "
        "capacity reaches)",
    )
    slot_ttl_us = Setting(
        "60s",
        parse.duration_us,
        key="SLOT_TTL",
        id="ratelimits.E114",
        old="SLOT_TTL",
        doc="the longest a request holds its slots (a request in flight): its worker stops renewing them then; "
        "well above the slowest request",
    )
    slot_lease_us = Setting(
        "3s",
        parse.duration_us,
        key="SLOT_LEASE",
        id="ratelimits.E181",
        doc="how long a slot outlives the last renewal of its worker's heartbeat (every third of it): a killed "
        "worker's slots come back within it",
    )
    body_timeout = Setting(
        "10s",
        parse.seconds,
        id="ratelimits.E180",
        doc="how long a request's body (up to `DATA_UPLOAD_MAX_MEMORY_SIZE`) may take to arrive before the request "
        "is decided, under gunicorn; a body late is a 408 that holds nothing",
    )
    adaptive = Mount(Adaptive)


class Notices(Switchable):
    """``USAGE['NOTICES']``: customers told when they near a quota or keep being refused."""

    doc = (
        "`True` (the default), `False`, or a dict: notices when a subject crosses a share of a quota or is refused "
        "again and again, sent as a signal, listed in the admin and delivered to the customer's signed webhooks "
        "([notices](notices.md))"
    )
    id = "ratelimits.E184"
    switch = True

    quota_thresholds = Setting(
        [80, 100],
        parse.quota_percents,
        id="ratelimits.E185",
        doc="the percentages of a quota by billing period (1 to 100) whose crossing is a notice, once per period; "
        "`[]`: none",
    )
    refusals = Setting(
        100,
        parse.optional_positive_int,
        id="ratelimits.E186",
        doc="a subject refused (429) this many times within `REFUSALS_WITHIN` is a notice, at most once a clock "
        "hour; `None`: never. Read from the drained usage records",
    )
    refusals_within = Setting(
        "5m",
        parse.refusal_window,
        id="ratelimits.E187",
        doc="the window `REFUSALS` counts refusals in: whole minutes (usage is counted by the minute), at most an hour",
    )
    every = Setting(
        "10s",
        parse.seconds,
        id="ratelimits.E188",
        doc="how often the periodic work sends the deliveries due and looks for refusals: the Celery beat entry "
        "`ratelimits.periodic.beat_schedule()` gives, and `manage.py ratelimits_drain` runs",
    )
    timeout = Setting(
        "5s", parse.seconds, id="ratelimits.E189", doc="how long one delivery attempt waits for the receiver"
    )
    retry_first = Setting(
        "30s", parse.seconds, id="ratelimits.E190", doc="the wait before a failed delivery's first retry; each doubles"
    )
    retry_longest = Setting("1h", parse.seconds, id="ratelimits.E191", doc="the longest wait between two retries")
    retry_for = Setting(
        "3d",
        parse.seconds,
        id="ratelimits.E192",
        doc="how long a delivery is retried before it is given up (a receiver down for an hour, or a weekend, "
        "loses nothing)",
    )
    allow_private_urls = Setting(
        False,
        parse.boolean,
        id="ratelimits.E193",
        doc="`True` lets a webhook URL lead to a loopback, private or link-local address: for development and tests. "
        "Off, such a URL is refused when saved and when sent to (a customer's URL must not reach the fleet's own "
        "services)",
    )


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
        parse.positive_int,
        id="ratelimits.E139",
        old="USAGE_MAX_SUBJECTS",
        doc="the most rows (a caller on an endpoint) one minute of usage counts; a new row beyond them is counted in "
        "the overflow row of its caller kind and endpoint",
    )
    flush_every = Setting(
        None,
        parse.flush_every,
        id="ratelimits.E182",
        doc="`None` (the default): each decision's usage is counted in its own script call, exactly. A duration "
        "(`\"1s\"`): each worker counts its decisions' usage itself and adds it to the store's counters at most "
        "that often (at most a minute), in one call, after a response; Redis does less per decision, and a worker "
        "killed (not one that exits) loses what it counted since its last addition",
    )
    drain_every = Setting(
        "30s",
        parse.seconds,
        id="ratelimits.E178",
        doc="how often the periodic work drains the counters into the database: the Celery beat entry "
        "`ratelimits.periodic.beat_schedule()` gives, and `manage.py ratelimits_drain`'s default `--every`",
    )
    notices = Mount(Notices)


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
        parse.boolean,
        id="ratelimits.E167",
        old=("LOCAL_PATH", "denials"),
        doc="refuse from memory a check the store denied, until its wait has passed (exact)",
    )
    leases = Setting(
        _LOCAL.leases,
        parse.boolean,
        id="ratelimits.E168",
        old=("LOCAL_PATH", "leases"),
        doc=(
            "lease tokens in the decide call for requests a worker makes often (every check a token bucket or "
            "fixed window) and spend them locally"
        ),
    )
    lease_ttl = Setting(
        "500ms",
        parse.lease_ttl,
        id="ratelimits.E169",
        old=("LOCAL_PATH", "lease_ttl"),
        doc="how long a lease lasts, at most 1 s",
    )
    lease_share = Setting(
        _LOCAL.lease_share,
        parse.share,
        id="ratelimits.E170",
        old=("LOCAL_PATH", "lease_share"),
        doc="the most of a limit's capacity one lease takes",
    )
    max_entries = Setting(
        _LOCAL.max_entries,
        parse.positive_int,
        id="ratelimits.E171",
        old=("LOCAL_PATH", "max_entries"),
        doc=(
            "denials one worker remembers, and credentials, and the resolutions it counts requests of for leases"
            " (on a Redis Cluster, the state keys too)"
        ),
    )
    header = Setting(
        _LOCAL.header,
        parse.boolean,
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
        parse.region_stores,
        id="ratelimits.E145",
        doc="every region of the fleet and its store's Redis URL: "
        '`{"eu": "redis://...", "us": "redis+cluster://..."}`. With two or more, a policy with `"scope": "global"` is '
        "one limit shared by all of them",
    )
    current = Setting(
        None,
        parse.region,
        id="ratelimits.E144",
        old="REGION",
        after=_this_region,
        doc="this deployment's region: required, and one of `STORES`, once `STORES` is set",
    )
    reconcile_interval = Setting(
        "1s",
        parse.seconds,
        id="ratelimits.E146",
        old=("RECONCILE", "interval"),
        doc="seconds between two rounds of the reconciler (`ratelimits.tasks.BEAT_SCHEDULE` reads it)",
    )
    share_floor = Setting(
        _RECONCILE.floor,
        parse.share_floor,
        id="ratelimits.E173",
        old=("RECONCILE", "floor"),
        doc="the least share a reachable region keeps (below 0.5)",
    )
    stale_after = Setting(
        "10s",
        parse.seconds,
        id="ratelimits.E174",
        old=("RECONCILE", "stale_after"),
        doc="a share above the even split not rewritten for this long starts to decay down",
    )
    decay = Setting(
        "30s",
        parse.seconds,
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
        parse.optional_boolean,
        id="ratelimits.E176",
        old=("METRICS", "multiprocess"),
        doc="`None`: on when `PROMETHEUS_MULTIPROC_DIR` is set; `True` requires it; `False` says one process serves",
    )
    flush_interval = Setting(
        "1s",
        parse.flush_interval,
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


class Settings(Root):
    """Typed, validated, cached access to ``settings.RATELIMITS``: the root namespace (:data:`conf`)."""

    doc = "every setting of ratelimits"

    enabled = Setting(
        True,
        parse.boolean,
        id="ratelimits.E151",
        doc="`False` admits every request without asking the store, and sends no rate-limit headers: for a "
        "project's own test suite ([testing](testing.md))",
    )
    backend = Setting(
        None,
        parse.text,
        id="ratelimits.E101",
        derive=_backend_default,
        shown='`"redis"` if `REDIS` says where, else `"memory"`',
        doc='`"redis"`, `"memory"` (one process only: warned about outside `DEBUG`, `ratelimits.W001`) or a dotted '
        "path to a `Backend` subclass",
    )
    tiers = Setting(
        {"anonymous": {"rate": "20/s", "burst": 40}, "authenticated": {"rate": "100/s", "burst": 200}},
        parse.tiers,
        id="ratelimits.E110",
        shown="anonymous 20/s burst 40, authenticated 100/s burst 200 (or DRF's `anon` and `user` rates)",
        doc='tier name → policy; a policy may say `"scope": "global"` (one limit across every region, '
        "[regions](regions.md))",
    )
    dimensions = Setting(
        {},
        parse.dimensions,
        id="ratelimits.E113",
        doc="subject kind (`ip`, `user`, `api_key`, `org`) → policy applied to every request that has that subject",
    )
    endpoints = Setting(
        {},
        parse.mapping,
        id="ratelimits.E119",
        shown="`{}` (or DRF's scoped rates)",
        doc="endpoint → rule ([below](#endpoints)): its cost, priority and limits, and which responses it charges",
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


Settings.mount()
#: Every setting, by its name (``"REDIS.URL"``), in the order docs/configuration.md lists them.
SETTINGS = Settings.by_name
#: Every namespace, by its name (``"SHEDDING.ADAPTIVE"``).
NAMESPACES: dict[str, type[Namespace]] = {
    namespace.name(): namespace for namespace in Settings.by_path.values() if namespace.path
}


def id_of(name: str) -> str | None:
    """The check id of a setting or namespace named as :attr:`ConfigurationError.setting` names it."""
    if name in SETTINGS:
        return SETTINGS[name].id
    return NAMESPACES[name].id if name in NAMESPACES else None


conf = Settings()


def reference() -> str:
    """docs/configuration.md's tables of every setting, in Markdown, written from the declarations above."""
    return _reference(Settings)


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


def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting in ("RATELIMITS", "SECRET_KEY", "CACHES"):
        conf.clear()
    if setting in ("RATELIMITS", "CACHES"):
        ProcessWide.reset_all()


setting_changed.connect(_reset, dispatch_uid="ratelimits.conf.reset")
