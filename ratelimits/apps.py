"""Django app configuration for ratelimits."""

from django.apps import AppConfig


class RateLimitsConfig(AppConfig):
    name = "ratelimits"
    verbose_name = "Rate limits"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: all three import the models, which Django loads only after
        # this module (checks registers the system checks; the audit trail connects its signals;
        # the usage subjects' labels are written after each response).
        from . import checks  # noqa: F401
        from .store import audit
        from .usage import subjects

        audit.connect()
        subjects.connect()
