"""Django settings for the benchmark, configured in-process once the private Redis is up.

Limits are set far above anything one thread can reach, so no decision is ever a denial:
every row measures the admit path, which is the path every normal request takes.
"""

from __future__ import annotations

from typing import Any

#: The view's ``throttle_scope``: ratelimits' endpoint name and DRF's scoped-throttle scope.
SCOPE = "payments"
#: A limit no single-threaded run can reach (token bucket: 1,000,000/s, a burst of ten seconds'
#: worth). Each caller comes back well within its bucket's refill time, as one of a tier of
#: 100/min does, so its state's key keeps its expiry (lua/decide.lua, TIMED_STATE): under
#: ``bench.instructions`` a caller comes back after a second or two, not a tenth.
UNREACHABLE = {"rate": "1000000/s", "burst": 10_000_000}
#: DRF rates per second: histories stay short (favourable to DRF) and nothing is throttled.
DRF_RATE = "1000000/s"
#: The DRF throttles' rates (bench/scenarios.py gives them to its throttle classes, not to the settings).
DRF_RATES = {"user": DRF_RATE, "anon": DRF_RATE, SCOPE: DRF_RATE}


def tier_of(request: Any, identity: Any) -> str | None:
    """RATELIMITS['POLICIES']['TIER_FUNC']: the tier stored on the API key (like the demo's ``tier_of``)."""
    return getattr(getattr(request, "auth", None), "tier", None)


def organization_of(request: Any) -> str | None:
    """RATELIMITS['IDENTITY']['ORGANIZATION_FUNC']: the API key's organisation."""
    return getattr(getattr(request, "auth", None), "org", None)


#: The limiter's socket and connect timeouts (``None``: the default 50 ms). ``bench.instructions``
#: raises them: a redis-server under valgrind answers some fifty times slower.
SOCKET_TIMEOUT: str | None = None


def ratelimits_settings(redis_url: str, *, dimensions: int) -> dict[str, Any]:
    """RATELIMITS for one dimension (the caller's tier only) or four (tier, ip, org, endpoint)."""
    if dimensions not in (1, 4):
        raise ValueError("dimensions must be 1 or 4")
    config: dict[str, Any] = {
        "BACKEND": "redis",
        "REDIS": {"URL": redis_url}
        if SOCKET_TIMEOUT is None
        else {"URL": redis_url, "SOCKET_TIMEOUT": SOCKET_TIMEOUT, "CONNECT_TIMEOUT": SOCKET_TIMEOUT},
        "TIERS": {"anonymous": {"rate": "20/s", "burst": 40}, "bench": UNREACHABLE},
        "POLICIES": {
            "DEFAULT_TIERS": {"anonymous": "anonymous", "authenticated": "bench"},
            "TIER_FUNC": "bench.settings.tier_of",
        },
        "IDENTITY": {"ORGANIZATION_FUNC": "bench.settings.organization_of"},
        "DIMENSIONS": {},
        "ENDPOINTS": {},
        # The rows time the decision the store makes, against the anchors' round trips: a caller
        # asked over and over would otherwise be answered from its leases (bench.hot_keys times those).
        "LOCAL_PATH": {"LEASES": False},
    }
    if dimensions == 4:
        config["DIMENSIONS"] = {"ip": UNREACHABLE, "org": UNREACHABLE}
        config["ENDPOINTS"] = {SCOPE: {"rate": UNREACHABLE}}
    return config


def configure(redis_url: str, cache_url: str) -> None:
    """``settings.configure`` + ``django.setup``: must run before DRF's throttling module is imported."""
    import django
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench-only-not-secret",
        ALLOWED_HOSTS=["*"],
        USE_TZ=True,
        INSTALLED_APPS=["rest_framework", "ratelimits"],
        DATABASES={},
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": cache_url,
                "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
            }
        },
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "DEFAULT_THROTTLE_CLASSES": [],
            "DEFAULT_THROTTLE_RATES": {},
            "UNAUTHENTICATED_USER": None,
        },
        RATELIMITS=ratelimits_settings(redis_url, dimensions=4),
        LOGGING={
            "version": 1,
            "disable_existing_loggers": False,
            "handlers": {"console": {"class": "logging.StreamHandler"}},
            "loggers": {"ratelimits": {"handlers": ["console"], "level": "WARNING", "propagate": False}},
        },
    )
    django.setup()
