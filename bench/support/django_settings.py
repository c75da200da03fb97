"""Django settings for the scripts that decide in-process: ``bench.sharding``, ``bench.eviction``,
``bench.hot_keys``, ``bench.cluster`` and ``bench.regions``.

They build their backends and checks themselves and set ``RATELIMITS`` where they need to
(``override_settings``); Django is here for ``ratelimits.conf``. No database is opened, and the
limiter's warnings (a degraded decision) are not printed between the figures.
"""

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["rest_framework", "ratelimits"]
DATABASES: dict[str, dict[str, str]] = {}
RATELIMITS = {"BACKEND": "memory"}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"ratelimits": {"handlers": ["null"], "propagate": False}},
}
