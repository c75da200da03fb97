"""System checks: every setting validated at start-up, each under an id of its own.

A bad value fails ``manage.py check`` (and ``runserver``, ``migrate``...) with a message naming the
setting, never the first request. Ids are never reused: one retired is kept here, marked so.
"""

from __future__ import annotations

import contextlib
import difflib
import dis
import functools
import ssl
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import redis
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, router
from django.db.migrations.executor import MigrationExecutor
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string
from rest_framework.views import APIView

from . import documentation, drf, periodic
from .backends import (
    CAPABILITIES,
    Backend,
    BulletinSupport,
    HealthSupport,
    LeaseSupport,
    RegionSupport,
    SettleSupport,
    UsageSupport,
    backend_class,
    get_backend,
)
from .backends.redis import RedisBackend
from .conf import (
    MULTIPROC_ENV,
    RETIRED_POLICY_SOURCES,
    SETTINGS,
    Adaptive,
    Finding,
    Identity,
    LocalPath,
    Metrics,
    Policies,
    Redis,
    Regions,
    Settings,
    Usage,
    conf,
    id_of,
)
from .endpoints import DrfRoute, drf_routes, route_endpoints
from .exceptions import BackendUnavailable, ConfigurationError
from .models import WebhookEndpoint
from .policies.settings import SettingsPolicySource, dimensions_from_settings
from .policies.source import get_policy_source
from .policies.throttle_rates import SETTING as DRF_RATES
from .policies.throttle_rates import throttle_rates
from .store.database import DatabasePolicySource
from .throttles import RateLimitThrottle, class_policies
from .usage.live import stale_since

__all__ = [
    "E001",
    "E002",
    "E003",
    "E004",
    "E006",
    "E007",
    "E008",
    "E183",
    "I001",
    "I002",
    "SETTING_IDS",
    "W001",
    "W002",
    "W003",
    "W004",
    "W005",
    "W006",
    "W007",
    "W008",
    "W009",
    "W010",
    "W011",
    "W012",
    "W013",
    "W014",
    "W015",
    "W016",
    "W017",
    "W018",
    "W020",
    "W021",
    "W022",
    "W024",
    "check_capabilities",
    "check_database",
    "check_deployment",
    "check_django_ratelimit_settings",
    "check_drain",
    "check_endpoints",
    "check_settings",
    "check_store",
    "check_throttle_settings",
    "composes_problems",
    "unapplied_migrations",
]

