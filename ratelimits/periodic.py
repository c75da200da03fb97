"""The periodic work the app needs, and how often: one list, for Celery beat and for the command.

Usage is counted in the store, per minute, in the decision's own round trip. Nothing of it reaches
the database until a drain moves the closed minutes into ``UsageRecord`` rows (the readers see the
minutes not drained yet live, for an hour), and counters nothing drains expire after two days.
The roll-up and the purges keep the tables small; expired overrides and assignments are deleted
(audited); the notices' deliveries due are sent, and repeated refusals looked for. These are
:data:`JOBS`:

- with Celery, :func:`install_beat_schedule` adds them to the project's beat schedule in one line
  (its own entries of the same name win), and beat sends the tasks of :mod:`ratelimits.tasks`;
- without, ``manage.py ratelimits_drain`` runs the same jobs on the same cadence, as a sidecar
  (``--every``), or once from cron (``--once``).

This module reads settings only: a project's Celery module imports it while Django's settings are
still loading, before any model can be. Nothing here imports Celery (:mod:`ratelimits.tasks` is
the only module that does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .conf import conf

__all__ = ["DRAIN_TASK", "JOBS", "Job", "beat_schedule", "drains", "install_beat_schedule"]

#: The Celery task that drains usage (what :func:`drains` looks for in a beat schedule).
DRAIN_TASK = "ratelimits.drain_usage"


@dataclass(frozen=True)
class Job:
    """One piece of periodic work: its beat entry's name, its Celery task, and how often it runs."""

    name: str
    task: str
    #: Seconds between runs, or the setting that says, read when it is asked for.
    every_s: float | Callable[[], float]
    #: Whether ``manage.py ratelimits_drain`` runs it too (the digest mails people: Celery's alone).
    in_command: bool = True
    #: Whether a run not started within its interval is dropped (``expires``), not run late: a
    #: backlog of sweeps after a worker's outage would each find nothing the first did not.
    drop_late: bool = False

    @property
    def interval(self) -> float:
        return self.every_s() if callable(self.every_s) else self.every_s


JOBS = (
    Job("ratelimits-drain-usage", DRAIN_TASK, lambda: conf.usage.drain_every),
    Job("ratelimits-maintain-usage", "ratelimits.maintain_usage", 15 * 60.0),
    Job("ratelimits-expire-policies", "ratelimits.expire_policies", 60 * 60.0),
    Job("ratelimits-send-notices", "ratelimits.send_notices", lambda: conf.usage.notices.every, drop_late=True),
    Job("ratelimits-near-limit-digest", "ratelimits.near_limit_digest", 24 * 60 * 60.0, in_command=False),
)


def beat_schedule() -> dict[str, dict[str, Any]]:
    """:data:`JOBS` as Celery beat entries; with ``REGIONS``, the reconciliation round too.

    A round of reconciliation, or a sweep of the notices, not started within its interval is
    dropped (``expires``), not run late in a burst.
    """
    schedule: dict[str, dict[str, Any]] = {}
    for job in JOBS:
        interval = job.interval
        entry: dict[str, Any] = {"task": job.task, "schedule": interval}
        if job.drop_late:
            # Beat's clock against the worker's: a minute's room, so a skew of seconds drops nothing.
            entry["options"] = {"expires": max(2 * interval, 60.0)}
        schedule[job.name] = entry
    if conf.regions.stores:
        interval = conf.regions.reconcile.interval
        schedule["ratelimits-reconcile-regions"] = {
            "task": "ratelimits.reconcile_regions",
            "schedule": interval,
            "options": {"expires": interval},
        }
    return schedule


def install_beat_schedule(app: Any) -> None:
    """Add :func:`beat_schedule` to a Celery app's ``beat_schedule``; entries it has of the same name win.

    One line in the project's Celery module, anywhere after the app is made::

        install_beat_schedule(app)

    The schedule reads Django's settings (``USAGE['DRAIN_EVERY']``, ``REGIONS``), which are not
    ready while that module is imported: it is added once the app is configured, after
    ``config_from_object`` has read them, over whatever the module set meanwhile.
    """
    if app.configured:
        _add_schedule(app)
    else:
        app.on_after_configure.connect(_add_schedule, weak=False)


def _add_schedule(sender: Any, **kwargs: Any) -> None:
    sender.conf.beat_schedule = {**beat_schedule(), **(sender.conf.beat_schedule or {})}


def drains(schedule: object) -> bool:
    """Whether a beat schedule (a dict of entries) sends the drain task."""
    if not isinstance(schedule, dict):
        return False
    return any(isinstance(entry, dict) and entry.get("task") == DRAIN_TASK for entry in schedule.values())
