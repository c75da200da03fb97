"""The demo project's settings for the Celery worker and beat processes of ``test_celery_usage.py``.

Exactly ``project.settings`` (database, Redis and broker from ``DATABASE_URL``, ``REDIS_URL`` and
``CELERY_BROKER_URL``), except:

* tasks go to a queue of the run's own (``RATELIMITS_TEST_CELERY_QUEUE``), so runs sharing the
  broker's default vhost never take each other's tasks;
* beat drains usage every ``RATELIMITS_TEST_DRAIN_EVERY`` seconds (2 by default) instead of 30;
* ``RATELIMITS_TEST_REGIONS`` (JSON), if set, is merged into ``RATELIMITS``: the regions the
  reconciler of ``test_regions_celery.py`` reaches (the demo schedules it when ``REGIONS`` is set).
  ``project/celery.py`` sets its schedule in code, over whatever the settings say, so a scheduler
  class (the ``beat_scheduler`` setting) rewrites that one entry's interval as beat loads it.
"""

import json
import os
from typing import Any

from celery.beat import PersistentScheduler

from project.settings import *  # noqa: F403

CELERY_TASK_DEFAULT_QUEUE = os.environ.get("RATELIMITS_TEST_CELERY_QUEUE", "ratelimits-test")
DRAIN_EVERY_S = float(os.environ.get("RATELIMITS_TEST_DRAIN_EVERY", "2"))
CELERY_BEAT_SCHEDULER = "tests.support.celery_settings:FastDrainScheduler"
RATELIMITS = {**RATELIMITS, **json.loads(os.environ.get("RATELIMITS_TEST_REGIONS", "{}"))}  # noqa: F405


class FastDrainScheduler(PersistentScheduler):  # type: ignore[misc]
    """The project's beat schedule, with the usage drain every ``DRAIN_EVERY_S`` seconds."""

    def merge_inplace(self, b: dict[str, Any]) -> None:
        schedule = {
            name: {**entry, "schedule": DRAIN_EVERY_S} if entry.get("task") == "ratelimits.drain_usage" else entry
            for name, entry in b.items()
        }
        super().merge_inplace(schedule)