#: Every id these checks report. Tests assert the exact ids a misconfiguration produces.
E001 = "ratelimits.E001"  # a key of RATELIMITS that is no setting
E002 = "ratelimits.E002"  # retired after 0.1.0: any invalid value (each setting has its own id now)
E003 = "ratelimits.E003"  # RATELIMITS is not a dict
E004 = "ratelimits.E004"  # the limiter's Redis refused its credentials, or its TLS handshake failed
E005 = "ratelimits.E005"  # retired before release: a setting under both names is W015
W001 = "ratelimits.W001"  # memory (or another per-process backend) outside DEBUG
W002 = "ratelimits.W002"  # throttle installed without the problem+json exception handler
W003 = "ratelimits.W003"  # a setting is set that the configured policy source does not read
W004 = "ratelimits.W004"  # the limiter's Redis may evict its keys (a maxmemory-policy other than noeviction)
W005 = "ratelimits.W005"  # IDENTITY['FAILED_AUTH'] is set but its middleware is not installed
W006 = "ratelimits.W006"  # SHEDDING['ADAPTIVE'] is set but EarlyRejectionMiddleware (which sees 5xx) is not
W007 = "ratelimits.W007"  # METRICS is on outside DEBUG without prometheus-client's multiprocess mode
W008 = "ratelimits.W008"  # a setting under the name 0.1 gave it (read until 0.3)
W009 = "ratelimits.W009"  # REDIS says where a Redis is, but BACKEND is 'memory'
I001 = "ratelimits.I001"  # the limiter's Redis answers but will not say its maxmemory-policy
I002 = "ratelimits.I002"  # the limiter's Redis did not answer the checks (requests follow their fail modes)
W015 = "ratelimits.W015"  # a setting given under both its name and the name 0.1 gave it (the new one is read)
W020 = "ratelimits.W020"  # a django-ratelimit setting (RATELIMIT_...), which nothing here reads
W021 = "ratelimits.W021"  # in DEBUG: usage counted minutes ago is still undrained, and no beat schedule drains it
E183 = "ratelimits.E183"  # a setting needs a capability (leases, usage, the bulletin, regions) the backend lacks
W023 = "ratelimits.W023"  # a backend class with a capability's methods but not the capability among its bases
W022 = "ratelimits.W022"  # POLICIES['SOURCE'] names where the database source used to be (read until 0.3)
W024 = "ratelimits.W024"  # webhook endpoints are enabled in the admin, but USAGE['NOTICES'] is off
#: The id of each setting's invalid value (declared with the setting, in ratelimits.conf).
SETTING_IDS: dict[str, str] = {name: setting.id for name, setting in SETTINGS.items()}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every RATELIMITS key is a setting and every value is valid; then the policies build."""
    try:
        conf.user_settings  # noqa: B018
    except ConfigurationError as exc:
        return [Error(str(exc), id=E003)]
    messages: list[CheckMessage] = [_finding(finding) for finding in conf.findings()]
    invalid: set[str] = set()
    reported: set[tuple[str, str]] = set()

    def read(what: Callable[[], object], name: str) -> None:
        try:
            what()
        except ConfigurationError as exc:
            at = exc.setting or name
            invalid.add(at)
            check_id = id_of(at) or FOREIGN_IDS.get(at) or SETTING_IDS[name]
            if (check_id, str(exc)) not in reported:  # a namespace of the wrong shape fails each of its settings
                reported.add((check_id, str(exc)))
                messages.append(Error(str(exc), id=check_id))

    for name, setting in SETTINGS.items():
        read(functools.partial(conf.read, setting), name)
    # What needs several settings at once: the adaptive capacity its ceiling, metrics their environment.
    read(lambda: conf.redis.address, Redis.cache.name)  # a CACHES alias read as an address
    read(lambda: conf.shedding.adaptive.settings, Adaptive.name())
    read(lambda: conf.metrics.settings, Metrics.name())
    if Settings.backend.name not in invalid:
        read(lambda: backend_class(conf.backend), Settings.backend.name)  # an alias or a dotted path: a Backend?
    if not invalid:
        # Policies build on the settings above: report them only once those are sound. The
        # backstops apply under any source (the database source loads them on first use). The
        # source built is the process's own: its first request finds it built.
        read(lambda: (dimensions_from_settings(conf.failure.default_mode), get_policy_source()), Policies.source.name)
    read(throttle_rates, DRF_RATES)  # whatever the source: a rate DRF could not read either
    return messages


def _shared(backend: str) -> bool:
    """Whether the backend ``BACKEND`` names shares its state between processes (an unknown one: say so)."""
    try:
        return backend_class(backend).shared
    except ConfigurationError:
        return True  # check_settings reports it


def _finding(finding: Finding) -> CheckMessage:
    if finding.kind == "unknown":
        return Error(finding.message, hint=finding.hint, id=E001)
    if finding.kind == "renamed":
        return Warning(finding.message, hint=finding.hint, id=W008)
    return Warning(finding.message, hint=finding.hint, id=W015)


@register(Tags.compatibility)
def check_deployment(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about set-ups that work in development but not behind several workers, and settings that do nothing."""
    messages: list[CheckMessage] = []
    try:
        backend = conf.backend
        source = get_policy_source()
        failed_auth = conf.identity.failed_auth
        adaptive = conf.shedding.adaptive.settings
        metrics = conf.metrics.settings
    except ConfigurationError:
        return messages  # check_settings reports it
    if backend != "memory" and not settings.DEBUG and not _shared(backend):
        messages.append(
            Warning(
                f"{Settings.backend.field} is {backend!r}, whose state lives in each process (its class says "
                "shared = False): every worker process counts on its own.",
                hint=f"Use a backend that shares its state between processes, such as 'redis' "
                f"(see {documentation.page('backends')}).",
                id=W001,
            )
        )
    if backend == "memory" and not settings.DEBUG:
        messages.append(
            Warning(
                f"{Settings.backend.field} is 'memory': every worker process counts on its own.",
                hint=f"Say where your Redis is in {Redis.url.field} (or {Redis.cache.field}): the 'redis' backend "
                f"follows (see {documentation.page('configuration', 'the-five-settings-most-projects-set')}).",
                id=W001,
            )
        )
    said = [s.field for s in (Redis.url, Redis.cache, Redis.client) if conf.is_set(s)]
    if backend == "memory" and said:
        messages.append(
            Warning(
                f"{', '.join(said)} set, but {Settings.backend.field} is 'memory': the limiter never uses that Redis, "
                "and every worker process counts on its own.",
                hint=f"Remove {Settings.backend.field} (the 'redis' backend follows from {Redis.field()}), or remove "
                f"{Redis.field()}.",
                id=W009,
            )
        )
    given = conf.given(Policies.source)
    if given is not None and given[0] in RETIRED_POLICY_SOURCES:
        messages.append(
            Warning(
                f"{Policies.source.field} is {given[0]!r}, where the class used to be: it is read as "
                f"{RETIRED_POLICY_SOURCES[given[0]]!r} until 0.3, then refused.",
                hint=f"Set {Policies.source.field} to 'database'.",
                id=W022,
            )
        )
    messages.extend(_exception_handler())
    middleware = "ratelimits.middleware.FailedAuthenticationMiddleware"
    if failed_auth is not None and middleware not in settings.MIDDLEWARE:
        messages.append(
            Warning(
                f"{Identity.failed_auth.field} is set, but nothing counts failed authentication.",
                hint=f"Add {middleware!r} to MIDDLEWARE, first (before sessions and authentication).",
                id=W005,
            )
        )
    early = "ratelimits.middleware.EarlyRejectionMiddleware"
    if adaptive is not None and early not in settings.MIDDLEWARE:
        messages.append(
            Warning(
                f"{Adaptive.field()} is on, but no middleware tells it the views' 5xx responses: "
                "the capacity follows latency only.",
                hint=f"Add {early!r} to MIDDLEWARE, first.",
                id=W006,
            )
        )
    if metrics is not None and not metrics.multiprocess and not metrics.declared and not settings.DEBUG:
        messages.append(
            Warning(
                f"{Metrics.field()} is on, but {MULTIPROC_ENV} is not set: under gunicorn, uWSGI or any "
                "server with several processes, each worker counts alone and a scrape shows one of them.",
                hint=f"Set {MULTIPROC_ENV} to an empty directory before the server starts "
                f"(see {documentation.page('metrics', 'several-worker-processes-multiprocess-mode')}), "
                f"or {Metrics.multiprocess.field} = False if one process serves.",
                id=W007,
            )
        )
    ignored = [
        SETTINGS[name].field for name in source.ignored_settings if name in SETTINGS and conf.is_set(SETTINGS[name])
    ]
    if ignored:
        messages.append(
            Warning(
                f"{', '.join(ignored)} set, but the policy source {type(source).__name__} reads its own tables "
                "instead: these decide only while the tables cannot be read (before migrate, a database outage).",
                hint="Configure them where the source reads them (the admin, for the database source); keep them here "
                "only as that fallback.",
                id=W003,
            )
        )
    return messages


