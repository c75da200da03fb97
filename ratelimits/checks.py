"""System checks: configuration errors reported at start-up, not on the first request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.utils.module_loading import import_string

from .conf import DEFAULTS, conf
from .exceptions import ConfigurationError

# Ids are never reused; tests assert the exact ids a misconfiguration produces.
E001 = "ratelimits.E001"  # unknown key in RATELIMITS
E002 = "ratelimits.E002"  # invalid value (message names the field)
W001 = "ratelimits.W001"  # memory backend outside DEBUG
W002 = "ratelimits.W002"  # throttle installed without the problem+json exception handler


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every RATELIMITS key is known and every value parses; policies build without error."""
    messages: list[CheckMessage] = []
    try:
        user = conf.user_settings
    except ConfigurationError as exc:
        return [Error(str(exc), id=E002)]
    for key in sorted(set(user) - set(DEFAULTS)):
        messages.append(Error(f"RATELIMITS[{key!r}] is not a ratelimits setting", id=E001))
    probes: list[Callable[[], object]] = [
        lambda: conf.key_prefix,
        lambda: conf.use_redis_time,
        lambda: conf.redis_socket_timeout,
        lambda: conf.redis_connect_timeout,
        lambda: conf.trusted_proxies,
        lambda: conf.ipv6_prefix,
        lambda: conf.headers,
        lambda: conf.retry_after_jitter_us,
        lambda: conf.default_fail_mode,
        lambda: conf.local_fallback_share,
        lambda: conf.breaker,
        lambda: conf.api_key_func,
        lambda: conf.organization_func,
        lambda: conf.tier_func,
        lambda: conf.policy_poll_interval,
        lambda: conf.policy_recheck_interval,
        _api_key_model,
    ]
    for probe in probes:
        try:
            probe()
        except ConfigurationError as exc:
            messages.append(Error(str(exc), id=E002))
    if not messages:
        # Policies build on the settings above; report them only once those are sound.
        try:
            _build_source()
        except ConfigurationError as exc:
            messages.append(Error(str(exc), id=E002))
        except ImportError as exc:
            messages.append(Error(f"RATELIMITS['POLICY_SOURCE']: {exc}", id=E002))
    return messages


def _api_key_model() -> object:
    from .autocomplete import api_key_model

    return api_key_model()


def _build_source() -> object:
    source: Callable[[], object] = import_string(conf.policy_source)
    return source()


@register(Tags.compatibility)
def check_deployment(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about set-ups that work in development but not behind several workers."""
    messages: list[CheckMessage] = []
    if conf.backend == "memory" and not settings.DEBUG:
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
    return messages
