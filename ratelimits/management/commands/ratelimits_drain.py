"""Run the app's periodic work without Celery: drain usage into the database, keep it rolled up, expire policies."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from ...conf import conf
from ...exceptions import ConfigurationError
from ...periodic import DRAIN_TASK, JOBS, Job
from ...rates import parse_duration
from ...store.expiry import expire_policies
from ...store.notices import sweep as send_notices
from ...usage import drain, maintain

logger = logging.getLogger("ratelimits")

#: What each job of :data:`ratelimits.periodic.JOBS` the command runs does, by its Celery task's name.
RUNS: dict[str, Callable[[], object]] = {
    DRAIN_TASK: drain,
    "ratelimits.maintain_usage": maintain,
    "ratelimits.expire_policies": expire_policies,
    "ratelimits.send_notices": send_notices,
}


class Command(BaseCommand):
    help = (
        "Drain usage counters into the database (and roll them up, purge old rows, expire overrides), as "
        "Celery beat would: every --every (default USAGE['DRAIN_EVERY'], 30s) until SIGTERM or SIGINT, as a "
        "sidecar; or each job once with --once, from cron."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        when = parser.add_mutually_exclusive_group()
        when.add_argument(
            "--every",
            metavar="DURATION",
            help="How often to drain, e.g. 30s or 1m (default: USAGE['DRAIN_EVERY']). The roll-up runs every "
            "15 minutes and policy expiry every hour, whatever this says.",
        )
        when.add_argument("--once", action="store_true", help="Run every job once, then exit (for cron).")

    def handle(self, *args: Any, **options: Any) -> None:
        self.verbosity = int(options["verbosity"])
        jobs = [job for job in JOBS if job.in_command]
        if options["once"]:
            for job in jobs:
                self._run(job, shown=self.verbosity >= 1)
            return
        try:
            every = conf.usage.drain_every
            if options["every"] is not None:
                every = parse_duration(options["every"], field="--every") / 1_000_000
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        intervals = {job.name: every if job.task == DRAIN_TASK else job.interval for job in jobs}
        stop = threading.Event()
        self._on_signals(stop)
        self.stdout.write(
            "Running the periodic work until SIGTERM or SIGINT: "
            + ", ".join(f"{job.name.removeprefix('ratelimits-')} every {intervals[job.name]:g} s" for job in jobs)
        )
        due = dict.fromkeys(intervals, time.monotonic())
        while not stop.is_set():
            for job in jobs:
                if stop.is_set():
                    break
                if time.monotonic() >= due[job.name]:
                    self._run(job, shown=self.verbosity >= 2)
                    due[job.name] = time.monotonic() + intervals[job.name]
            stop.wait(max(min(due.values()) - time.monotonic(), 0.0))
        self.stdout.write("Stopped.")

    def _run(self, job: Job, *, shown: bool) -> None:
        """One run of ``job``, its result written if ``shown``; a failure logged, and the next run tried as usual."""
        _drop_broken_connections()
        try:
            result = RUNS[job.task]()
        except Exception as exc:
            # A database or store that is down for a while must not end a sidecar: the counters wait
            # in the store (two days), and the next run drains them.
            logger.exception("ratelimits: %s failed", job.name)
            self.stderr.write(f"{job.name} failed: {type(exc).__name__}: {exc}")
            return
        if shown:
            self.stdout.write(f"{job.name}: {result}")

    @staticmethod
    def _on_signals(stop: threading.Event) -> None:
        """SIGTERM and SIGINT end the loop once the job under way has finished (nothing is cut in half)."""

        def stopping(signum: int, frame: FrameType | None) -> None:
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stopping)


def _drop_broken_connections() -> None:
    """Drop a connection the database closed (a restart, a failover) or that is past ``CONN_MAX_AGE``.

    What Django does before each request and Celery before each task (``close_old_connections``),
    so that a sidecar running for weeks does not fail every run after one outage; never inside a
    transaction, which a caller (``call_command`` from code, a test) may hold open around the run.
    """
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()
