"""Django app configuration for ratelimits."""

from django.apps import AppConfig


class RateLimitsConfig(AppConfig):
    name = "ratelimits"
    verbose_name = "Rate limits"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import audit, checks  # noqa: F401  (checks registers the system checks)

        audit.connect()
