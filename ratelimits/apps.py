"""Django app configuration for ratelimits."""

from django.apps import AppConfig


class RateLimitsConfig(AppConfig):
    name = "ratelimits"
    verbose_name = "Rate limits"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: all four import the models, which Django loads only after
        # this module (checks registers the system checks; the audit trail connects its signals;
        # the usage subjects' labels and the notices seen are written after each response).
        from . import checks  # noqa: F401
        from .store import audit, notices
        from .usage import subjects

        audit.connect()
        subjects.connect()
        notices.connect()
