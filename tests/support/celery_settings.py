"""The demo project's settings for the Celery worker and beat processes of ``test_celery_usage.py``.

Exactly ``project.settings`` (database, Redis and broker from ``DATABASE_URL``, ``REDIS_URL`` and
``CELERY_BROKER_URL``), except:

* tasks go to a queue of the run's own (``RATELIMITS_TEST_CELERY_QUEUE``), so runs sharing the
  broker's default vhost never take each other's tasks;
* beat drains usage every ``RATELIMITS_TEST_DRAIN_EVERY`` seconds (2 by default) instead of 30:
  ``USAGE["DRAIN_EVERY"]``, which the demo's schedule (``ratelimits.periodic``) reads;
* ``RATELIMITS_TEST_REGIONS`` (JSON), if set, is merged into ``RATELIMITS``: the regions the
  reconciler of ``test_regions_celery.py`` reaches (the schedule has its round when ``REGIONS`` is set);
* ``RATELIMITS_TEST_NOTICES`` (JSON), if set, is ``USAGE['NOTICES']``: the fast retries and the
  loopback receiver of ``test_notices_celery.py``.
"""

import json
import os

from project.settings import *  # noqa: F403

CELERY_TASK_DEFAULT_QUEUE = os.environ.get("RATELIMITS_TEST_CELERY_QUEUE", "ratelimits-test")
DRAIN_EVERY_MS = round(float(os.environ.get("RATELIMITS_TEST_DRAIN_EVERY", "2")) * 1000)
RATELIMITS = {
    **RATELIMITS,  # noqa: F405
    "USAGE": {
        "DRAIN_EVERY": f"{DRAIN_EVERY_MS}ms",
        **(
            {"NOTICES": json.loads(os.environ["RATELIMITS_TEST_NOTICES"])}
            if "RATELIMITS_TEST_NOTICES" in os.environ
            else {}
        ),
    },
    **json.loads(os.environ.get("RATELIMITS_TEST_REGIONS", "{}")),
}
