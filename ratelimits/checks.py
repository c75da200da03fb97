"""System checks: every setting validated at start-up, each under an id of its own.

A bad value fails ``manage.py check`` (and ``runserver``, ``migrate``...) with a message naming the
setting, never the first request. Ids are never reused: one retired is kept here, marked so.
"""

from __future__ import annotations

import difflib
import ssl
from typing import Any

import redis
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register

from .backends import backend_class, get_backend
from .backends.redis import RedisBackend
from .conf import (
    ADAPTIVE_CAPACITY,
    BACKEND,
    MULTIPROC_ENV,
    POLICY_SOURCE,
    REGION,
    REGIONS,
    SETTINGS,
    WORKER_CAPACITY,
    conf,
)
from .exceptions import BackendUnavailable, ConfigurationError
from .policies.settings import dimensions_from_settings
from .policies.source import get_policy_source

__all__ = [
    "E001",
    "E002",
    "E003",
    "E004",
    "I001",
    "SETTING_IDS",
    "W001",
    "W002",
    "W003",
    "W004",
    "W005",
    "W006",
    "W007",
    "W020",
    "check_deployment",
    "check_django_ratelimit_settings",
    "check_settings",
    "check_store",
]

#: Every id these checks report. Tests assert the exact ids a misconfiguration produces.
E001 = "ratelimits.E001"  # a key of RATELIMITS that is no setting
E002 = "ratelimits.E002"  # retired after 0.1.0: any invalid value (each setting has its own id now)
E003 = "ratelimits.E003"  # RATELIMITS is not a dict
E004 = "ratelimits.E004"  # the limiter's Redis refused its credentials, or its TLS handshake failed
W001 = "ratelimits.W001"  # memory backend outside DEBUG
W002 = "ratelimits.W002"  # throttle installed without the problem+json exception handler
W003 = "ratelimits.W003"  # a setting is set that the configured policy source does not read
W004 = "ratelimits.W004"  # the limiter's Redis may evict its keys (a maxmemory-policy other than noeviction)
W005 = "ratelimits.W005"  # FAILED_AUTH is set but its middleware is not installed
W006 = "ratelimits.W006"  # ADAPTIVE_CAPACITY is set but EarlyRejectionMiddleware (which sees 5xx) is not
W007 = "ratelimits.W007"  # METRICS is on outside DEBUG without prometheus-client's multiprocess mode
I001 = "ratelimits.I001"  # the limiter's Redis answers but will not say its maxmemory-policy
W020 = "ratelimits.W020"  # a django-ratelimit setting (RATELIMIT_...), which nothing here reads
#: The id of each setting's invalid value. A new setting takes the next free number.
SETTING_IDS: dict[str, str] = {
    "ENABLED": "ratelimits.E151",
    "BACKEND": "ratelimits.E101",
    "REDIS_URL": "ratelimits.E102",
    "REDIS_SOCKET_TIMEOUT": "ratelimits.E103",
    "REDIS_CONNECT_TIMEOUT": "ratelimits.E104",
    "REDIS_OPTIONS": "ratelimits.E140",
    "REDIS_CLIENT": "ratelimits.E141",
    "KEY_PREFIX": "ratelimits.E105",
    "CLOCK": "ratelimits.E106",
    "POLICY_SOURCE": "ratelimits.E107",
    "POLICY_POLL_INTERVAL": "ratelimits.E108",
    "POLICY_RECHECK_INTERVAL": "ratelimits.E109",
    "POLICY_LOAD_TIMEOUT": "ratelimits.E136",
    "TIERS": "ratelimits.E110",
    "DEFAULT_TIERS": "ratelimits.E111",
    "TIER_FUNC": "ratelimits.E112",
    "DIMENSIONS": "ratelimits.E113",
    "SLOT_TTL": "ratelimits.E114",
    "FLEET_CAPACITY": "ratelimits.E115",
    "FLEET_SHARDS": "ratelimits.E142",
    "SHED_THRESHOLDS": "ratelimits.E116",
    "WORKER_CAPACITY": "ratelimits.E117",
    "ADAPTIVE_CAPACITY": "ratelimits.E147",
    "USAGE": "ratelimits.E118",
    "USAGE_MAX_SUBJECTS": "ratelimits.E139",
    "ENDPOINTS": "ratelimits.E119",
    "EXEMPT_ENDPOINTS": "ratelimits.E120",
    "API_KEY_FUNC": "ratelimits.E121",
    "API_KEY_MODEL": "ratelimits.E122",
    "ORGANIZATION_FUNC": "ratelimits.E123",
    "TRUSTED_PROXIES": "ratelimits.E124",
    "CLIENT_IP_HEADER": "ratelimits.E125",
    "IPV6_PREFIX": "ratelimits.E126",
    "HASH_KEY": "ratelimits.E127",
    "HEADERS": "ratelimits.E128",
    "HEADER_POLICIES": "ratelimits.E148",
    "HEADER_PARTITION_KEY": "ratelimits.E149",
    "RETRY_AFTER_JITTER": "ratelimits.E129",
    "DEFAULT_FAIL_MODE": "ratelimits.E130",
    "LOCAL_FALLBACK_SHARE": "ratelimits.E131",
    "LOCAL_PATH": "ratelimits.E143",
    "BREAKER_WINDOW": "ratelimits.E132",
    "BREAKER_MIN_CALLS": "ratelimits.E133",
    "BREAKER_FAILURE_RATE": "ratelimits.E134",
    "BREAKER_COOLDOWN": "ratelimits.E135",
    "FAILED_AUTH": "ratelimits.E137",
    "IMPORT_MAX_SIZE": "ratelimits.E138",
    "REGION": "ratelimits.E144",
    "REGIONS": "ratelimits.E145",
    "RECONCILE": "ratelimits.E146",
    "METRICS": "ratelimits.E150",
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every RATELIMITS key is a setting and every value is valid; then the policies build."""
    try:
        user = conf.user_settings
    except ConfigurationError as exc:
        return [Error(str(exc), id=E003)]
    messages: list[CheckMessage] = [
        Error(f"RATELIMITS[{key!r}] is not a ratelimits setting", hint=_known_hint(key), id=E001)
        for key in sorted(set(user) - set(SETTINGS))
    ]
    invalid = set()
    for name, setting in SETTINGS.items():
        try:
            conf.value(setting)
            if name == BACKEND.name:  # an alias or a dotted path: is it a Backend?
                backend_class(conf.backend)
        except ConfigurationError as exc:
            invalid.add(name)
            messages.append(Error(str(exc), id=SETTING_IDS[exc.setting or name]))
    if not invalid & {REGION.name, REGIONS.name}:
        try:
            _ = conf.region  # one of REGIONS, and named whenever REGIONS is set
        except ConfigurationError as exc:
            invalid.add(REGION.name)
            messages.append(Error(str(exc), id=SETTING_IDS[REGION.name]))
    if not invalid & {ADAPTIVE_CAPACITY.name, WORKER_CAPACITY.name}:
        try:
            _ = conf.adaptive_capacity  # needs WORKER_CAPACITY, and a floor no higher
        except ConfigurationError as exc:
            invalid.add(ADAPTIVE_CAPACITY.name)
            messages.append(Error(str(exc), id=SETTING_IDS[ADAPTIVE_CAPACITY.name]))
    if not invalid:
        # Policies build on the settings above: report them only once those are sound. The
        # backstops apply under any source (the database source loads them on first use). The
        # source built is the process's own: its first request finds it built.
        try:
            dimensions_from_settings(conf.default_fail_mode)
            get_policy_source()
        except ConfigurationError as exc:
            messages.append(Error(str(exc), id=SETTING_IDS.get(exc.setting or "", SETTING_IDS[POLICY_SOURCE.name])))
    return messages


def _known_hint(key: str) -> str | None:
    close = difflib.get_close_matches(key.upper(), SETTINGS, n=1)
    return f"Did you mean {close[0]!r}?" if close else None


@register(Tags.compatibility)
def check_deployment(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about set-ups that work in development but not behind several workers."""
    messages: list[CheckMessage] = []
    try:
        backend = conf.backend
        source = get_policy_source()
        failed_auth = conf.failed_auth
        adaptive = conf.adaptive_capacity
        metrics = conf.metrics
    except ConfigurationError:
        return messages  # check_settings reports it
    if backend == "memory" and not settings.DEBUG:
        messages.append(
            Warning(
                "RATELIMITS['BACKEND'] is 'memory': every worker process counts on its own.",
                hint="Use the 'redis' backend in production.",
                id=W001,
            )
        )
    rest = getattr(settings, "REST_FRAMEWORK", {}) or {}
    throttles = rest.get("DEFAULT_THROTTLE_CLASSES", ())
    if (
        "ratelimits.throttles.RateLimitThrottle" in throttles
        and rest.get("EXCEPTION_HANDLER") != "ratelimits.drf.exception_handler"
    ):
        messages.append(
            Warning(
                "RateLimitThrottle is installed but 429 bodies will be DRF's default JSON, not problem+json.",
                hint="Set REST_FRAMEWORK['EXCEPTION_HANDLER'] = 'ratelimits.drf.exception_handler'.",
                id=W002,
            )
        )
    middleware = "ratelimits.middleware.FailedAuthenticationMiddleware"
    if failed_auth is not None and middleware not in settings.MIDDLEWARE:
        messages.append(
            Warning(
                "RATELIMITS['FAILED_AUTH'] is set, but nothing counts failed authentication.",
                hint=f"Add {middleware!r} to MIDDLEWARE, first (before sessions and authentication).",
                id=W005,
            )
        )
    early = "ratelimits.middleware.EarlyRejectionMiddleware"
    if adaptive is not None and early not in settings.MIDDLEWARE:
        messages.append(
            Warning(
                "RATELIMITS['ADAPTIVE_CAPACITY'] is set, but no middleware tells it the views' 5xx responses: "
                "the capacity follows latency only.",
                hint=f"Add {early!r} to MIDDLEWARE, first.",
                id=W006,
            )
        )
    if metrics is not None and not metrics.multiprocess and not metrics.declared and not settings.DEBUG:
        messages.append(
            Warning(
                f"RATELIMITS['METRICS'] is on, but {MULTIPROC_ENV} is not set: under gunicorn, uWSGI or any "
                "server with several processes, each worker counts alone and a scrape shows one of them.",
                hint=f"Set {MULTIPROC_ENV} to an empty directory before the server starts (docs/metrics.md), "
                "or RATELIMITS['METRICS'] = {'multiprocess': False} if one process serves.",
                id=W007,
            )
        )
    ignored = [name for name in source.ignored_settings if name in SETTINGS and conf.is_set(SETTINGS[name])]
    if ignored:
        messages.append(
            Warning(
                f"{', '.join(f'RATELIMITS[{n!r}]' for n in ignored)} set, but the policy source "
                f"{type(source).__name__} does not read them.",
                hint="Configure them where the source reads them (the admin, for the database source), or remove them.",
                id=W003,
            )
        )
    return messages


def _refused(exc: BaseException) -> str | None:
    """What a store error says about the limiter's own configuration (``None``: it is just unreachable)."""
    cause = exc.__cause__
    for _ in range(10):  # a chain is short; the bound only guards against a cycle
        if cause is None:
            break
        if isinstance(cause, (redis.AuthenticationError, redis.exceptions.NoPermissionError)):
            return "refused the limiter's credentials"
        if isinstance(cause, ssl.SSLError):
            return "could not be reached over TLS as configured"
        cause = cause.__cause__ or cause.__context__
    return None


@register(Tags.compatibility)
def check_store(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn when the limiter's Redis may evict its keys: an evicted bucket restarts full, unseen.

    Best effort, within the client's own tight timeouts: a store that cannot be reached now says
    nothing here (the first request degrades and logs it), and one that will not say its policy
    gets a note, never an error.
    """
    try:
        if not issubclass(backend_class(conf.backend), RedisBackend):
            return []
        health = get_backend().store_health()
    except ConfigurationError:
        return []  # check_settings reports it
    except BackendUnavailable as exc:
        refusal = _refused(exc)
        if refusal is None:
            return []
        return [
            Error(
                f"The limiter's Redis (RATELIMITS['REDIS_URL']) {refusal}: {exc}",
                hint="Give the limiter's ACL user and password in REDIS_URL (redis://user:password@host) or "
                "REDIS_OPTIONS, and the TLS files in REDIS_OPTIONS: see docs/configuration.md.",
                id=E004,
            )
        ]
    if health is None or health.evicts is False:
        return []
    if health.evicts is None:
        return [
            Info(
                "The limiter's Redis did not say its maxmemory-policy (CONFIG and INFO refused).",
                hint="Make sure it is noeviction: see docs/failure-modes.md.",
                id=I001,
            )
        ]
    return [
        Warning(
            f"The limiter's Redis has maxmemory-policy {health.maxmemory_policy!r}: when its memory is full it "
            "evicts the limiter's keys, an evicted bucket restarts full, and callers get past their limits unseen.",
            hint="Give the limiter a Redis of its own with maxmemory-policy noeviction and maxmemory sized for its "
            "keys: see docs/failure-modes.md.",
            id=W004,
        )
    ]


#: django-ratelimit's settings, which nothing here reads, and what does their work here.
DJANGO_RATELIMIT_SETTINGS = {
    "RATELIMIT_ENABLE": "RATELIMITS['ENABLED']",
    "RATELIMIT_USE_CACHE": "RATELIMITS['REDIS']['CACHE'] (the limiter takes that cache's Redis, not the cache)",
    "RATELIMIT_CACHE_PREFIX": "RATELIMITS['REDIS']['KEY_PREFIX']",
    "RATELIMIT_VIEW": (
        "none: a request over a blocking limit is answered 429 with a problem+json body; to answer it "
        "yourself, use block=False and read request.limited in the view"
    ),
    "RATELIMIT_EXCEPTION_CLASS": (
        "none: nothing is raised, a request over a blocking limit is answered 429; to answer it "
        "yourself, use block=False and read request.limited in the view"
    ),
    "RATELIMIT_FAIL_OPEN": "RATELIMITS['FAILURE']['DEFAULT_MODE'] ('open', 'closed' or 'local')",
    "RATELIMIT_IP_META_KEY": (
        "RATELIMITS['IDENTITY']['CLIENT_IP_HEADER'], read only from RATELIMITS['IDENTITY']['TRUSTED_PROXIES'] "
        "(a header anyone can send is believed from your proxies only)"
    ),
    "RATELIMIT_IPV4_MASK": "none: IPv4 addresses count one by one; a key callable can group them",
    "RATELIMIT_IPV6_MASK": "RATELIMITS['IDENTITY']['IPV6_PREFIX'] (64 by default, as there)",
    "RATELIMIT_HASH_ALGORITHM": "RATELIMITS['IDENTITY']['HASH_KEY'] (keys are keyed BLAKE2b hashes)",
}


@register(Tags.compatibility)
def check_django_ratelimit_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about each django-ratelimit setting left in the project: here it would do nothing, unseen."""
    return [
        Warning(
            f"{name} is django-ratelimit's setting: ratelimits does not read it.",
            hint=f"Its equivalent here: {equivalent}. Remove it once django-ratelimit is gone, or silence "
            f"{W020} while both run (docs/migrating-from-django-ratelimit.md).",
            id=W020,
        )
        for name, equivalent in DJANGO_RATELIMIT_SETTINGS.items()
        if hasattr(settings, name)
    ]
