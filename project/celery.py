"""The demo's Celery app and beat schedule (used when CELERY_BROKER_URL is set)."""

import os
from typing import Any

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["ratelimits"])

app.conf.beat_schedule = {
    # Every 30 s: closed minutes reach the reports within a minute.
    "drain-usage": {"task": "ratelimits.drain_usage", "schedule": 30.0},
    "maintain-usage": {"task": "ratelimits.maintain_usage", "schedule": 15 * 60.0},
    "expire-policies": {"task": "ratelimits.expire_policies", "schedule": 60 * 60.0},
    "near-limit-digest": {"task": "ratelimits.near_limit_digest", "schedule": 24 * 60 * 60.0},
}


@app.on_after_configure.connect  # type: ignore[untyped-decorator]
def schedule_reconciliation(sender: Celery, **kwargs: Any) -> None:
    """With ``RATELIMITS['REGIONS']``: a reconciliation round every ``REGIONS['RECONCILE_INTERVAL']`` (1 s).

    ``expires``: a round not started within its interval is dropped, not run late in a burst.
    """
    from ratelimits.conf import conf

    if conf.regions.stores:
        interval = conf.regions.reconcile.interval
        sender.add_periodic_task(
            interval, sender.signature("ratelimits.reconcile_regions"), name="reconcile-regions", expires=interval
        )
