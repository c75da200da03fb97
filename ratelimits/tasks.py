"""Celery tasks: thin wrappers around the periodic work of :mod:`ratelimits.periodic`.

The only module that imports Celery. ``acks_late``: a task is acknowledged after it ran, so a
worker killed mid-drain has its task delivered again; the drain is exactly-once by design.
Schedule them with :func:`ratelimits.periodic.install_beat_schedule`.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from . import usage
from .reconciler import reconcile
from .reports.digest import send_digest
from .store.expiry import expire_policies as _expire_policies
from .store.notices import sweep

__all__ = [
    "drain_usage",
    "expire_policies",
    "maintain_usage",
    "near_limit_digest",
    "reconcile_regions",
    "send_notices",
]


@shared_task(name="ratelimits.drain_usage", acks_late=True, reject_on_worker_lost=True)
def drain_usage() -> int:
    """Move closed minutes of usage counters into ``UsageRecord`` rows; return batches applied."""
    return usage.drain()


@shared_task(name="ratelimits.maintain_usage", acks_late=True, reject_on_worker_lost=True)
def maintain_usage() -> dict[str, Any]:
    """Roll minutes up into hours and days, then purge old minute rows and the labels no counter names any more."""
    return usage.maintain()


@shared_task(name="ratelimits.expire_policies", acks_late=True, reject_on_worker_lost=True)
def expire_policies() -> int:
    """Delete overrides and assignments past their expiry (audited); return how many."""
    return _expire_policies()


@shared_task(name="ratelimits.send_notices", acks_late=True, reject_on_worker_lost=True)
def send_notices() -> dict[str, int]:
    """Make notices of repeated refusals, then send the webhook deliveries due; return how many of each.

    A worker killed mid-send has its task delivered again, and each delivery it had claimed is
    sent by a later sweep once the claim lapses: none is lost.
    """
    return sweep()


@shared_task(name="ratelimits.near_limit_digest")
def near_limit_digest() -> str:
    """Mail yesterday's near-limit digest to the site's ADMINS; return its text."""
    return send_digest().render()


@shared_task(name="ratelimits.reconcile_regions", ignore_result=True)
def reconcile_regions() -> dict[str, Any]:
    """Move global policies' regional shares toward demand (one round); return what it did.

    Not ``acks_late``: a round lost with its worker is simply the next one. Scheduled with an
    ``expires`` of its interval (:func:`ratelimits.periodic.beat_schedule`), so rounds a stalled
    worker missed are dropped, not run in a burst.
    """
    return reconcile().summary()
