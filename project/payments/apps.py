import logging
import os
import threading

from django.apps import AppConfig

logger = logging.getLogger("ratelimits")

#: Seconds between in-process drains when the demo runs without a Celery broker.
DRAIN_EVERY = 30.0


class PaymentsConfig(AppConfig):
    name = "project.payments"
    label = "payments"
    verbose_name = "Demo payments API"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        # `make demo` sets this for the serving process only (not for migrate or the tests).
        if os.environ.get("RATELIMITS_DEMO_TIMER") == "1" and not settings.CELERY_BROKER_URL:
            threading.Thread(target=_drain_forever, name="usage-drain", daemon=True).start()


def _drain_forever() -> None:
    """No broker: drain and roll usage up in this process, as the Celery beat schedule would."""
    from ratelimits.usage import drain, rollup

    stop = threading.Event()
    while not stop.wait(DRAIN_EVERY):
        try:
            drain()
            rollup()
        except Exception:  # a demo convenience must not kill the server
            logger.exception("ratelimits demo: in-process usage drain failed")
