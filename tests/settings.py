"""Settings for the test suite: the demo project's apps, PostgreSQL or SQLite, a private Redis."""

import os
from pathlib import Path

import dj_database_url
import django

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "tests-only-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "tests.urls"
# The live server of the browser tests serves the admin's and ratelimits' static files from here.
STATIC_URL = "static/"
# The demo's documentation site (project/settings.py); the tests build their own into a temporary one.
DOCS_SITE = BASE_DIR / "site"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "django.contrib.staticfiles",
    "rest_framework",
    "ratelimits",
    "project.payments",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The demo project's own templates (its landing page), as in project/settings.py.
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

DATABASES = {"default": dj_database_url.parse(os.environ.get("DATABASE_URL", "sqlite:///:memory:"))}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["project.payments.auth.ApiKeyAuthentication"],
    "DEFAULT_THROTTLE_CLASSES": ["ratelimits.throttles.RateLimitThrottle"],
    "EXCEPTION_HANDLER": "ratelimits.drf.exception_handler",
    "UNAUTHENTICATED_USER": None,
}

# Tests point BACKEND and REDIS['URL'] at the private Redis started by conftest.py.
RATELIMITS = {
    "BACKEND": "memory",
}

# Django 6.1 sends mail through named MAILERS (the test run swaps each for the in-memory outbox).
if django.VERSION >= (6, 1):
    MAILERS = {"default": {"BACKEND": "django.core.mail.backends.locmem.EmailBackend"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"ratelimits": {"handlers": ["null"], "propagate": False}},
}
