"""The demo's Celery app and beat schedule (used when CELERY_BROKER_URL is set)."""

import os

from celery import Celery

from ratelimits.periodic import install_beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["ratelimits"])
# The drain every USAGE["DRAIN_EVERY"] (30 s), the roll-up, expiry, the digest; with REGIONS, the
# reconciliation round every REGIONS["RECONCILE_INTERVAL"].
install_beat_schedule(app)
