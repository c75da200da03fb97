"""System checks: every setting validated at start-up, each under an id of its own.

A bad value fails ``manage.py check`` (and ``runserver``, ``migrate``...) with a message naming the
setting, never the first request. Ids are never reused: one retired is kept here, marked so.
"""

from __future__ import annotations

import functools
import ssl
import types
from collections.abc import Callable, Iterator
from typing import Any

import redis
from django.conf import settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.utils.module_loading import import_string

from . import documentation, drf
from .backends import backend_class, get_backend
from .backends.redis import RedisBackend
from .conf import MULTIPROC_ENV, SETTINGS, Adaptive, Finding, Identity, Metrics, Policies, Redis, Settings, conf, id_of
from .exceptions import BackendUnavailable, ConfigurationError
from .policies.settings import dimensions_from_settings
from .policies.source import get_policy_source
from .throttles import RateLimitThrottle

__all__ = [
    "E001",
    "E002",
    "E003",
    "E004",
    "E005",
    "I001",
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
    "check_deployment",
    "check_settings",
    "check_store",
    "composes_problems",
]

#: Every id these checks report. Tests assert the exact ids a misconfiguration produces.
E001 = "ratelimits.E001"  # a key of RATELIMITS that is no setting
E002 = "ratelimits.E002"  # retired after 0.1.0: any invalid value (each setting has its own id now)
E003 = "ratelimits.E003"  # RATELIMITS is not a dict
E004 = "ratelimits.E004"  # the limiter's Redis refused its credentials, or its TLS handshake failed
E005 = "ratelimits.E005"  # a setting given under both its name and the name 0.1 gave it
W001 = "ratelimits.W001"  # memory backend outside DEBUG
W002 = "ratelimits.W002"  # throttle installed without the problem+json exception handler
W003 = "ratelimits.W003"  # a setting is set that the configured policy source does not read
W004 = "ratelimits.W004"  # the limiter's Redis may evict its keys (a maxmemory-policy other than noeviction)
W005 = "ratelimits.W005"  # FAILED_AUTH is set but its middleware is not installed
W006 = "ratelimits.W006"  # ADAPTIVE_CAPACITY is set but EarlyRejectionMiddleware (which sees 5xx) is not
W007 = "ratelimits.W007"  # METRICS is on outside DEBUG without prometheus-client's multiprocess mode
W008 = "ratelimits.W008"  # a setting under the name 0.1 gave it (read until 0.3)
W009 = "ratelimits.W009"  # REDIS says where a Redis is, but BACKEND is 'memory'
I001 = "ratelimits.I001"  # the limiter's Redis answers but will not say its maxmemory-policy
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
            check_id = id_of(at) or SETTING_IDS[name]
            if (check_id, str(exc)) not in reported:  # a namespace of the wrong shape fails each of its settings
                reported.add((check_id, str(exc)))
                messages.append(Error(str(exc), id=check_id))

    for name, setting in SETTINGS.items():
        read(functools.partial(conf.read, setting), name)
    # What needs several settings at once: the adaptive capacity its ceiling, metrics their environment.
    read(lambda: conf.shedding.adaptive.settings, Adaptive.name())
    read(lambda: conf.metrics.settings, Metrics.name())
    if Settings.backend.name not in invalid:
        read(lambda: backend_class(conf.backend), Settings.backend.name)  # an alias or a dotted path: a Backend?
    if not invalid:
        # Policies build on the settings above: report them only once those are sound. The
        # backstops apply under any source (the database source loads them on first use). The
        # source built is the process's own: its first request finds it built.
        read(lambda: (dimensions_from_settings(conf.failure.default_mode), get_policy_source()), Policies.source.name)
    return messages


def _finding(finding: Finding) -> CheckMessage:
    if finding.kind == "unknown":
        return Error(finding.message, hint=finding.hint, id=E001)
    if finding.kind == "renamed":
        return Warning(finding.message, hint=finding.hint, id=W008)
    return Error(finding.message, hint=finding.hint, id=E005)


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
                f"{', '.join(ignored)} set, but the policy source {type(source).__name__} does not read them.",
                hint="Configure them where the source reads them (the admin, for the database source), or remove them.",
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
            f"RateLimitThrottle is installed, but the exception handler {path!r} renders its 429 and 503 as DRF's "
            "default JSON, not problem+json (no Retry-After body, no violated policies).",
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

    Read from the handler's code, not by calling it: the names it (or a function it wraps)
    reads from its module's globals, at any depth of nested functions, followed through
    ``ratelimits.drf`` attributes. A handler that reaches ours some other way gets W002, which
    ``SILENCED_SYSTEM_CHECKS`` can silence.
    """
    ours = {drf.exception_handler, drf.problem_response}
    seen: set[int] = set()
    while handler is not None and id(handler) not in seen:
        seen.add(id(handler))
        if handler in ours:
            return True
        code = getattr(handler, "__code__", None)
        names = getattr(handler, "__globals__", {})
        if code is not None and any(_reaches(names.get(name), code) in ours for name in _names(code)):
            return True
        handler = getattr(handler, "__wrapped__", None)
    return False


def _names(code: Any) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _names(const)


def _reaches(value: Any, code: Any) -> Any:
    """``value``, or the attribute of it the code names next (``ratelimits.drf.problem_response``)."""
    names = set(_names(code))
    for _ in range(3):  # ratelimits -> drf -> problem_response
        if not isinstance(value, types.ModuleType):
            return value
        attribute = next(
            (getattr(value, n) for n in names if hasattr(value, n) and getattr(value, n) is not value), None
        )
        if attribute is None:
            return value
        value = attribute
    return value


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
                f"The limiter's Redis ({Redis.field()}) {refusal}: {exc}",
                hint=f"Give the limiter's ACL user and password in {Redis.url.field} (redis://user:password@host) or "
                f"{Redis.options.field}, and the TLS files in {Redis.options.field}: {_TLS_DOCS}.",
                id=E004,
            )
        ]
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