def _exception_handler() -> list[CheckMessage]:
    """W002: the throttle is installed, but no exception handler renders its denials as problem+json."""
    rest = getattr(settings, "REST_FRAMEWORK", {}) or {}
    if not any(_is_ours(path) for path in rest.get("DEFAULT_THROTTLE_CLASSES", ())):
        return []
    path = rest.get("EXCEPTION_HANDLER", "rest_framework.views.exception_handler")
    try:
        handler = import_string(path) if isinstance(path, str) else path
    except ImportError:
        return []  # DRF reports its own setting when it imports it
    if composes_problems(handler):
        return []
    return [
        Warning(
            f"RateLimitThrottle is installed, but the exception handler {path!r} does not seem to call "
            "ratelimits.drf.exception_handler or problem_response: its 429 and 503 would be DRF's default JSON, "
            "not problem+json (no retry_after_ms, no violated policies).",
            hint="Set REST_FRAMEWORK['EXCEPTION_HANDLER'] = 'ratelimits.drf.exception_handler', or call "
            "ratelimits.drf.problem_response(exc, context) first in your own handler "
            f"(see {documentation.page('contract', 'your-own-exception-handler')}).",
            id=W002,
        )
    ]


def _is_ours(path: object) -> bool:
    """Whether a ``DEFAULT_THROTTLE_CLASSES`` entry is :class:`RateLimitThrottle` or a subclass of it."""
    try:
        found = import_string(path) if isinstance(path, str) else path
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, RateLimitThrottle)


def composes_problems(handler: Any) -> bool:
    """Whether an exception handler is ours, or calls ours (``exception_handler`` or ``problem_response``).

    Read from the handler's code, not by calling it: each global it loads and the attributes it
    reads from that (``ratelimits.drf.problem_response``), in its own code, in functions nested in
    it and in the functions it calls (a helper of its module), a few calls deep; through
    ``functools.wraps``, and into a callable object's ``__call__``. A handler that reaches ours some
    other way gets W002, which ``SILENCED_SYSTEM_CHECKS`` can silence.
    """
    return _reaches(handler, (drf.exception_handler, drf.problem_response), depth=4, seen=set())


def _reaches(function: Any, wanted: tuple[Any, ...], *, depth: int, seen: set[int]) -> bool:
    if function is None or id(function) in seen or depth < 0:
        return False
    seen.add(id(function))
    if any(function is own for own in wanted):
        return True
    if isinstance(function, functools.partial):  # a handler given its options
        return _reaches(function.func, wanted, depth=depth, seen=seen)
    if not isinstance(function, (types.FunctionType, types.MethodType)) and callable(function):
        call = type(function).__call__  # a callable object: what it runs
        return _reaches(call, wanted, depth=depth, seen=seen)
    function = getattr(function, "__func__", function)  # a bound method: its function
    code = getattr(function, "__code__", None)
    if code is not None:
        names = getattr(function, "__globals__", {})
        for loaded in _loaded(code, names):
            if any(loaded is own for own in wanted):
                return True
            if isinstance(loaded, types.FunctionType) and _reaches(loaded, wanted, depth=depth - 1, seen=seen):
                return True
    return _reaches(getattr(function, "__wrapped__", None), wanted, depth=depth, seen=seen)


