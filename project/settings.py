"""Settings of the demo payments API.

With no environment it runs on embedded defaults: SQLite and the in-process ``memory``
backend. ``REDIS_URL`` switches limiting to Redis and ``DATABASE_URL`` the database.
"""

import json
import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("SECRET_KEY", "demo-only-not-secret")
DEBUG = os.environ.get("DEBUG", "1") == "1"
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"
ASGI_APPLICATION = "project.asgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"
# The documentation site `make docs` builds (mkdocs.yml), which the demo serves at /docs/.
DOCS_SITE = BASE_DIR / "site"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    # The OpenAPI schema (/api/schema/) and Swagger UI (/api/docs/), its assets served from here.
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "ratelimits",
    "project.payments",
]

MIDDLEWARE = [
    # First: what this worker knows it would refuse (a credential whose denial has not ended, a
    # request the worker shedder would shed) is answered before sessions or API keys are read.
    "ratelimits.middleware.EarlyRejectionMiddleware",
    # Then a client guessing keys is refused before sessions or API keys are looked up.
    "ratelimits.middleware.FailedAuthenticationMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {"default": dj_database_url.parse(os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR / 'demo.sqlite3'}"))}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["project.payments.auth.ApiKeyAuthentication"],
    "DEFAULT_THROTTLE_CLASSES": ["ratelimits.throttles.RateLimitThrottle"],
    # DRF's parsers, but JSON nested too deep for Python's parser is a 400 as malformed JSON is, not a 500.
    "DEFAULT_PARSER_CLASSES": [
        "project.payments.problems.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    # ratelimits' 429 and 503 as application/problem+json, and a body the parsers refuse as a 400 one.
    "EXCEPTION_HANDLER": "project.payments.problems.exception_handler",
    "UNAUTHENTICATED_USER": None,
    # drf-spectacular's AutoSchema, plus the 429, 503 and rate-limit headers (docs/openapi.md).
    "DEFAULT_SCHEMA_CLASS": "ratelimits.openapi.RateLimitAutoSchema",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "ratelimits demo payments API",
    "DESCRIPTION": "The demo's endpoints, their 429 and 503 problem responses and rate-limit headers.",
    "VERSION": "1.0.0",
    # The schema and docs views describe the API; they are not part of it.
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's and Redoc's files from drf-spectacular-sidecar, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Nor does Swagger UI send the schema to validator.swagger.io for its badge.
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
}

# What the demo's views wait on (project/payments/downstream.py), as JSON; the tests make an export
# last a minute with it, to hold its slots while they kill the workers.
DEMO_DOWNSTREAM = json.loads(os.environ.get("DEMO_DOWNSTREAM") or "null")

REDIS_URL = os.environ.get("REDIS_URL")
# One Redis for the project: the cache, and (RATELIMITS['REDIS']['CACHE']) the limiter.
CACHES = (
    {"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": REDIS_URL}}
    if REDIS_URL
    else {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
)

# Celery: with a broker (e.g. amqp://guest:guest@127.0.0.1:5672//) a worker and beat drain usage;
# without one the demo drains in process on a timer (see project/payments/apps.py).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "")
CELERY_TASK_ALWAYS_EAGER = not CELERY_BROKER_URL
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

RATELIMITS = {
    # With REDIS_URL set, the limiter shares the Redis of the "default" cache (the redis backend
    # follows); without it, the in-process memory backend.
    **({"REDIS": {"CACHE": "default"}} if REDIS_URL else {}),
    "POLICIES": {
        # Tiers, assignments, endpoint policies and overrides live in the admin (/admin/ratelimits/).
        "SOURCE": "database",
        # An API key's own tier field places it when no assignment does.
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
    "IDENTITY": {
        "ORGANIZATION_FUNC": "project.payments.auth.organization_of",
        # Lets the admin suggest API keys by name when picking a subject.
        "API_KEY_MODEL": "payments.ApiKey",
        # 20 failed authentications at once per client IP (and per key prefix), then 10 a minute.
        "FAILED_AUTH": {"rate": "10/m", "burst": 20},
    },
    # Static backstops that apply to every request, whatever the admin says.
    "DIMENSIONS": {
        "ip": {"rate": "300/s", "burst": 300},
        "org": {"rate": "500/s", "burst": 500},
    },
    # Denials remembered per worker (exact), leases for hot keys, and X-RateLimit-Local to show them.
    "LOCAL_PATH": {"LEASES": True, "HEADER": True},
    # Prometheus metrics at /metrics; under gunicorn set PROMETHEUS_MULTIPROC_DIR (docs/metrics.md).
    "METRICS": True,
    # One tenant may hold half the fleet's in-flight capacity (the default; 100 lifts the cap, as
    # tests/test_slow_bodies.py does to show the body read alone keeps the fleet for everyone).
    "SHEDDING": {"TENANT_SHARE": int(os.environ.get("RATELIMITS_TENANT_SHARE", "50"))},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"require_debug_false": {"()": "django.utils.log.RequireDebugFalse"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler"},
        "errors": {"class": "logging.StreamHandler", "level": "ERROR", "filters": ["require_debug_false"]},
    },
    "loggers": {
        "ratelimits": {"handlers": ["console"], "level": "INFO"},
        # Every 5xx and the exception behind a 500, on stderr with DEBUG=0 too: Django's own logging
        # prints them only with DEBUG on, and otherwise mails them to ADMINS, which the demo has none of.
        "django.request": {"handlers": ["errors"]},
    },
}