def _loaded(code: types.CodeType, names: dict[str, Any]) -> Iterator[Any]:
    """Every global ``code`` (or code nested in it) loads, and every attribute chain read from one."""
    value: Any = None
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            value = names.get(instruction.argval)
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(value, types.ModuleType):
            value = getattr(value, instruction.argval, None)  # attributes of modules only: no code runs
        else:
            value = None
        if value is not None:
            yield value
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _loaded(const, names)


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


_TLS_DOCS = f"see {documentation.page('scaling', 'credentials-and-tls')}"
_NOEVICTION_DOCS = f"see {documentation.page('failure-modes', 'configure-the-limiters-redis-not-to-evict')}"
_EVICTION_DOCS = f"see {documentation.page('failure-modes', 'eviction-a-redis-that-drops-the-limiters-keys')}"
_FAILURE_DOCS = f"see {documentation.page('failure-modes', 'fail-modes-per-policy')}"


def _where_redis_is() -> str:
    """How messages name the limiter's Redis: the setting it comes from."""
    return f"CACHES[{conf.redis.cache!r}], by {Redis.cache.field}" if conf.redis.cache else Redis.field()


@register(Tags.compatibility)
def check_drain(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """In DEBUG: usage the store has held for minutes, undrained, and no Celery beat schedule that drains it.

    What a project that followed the steps but scheduled nothing sees: its usage report and
    ``GET /v1/usage`` show the last hour, live, and nothing older. Said only on evidence (a minute
    still in the store :data:`~ratelimits.usage.live.STALE_S` after it closed), so a project whose
    drain runs from cron or a sidecar, which no check can see, is not told to silence anything.
    """
    try:
        if not settings.DEBUG or not conf.usage.enabled or _drain_scheduled():
            return []
        since = stale_since()
    except (ConfigurationError, BackendUnavailable, NotImplementedError):
        return []  # check_settings and check_store report those
    if since is None:
        return []
    return [
        Warning(
            f"Usage counted since {since:%Y-%m-%d %H:%M} UTC is still in the limiter's store: nothing drains it "
            "into the database, so the usage report and GET /v1/usage show the last hour only, and the counters "
            "expire after two days.",
            hint="Add install_beat_schedule(app) (from ratelimits.periodic) to your Celery app and run beat, or "
            "run 'manage.py ratelimits_drain' beside the web workers "
            f"({documentation.page('usage', 'scheduling-the-drain')}).",
            id=W021,
        )
    ]


def _drain_scheduled() -> bool:
    """Whether a Celery beat schedule sends the drain: ``CELERY_BEAT_SCHEDULE``, or the project's Celery app's.

    The app is read only if the project has loaded Celery (as its package does with Celery's
    Django set-up): a project that has not, has no beat to schedule anything. Reading the app's
    ``conf`` configures it, which adds what :func:`~ratelimits.periodic.install_beat_schedule` holds.
    A drain run otherwise (the command, cron) is not seen: the warning says to silence it then.
    """
    if periodic.drains(getattr(settings, "CELERY_BEAT_SCHEDULE", None)):
        return True
    celery = sys.modules.get("celery")
    app = getattr(celery, "current_app", None)
    try:
        return app is not None and periodic.drains(app.conf.beat_schedule)
    except Exception:  # a Celery app that cannot be configured is no schedule, and not this check's to report
        return False


@register(Tags.compatibility)
def check_capabilities(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Refuse a setting that needs a capability the configured backend lacks, naming both.

    A backend implements the core contract, and adds capabilities as it can
    (:mod:`ratelimits.backends.base`): the engine leaves out what the backend lacks, so a setting
    that needs it would do nothing, silently. And a backend class that has a capability's methods
    without the capability among its bases (one written for 0.1) is told that they go unused.
    With the limiter off (``ENABLED`` False) nothing is asked of the backend, and nothing is said.
    """
    try:
        if not conf.enabled:
            return []
        backend = backend_class(conf.backend)
    except ConfigurationError:
        return []  # check_settings reports it
    messages: list[CheckMessage] = [
        Error(
            f"{setting} {why}, which needs {CAPABILITIES[capability]} ({_qualified(capability)}): "
            f"{Settings.backend.field} {conf.backend!r} has none.",
            hint=f"Add {capability.__name__} to {backend.__name__}'s bases and implement it "
            f"({documentation.page('backends', 'capabilities')}), or {remedy}.",
            id=E183,
        )
        for capability, setting, why, remedy in _capabilities_needed(backend)
        if not issubclass(backend, capability)
    ]
    for capability in CAPABILITIES:
        methods = sorted(capability.__abstractmethods__ - Backend.__abstractmethods__)  # type: ignore[attr-defined]
        if not issubclass(backend, capability) and methods and all(hasattr(backend, m) for m in methods):
            messages.append(
                Warning(
                    f"{Settings.backend.field} {conf.backend!r} has {' and '.join(methods)}, but not "
                    f"{_qualified(capability)} among its bases: the engine never uses them.",
                    hint=f"Add {capability.__name__} to {backend.__name__}'s bases "
                    f"({documentation.page('backends', 'capabilities')}).",
                    id=W023,
                )
            )
    return messages


def _qualified(capability: type[object]) -> str:
    return f"ratelimits.backends.{capability.__name__}"


def _capabilities_needed(backend: type[Backend]) -> list[tuple[type[object], str, str, str]]:
    """What the project's settings need of a backend: (capability, setting, what it is set to, the way out).

    Each is read on its own: a setting that cannot be read is check_settings' to report, and leaves
    the others to be said.
    """
    needs: list[tuple[type[object], str, str, str]] = []
    with contextlib.suppress(ConfigurationError):
        if conf.usage.enabled:
            needs.append((UsageSupport, Usage.field(), "is on (as by default)", f"set {Usage.field()} to False"))
    with contextlib.suppress(ConfigurationError, ImportError):
        if issubclass(import_string(conf.policies.source), DatabasePolicySource):
            needs.append(
                (
                    BulletinSupport,
                    Policies.source.field,
                    "is the database",
                    f"set {Policies.source.field} to 'settings'",
                )
            )
    with contextlib.suppress(ConfigurationError):
        if backend.shared and conf.is_set(LocalPath.leases) and conf.local_path.leases:
            needs.append((LeaseSupport, LocalPath.leases.field, "is True", f"remove {LocalPath.leases.field}"))
    with contextlib.suppress(ConfigurationError):
        if conf.regions.stores:
            needs.append((RegionSupport, Regions.stores.field, "names regions", f"remove {Regions.field()}"))
    with contextlib.suppress(ConfigurationError):
        settling = sorted(
            name
            for name, config in conf.endpoints.items()
            if isinstance(config, Mapping) and (config.get("counts", "all") != "all" or config.get("max_cost"))
        )
        if settling:
            field = f"{Settings.endpoints.field}[{settling[0]!r}]"
            needs.append(
                (SettleSupport, field, "charges by outcome or trues its cost up", "remove counts and max_cost")
            )
    return needs


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
        backend = get_backend()
        health = backend.store_health() if isinstance(backend, HealthSupport) else None
    except ConfigurationError:
        return []  # check_settings reports it
    except BackendUnavailable as exc:
        refusal = _refused(exc)
        where = _where_redis_is()
        if refusal is None:
            return [
                Info(
                    f"The limiter's Redis ({where}) did not answer the checks within its timeouts: {exc}. Until it "
                    "does, every request follows its policy's fail mode (open by default).",
                    hint=f"Check the address, and that the server runs ({_FAILURE_DOCS}).",
                    id=I002,
                )
            ]
        cache = conf.redis.cache
        hint = (
            f"Give the credentials and TLS files in CACHES[{cache!r}] (its LOCATION and OPTIONS), which "
            f"{Redis.cache.field} takes the limiter's Redis from: {_TLS_DOCS}."
            if cache is not None
            else f"Give the limiter's ACL user and password in {Redis.url.field} (redis://user:password@host) or "
            f"{Redis.options.field}, and the TLS files in {Redis.options.field}: {_TLS_DOCS}."
        )
        return [Error(f"The limiter's Redis ({where}) {refusal}: {exc}", hint=hint, id=E004)]
    if health is None or health.evicts is False:
        return []
    if health.evicts is None:
        return [
            Info(
                "The limiter's Redis did not say its maxmemory-policy (CONFIG and INFO refused).",
                hint=f"Make sure it is noeviction: {_NOEVICTION_DOCS}.",
                id=I001,
            )
        ]
    return [
        Warning(
            f"The limiter's Redis has maxmemory-policy {health.maxmemory_policy!r}: when its memory is full it "
            "evicts the limiter's keys, an evicted bucket restarts full, and callers get past their limits unseen.",
            hint="Give the limiter a Redis of its own with maxmemory-policy noeviction and maxmemory sized for its "
            f"keys: {_EVICTION_DOCS}.",
            id=W004,
        )
    ]


# -- DRF's throttle settings, the project's routes, and the database ----------------------------

E006 = "ratelimits.E006"  # a DRF throttle rate neither DRF nor ratelimits can read
E007 = "ratelimits.E007"  # a RateLimitThrottle subclass whose scope has no rate, or whose rate cannot be read
E008 = "ratelimits.E008"  # an ENDPOINTS (or POLICIES['EXEMPT_ENDPOINTS']) key that is a URL path, not an endpoint name
W010 = "ratelimits.W010"  # a DRF throttle rate that ratelimits' own policy replaces
W011 = "ratelimits.W011"  # DRF's own rate throttles listed beside RateLimitThrottle
W012 = "ratelimits.W012"  # REST_FRAMEWORK['NUM_PROXIES'] set: ratelimits does not read it
W013 = "ratelimits.W013"  # an ENDPOINTS (or POLICIES['EXEMPT_ENDPOINTS']) key that matches no endpoint of the project
W014 = "ratelimits.W014"  # the ratelimits migrations are not all applied: policies and usage have no tables
W016 = "ratelimits.W016"  # a DRF rate throttle (not ours) on a view or in DEFAULT_THROTTLE_CLASSES: decided apart
W017 = "ratelimits.W017"  # a view's throttle_scope with no DRF rate and no ENDPOINTS rule (DRF would refuse it)
W018 = "ratelimits.W018"  # JWT authentication with the default API_KEY_FUNC: each token its own caller
#: Settings of other packages whose errors the checks report under an id of their own.
FOREIGN_IDS = {DRF_RATES: E006}
#: DRF's throttles that count rates: beside RateLimitThrottle, the same rates are counted twice.
DRF_RATE_THROTTLES = (
    "rest_framework.throttling.AnonRateThrottle",
    "rest_framework.throttling.UserRateThrottle",
    "rest_framework.throttling.ScopedRateThrottle",
)


@register(Tags.compatibility)
def check_throttle_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """DRF's throttle settings that ratelimits replaces, counts twice, or does not read."""
    rest = getattr(settings, "REST_FRAMEWORK", {}) or {}
    throttles = rest.get("DEFAULT_THROTTLE_CLASSES", ())
    if not any(_is_ours(path) for path in throttles):
        return []
    messages: list[CheckMessage] = []
    for path in throttles:
        messages.extend(_drf_throttle(_imported(path), "REST_FRAMEWORK['DEFAULT_THROTTLE_CLASSES']", default=True))
    if rest.get("NUM_PROXIES") is not None:
        messages.append(
            Warning(
                "REST_FRAMEWORK['NUM_PROXIES'] is set, but ratelimits does not read it: it finds the client's address "
                f"behind {Identity.trusted_proxies.field} and {Identity.client_ip_header.field}.",
                hint=f"Name your proxies in {Identity.trusted_proxies.field} "
                f"(see {documentation.page('security', 'the-client-address')}).",
                id=W012,
            )
        )
    authentication = [_dotted(path) for path in rest.get("DEFAULT_AUTHENTICATION_CLASSES", ())]
    jwt = [path for path in authentication if path.startswith("rest_framework_simplejwt.")]
    if jwt and not conf.is_set(Identity.api_key_func):
        messages.append(
            Warning(
                f"{jwt[0]!r} authenticates with tokens that are not model instances: "
                f"{Identity.api_key_func.field} takes each token for a caller of its own, so a user who "
                "refreshes a token starts afresh, where DRF's user rate counted the user.",
                hint=f"Set {Identity.api_key_func.field} = 'ratelimits.identity.no_api_key' to count by user "
                f"(see {documentation.page('migrating-from-drf', 'who-the-caller-is')}).",
                id=W018,
            )
        )
    try:
        source = get_policy_source()
        replaced = source.snapshot().replaced if isinstance(source, SettingsPolicySource) else []
    except ConfigurationError:
        return messages  # check_settings reports it
    messages.extend(_replaced(replaced))
    return messages


def _drf_throttle(found: Any, where: str, *, default: bool) -> list[CheckMessage]:
    """W011 or W016 for one of DRF's rate throttles listed at ``where``, else nothing."""
    simple = _imported("rest_framework.throttling.SimpleRateThrottle")
    if not (isinstance(found, type) and isinstance(simple, type) and issubclass(found, simple)):
        return []
    path = _dotted(found)
    if default and path in DRF_RATE_THROTTLES:
        return [
            Warning(
                f"{where} lists {path!r} beside RateLimitThrottle, which reads REST_FRAMEWORK"
                "['DEFAULT_THROTTLE_RATES'] itself: the same rates are counted twice, in two stores, with two "
                "round trips.",
                hint=f"Remove {path!r} (see {documentation.page('migrating-from-drf')}).",
                id=W011,
            )
        ]
    return [
        Warning(
            f"{where} names DRF's throttle {path!r}: DRF decides it apart from ratelimits, in its own cache, "
            "with its own 429 body and no rate-limit headers.",
            hint=f"Make it a subclass of ratelimits.throttles.RateLimitThrottle, keeping its scope or rate "
            f"(see {documentation.page('migrating-from-drf', 'the-four-edits')}).",
            id=W016,
        )
    ]


def _replaced(replaced: list[tuple[str, str, str, str]]) -> list[CheckMessage]:
    return [
        Warning(
            f"{drf_field} ({drf_rate!r}) is replaced by {by} ({policy}).",
            hint="Where a ratelimits policy replaces a DRF rate, the DRF rate does not apply: keep one of them "
            f"(see {documentation.page('migrating-from-drf', 'what-each-drf-setting-becomes')}).",
            id=W010,
        )
        for drf_field, drf_rate, by, policy in replaced
    ]


def _dotted(found: object) -> str:
    """A setting's class as its dotted path, whether the setting names it or holds it."""
    if isinstance(found, type):
        return f"{found.__module__}.{found.__qualname__}"
    return str(found)


def _imported(path: object) -> Any:
    try:
        return import_string(path) if isinstance(path, str) else path
    except ImportError:
        return None


@register(Tags.urls)
def check_endpoints(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Endpoint names in the settings that no route of the project has, or that are URL paths; and
    throttle classes whose ``scope`` has no rate or whose ``rate`` cannot be read."""
    try:
        source = get_policy_source()
        names = [
            (Settings.endpoints.field, key) for key in conf.endpoints if "ENDPOINTS" not in source.ignored_settings
        ]
        names += [(Policies.exempt_endpoints.field, name) for name in conf.policies.exempt_endpoints]
        known = set(route_endpoints())
        routes = list(drf_routes())
    except ConfigurationError:
        return []  # check_settings reports it
    except Exception:  # a URLconf that cannot be imported: Django's own check says why
        return []
    messages: list[CheckMessage] = []
    # A project that uses RateLimitThrottle anywhere is moving off DRF's throttles: name those left.
    ours = any(
        _is_ours(path) for path in (getattr(settings, "REST_FRAMEWORK", {}) or {}).get("DEFAULT_THROTTLE_CLASSES", ())
    ) or any(_is_ratelimit_throttle(cls) for route in routes for cls in route.throttle_classes)
    inherited = tuple(APIView.throttle_classes)
    for route in routes:
        for cls in route.throttle_classes:
            if _is_ratelimit_throttle(cls) and (cls.rate or cls.scope):
                known.update([cls.scope] if cls.scope else [])
                messages.extend(_throttle_class(cls, source))
            elif ours and route.throttle_classes != inherited:
                # A view's own list: the default classes are named once, by check_settings.
                messages.extend(
                    _drf_throttle(cls, f"The view {route.view.__qualname__}'s throttle_classes", default=False)
                )
    messages.extend(_scopes_without_rates(routes, source))
    for field, key in names:
        name = key.partition(" ")[2].strip() if " " in key.strip() else key
        if name.startswith("/") or "/" in name:
            messages.append(
                Error(
                    f"{field}: {key!r} is a URL path; endpoints are named by the view's throttle_scope or its "
                    "route's name, never by a path.",
                    hint=_name_of_path(key),
                    id=E008,
                )
            )
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            messages.append(
                Warning(
                    f"{field}: {key!r} matches no endpoint of the project: no view has that throttle_scope and no "
                    "route has that name, so the rule limits nothing.",
                    hint=(f"Did you mean {close[0]!r}? " if close else "")
                    + f"See {documentation.page('configuration', 'endpoints')}.",
                    id=W013,
                )
            )
    return list({(m.id, m.msg): m for m in messages}.values())


def _is_ratelimit_throttle(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, RateLimitThrottle)


def _scopes_without_rates(routes: list[DrfRoute], source: Any) -> list[CheckMessage]:
    """W017: a view's ``throttle_scope`` that no DRF rate and no ``ENDPOINTS`` rule names, in a project
    that has DRF rates: DRF's ScopedRateThrottle failed such a view's every request; here only the tiers limit it."""
    try:
        scopes = throttle_rates().scopes
    except ConfigurationError:
        return []  # E006 says why
    if not scopes or not isinstance(source, SettingsPolicySource):
        return []
    named = set(scopes) | {key.partition(" ")[2].strip() or key for key in conf.endpoints}
    named |= set(conf.policies.exempt_endpoints)  # an exempt endpoint has no limit, on purpose
    messages: list[CheckMessage] = []
    for route in routes:
        # This app's own views (the customer usage and status API) have their scopes on purpose:
        # the status endpoint has its own built-in limit, and usage is limited as the caller is.
        if route.scope and route.scope not in named and not _ours(route.view):
            close = difflib.get_close_matches(route.scope, sorted(named), n=1)
            messages.append(
                Warning(
                    f"The view {route.view.__qualname__}'s throttle_scope {route.scope!r} has no rate in "
                    f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] nor a rule in {Settings.endpoints.field}: DRF would "
                    "answer its requests with a 500 under ScopedRateThrottle; here only the project's tiers limit it.",
                    hint=(f"Did you mean {close[0]!r}? " if close else "")
                    + f"See {documentation.page('migrating-from-drf', 'what-each-drf-setting-becomes')}.",
                    id=W017,
                )
            )
    return messages


def _ours(view: Any) -> bool:
    """Whether a view class is this app's own (routed by the project as the docs say), not the project's."""
    return str(getattr(view, "__module__", "")).partition(".")[0] == __name__.partition(".")[0]


def _throttle_class(cls: type[RateLimitThrottle], source: Any) -> list[CheckMessage]:
    if cls.scope and not cls.rate and not isinstance(source, SettingsPolicySource):
        return []  # the admin's tables may give the scope its rate: they are read per request
    try:
        class_policies(cls, source)
    except (ImproperlyConfigured, ConfigurationError) as exc:
        return [Error(str(exc), id=E007)]
    return []


def _name_of_path(key: str) -> str:
    """The key to write for ``METHOD /path``: the endpoint the path is limited as, if a route serves it."""
    method, _, path = key.strip().rpartition(" ")
    try:
        match = resolve(path.split("?")[0])
    except Resolver404:
        return "No route of the project serves that path either."
    view = getattr(match.func, "cls", None) or getattr(match.func, "view_class", None)
    name = getattr(view, "throttle_scope", None) or getattr(match.func, "ratelimit_scope", None) or match.view_name
    return f"That path is served as the endpoint {name!r}: write {f'{method} {name}'.strip()!r}."


@register(Tags.database)
def check_database(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Unapplied ratelimits migrations; and, with the admin's tables as the source, the DRF rates they replace.

    Run by ``manage.py check --database default`` and by ``migrate`` itself, hence a warning: an
    error would stop the ``migrate`` that fixes it.
    """
    if not databases:
        return []
    messages: list[CheckMessage] = []
    for alias in databases:
        if not router.allow_migrate(alias, "ratelimits"):
            continue  # a router keeps the app's tables elsewhere
        try:
            pending = unapplied_migrations(alias)
        except DatabaseError as exc:
            messages.append(
                Warning(
                    f"The database {alias!r} could not be asked for the ratelimits migrations: {exc}",
                    id=W014,
                )
            )
            continue
        if pending:
            messages.append(
                Warning(
                    f"ratelimits' migrations {', '.join(pending)} are not applied on the database {alias!r}: until "
                    "they are, the admin's policies cannot be read (requests follow the fail mode on the settings' "
                    "policies) and usage is not drained into reports.",
                    hint=f"Run manage.py migrate --database {alias}.",
                    id=W014,
                )
            )
    if messages:
        return messages
    try:
        source = get_policy_source()
        if not isinstance(source, SettingsPolicySource):
            messages.extend(_replaced(getattr(source.snapshot(), "replaced", [])))
    except (ConfigurationError, DatabaseError):
        pass  # the settings' checks, or the migrations above, say why
    messages.extend(_idle_webhooks())
    return messages


def _idle_webhooks() -> list[CheckMessage]:
    """Webhook endpoints that nothing will send to: ``USAGE['NOTICES']`` is off."""
    try:
        if conf.usage.notices.enabled:
            return []
        count = WebhookEndpoint.objects.filter(enabled=True).count()
    except (ConfigurationError, DatabaseError):
        return []  # the settings' checks, or the migrations above, say why
    if not count:
        return []
    return [
        Warning(
            f"{count} webhook endpoint(s) are enabled in the admin, but RATELIMITS['USAGE']['NOTICES'] is False: "
            "no notice is made, and nothing is delivered to them.",
            hint="Remove RATELIMITS['USAGE']['NOTICES'] = False (notices are on by default), or disable the endpoints "
            f"({documentation.page('notices')}).",
            id=W024,
        )
    ]


def unapplied_migrations(alias: str = "default") -> list[str]:
    """The names of the ratelimits migrations not applied on the database ``alias``."""
    executor = MigrationExecutor(connections[alias])
    targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "ratelimits"]
    return [migration.name for migration, _ in executor.migration_plan(targets) if migration.app_label == "ratelimits"]


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
            f"{W020} while both run ({documentation.page('migrating-from-django-ratelimit')}).",
            id=W020,
        )
        for name, equivalent in DJANGO_RATELIMIT_SETTINGS.items()
        if hasattr(settings, name)
    ]
