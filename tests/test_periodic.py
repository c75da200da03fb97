"""The periodic work ships with the app: a Celery beat schedule in one line, a command without Celery.

The finding: the drain "every 30 s" lived in the demo's own ``apps.py`` and ``celery.py``. A project
that followed the README got counters that sat in Redis, expired after two days, and an empty usage
report. Now ``ratelimits.periodic`` is the schedule, ``install_beat_schedule(app)`` puts it in a
project's Celery app, ``manage.py ratelimits_drain`` runs it without Celery, ``manage.py check``
says so in DEBUG when counters sit undrained, and the admin's report says when the drain last ran.
The command's loop runs here as a real process, against a Redis and a PostgreSQL database of its own.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, current_app
from django.core.management import CommandError, call_command
from django.test import Client

from ratelimits.backends import get_backend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.checks import W021, check_drain
from ratelimits.counters import ALLOWED, usage_for
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import UsageRecord
from ratelimits.periodic import JOBS, beat_schedule, drains, install_beat_schedule
from ratelimits.usage.live import STALE_S

from .support.celery_app import celery_env
from .support.postgres import throwaway_database
from .support.processes import Service, manage
from .support.redis_server import RedisServer
from .support.settings import merged

REPORT = "/admin/ratelimits/fleetsettings/usage/"


def counted(backend: Any, minutes_ago: float, ip: str = "198.51.100.40", requests: int = 3) -> int:
    """``requests`` allowed requests from ``ip``, counted in the minute ``minutes_ago`` as decisions count them."""
    minute = int((time.time() - minutes_ago * 60) // 60)
    row = usage_for(Subject(SubjectKind.IP, ip), None, "anonymous", "ping", 1).field
    backend.add_usage({(minute, row): 1, (minute, row + ALLOWED): requests})
    return minute


# -- the schedule ------------------------------------------------------------------------------------


def test_install_adds_the_schedule_once_celery_has_read_the_settings(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"DRAIN_EVERY": "10s"}})
    app = Celery("fresh", set_as_current=False)
    app.conf.beat_schedule = {"mine": {"task": "mine.report", "schedule": 60.0}}
    install_beat_schedule(app)  # in a project's celery.py: before the app has read Django's settings
    assert not app.configured
    schedule = app.conf.beat_schedule  # reading the configuration configures the app
    assert schedule["mine"] == {"task": "mine.report", "schedule": 60.0}
    assert {name: entry["schedule"] for name, entry in schedule.items() if name != "mine"} == {
        "ratelimits-drain-usage": 10.0,
        "ratelimits-maintain-usage": 900.0,
        "ratelimits-expire-policies": 3600.0,
        "ratelimits-send-notices": 10.0,
        "ratelimits-near-limit-digest": 86400.0,
    }
    assert schedule["ratelimits-send-notices"]["options"] == {"expires": 60.0}  # a sweep a minute late is dropped
    assert {schedule[job.name]["task"] for job in JOBS} == {
        "ratelimits.drain_usage",
        "ratelimits.maintain_usage",
        "ratelimits.expire_policies",
        "ratelimits.send_notices",
        "ratelimits.near_limit_digest",
    }


def test_the_projects_own_entry_of_the_same_name_wins_and_a_configured_app_gets_it_at_once() -> None:
    app = Celery("configured", set_as_current=False)
    app.conf.beat_schedule = {"ratelimits-drain-usage": {"task": "ratelimits.drain_usage", "schedule": 5.0}}
    assert app.conf.timezone is None and app.configured  # a read configures it
    install_beat_schedule(app)
    assert app.conf.beat_schedule["ratelimits-drain-usage"]["schedule"] == 5.0
    assert set(app.conf.beat_schedule) == {job.name for job in JOBS}


def test_with_regions_the_reconciliation_round_is_scheduled_and_dropped_when_late(settings: Any) -> None:
    assert "ratelimits-reconcile-regions" not in beat_schedule()
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "REGIONS": {
                "LOCAL": "eu",
                "STORES": {"eu": "redis://127.0.0.1:1/0", "us": "redis://127.0.0.1:2/0"},
                "RECONCILE_INTERVAL": "2s",
            }
        },
    )
    entry = beat_schedule()["ratelimits-reconcile-regions"]
    assert entry == {"task": "ratelimits.reconcile_regions", "schedule": 2.0, "options": {"expires": 2.0}}


def test_drains_reads_a_schedule_by_its_tasks() -> None:
    assert drains(beat_schedule())
    assert drains({"anything": {"task": "ratelimits.drain_usage", "schedule": 30}})
    assert not drains({"ratelimits-drain-usage": {"task": "other", "schedule": 30}})
    assert not drains(None) and not drains({"bad": "entry"})


# -- the check ---------------------------------------------------------------------------------------


@pytest.fixture
def no_beat_schedule() -> Iterator[Celery]:
    """A project's Celery app that schedules nothing, current for the test (this suite loads the demo's, which does)."""
    demo = current_app._get_current_object()
    bare = Celery("bare", set_as_current=True)
    bare.conf.beat_schedule = {}
    try:
        yield bare
    finally:
        demo.set_current()


@pytest.mark.django_db
def test_in_debug_counters_nothing_drained_for_minutes_are_a_warning(settings: Any, no_beat_schedule: Celery) -> None:
    settings.DEBUG = True
    backend = get_backend()
    counted(backend, minutes_ago=0)  # this minute: the drain has not had its chance
    counted(backend, minutes_ago=STALE_S / 60 - 2)  # closed, but less than STALE_S ago
    assert check_drain() == []
    minute = counted(backend, minutes_ago=STALE_S / 60 + 3)
    [warning] = check_drain()
    assert warning.id == W021
    since = datetime.fromtimestamp(minute * 60, tz=UTC)
    assert f"Usage counted since {since:%Y-%m-%d %H:%M} UTC is still in the limiter's store" in warning.msg
    assert "install_beat_schedule(app)" in str(warning.hint) and "ratelimits_drain" in str(warning.hint)
    assert "usage.html#scheduling-the-drain" in str(warning.hint)
    # A beat schedule that drains (in the settings, or the project's app), or production: no word.
    settings.CELERY_BEAT_SCHEDULE = {"drain": {"task": "ratelimits.drain_usage", "schedule": 30.0}}
    assert check_drain() == []
    del settings.CELERY_BEAT_SCHEDULE
    install_beat_schedule(no_beat_schedule)
    assert check_drain() == []
    no_beat_schedule.conf.beat_schedule = {}
    settings.DEBUG = False
    assert check_drain() == []
    # Drained: nothing left to warn about.
    settings.DEBUG = True
    call_command("ratelimits_drain", "--once", stdout=StringIO())
    assert check_drain() == []


# -- the command, once ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_once_runs_every_job_and_the_report_says_when_the_drain_ran(admin_client: Client) -> None:
    page = admin_client.get(REPORT).content.decode()
    assert "No drain has moved counters into the database yet." in page
    counted(get_backend(), minutes_ago=STALE_S / 60 + 3, requests=4)
    assert 'id="usage-drain-stale"' in admin_client.get(REPORT).content.decode()
    out = StringIO()
    call_command("ratelimits_drain", "--once", stdout=out)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "ratelimits-drain-usage",
        "ratelimits-maintain-usage",
        "ratelimits-expire-policies",
        "ratelimits-send-notices",
    ]
    assert lines[0] == "ratelimits-drain-usage: 1"  # one batch applied
    assert sum(row.allowed for row in UsageRecord.objects.filter(granularity="minute")) == 4
    page = admin_client.get(REPORT).content.decode()
    assert "The last drain moved counters into the database at" in page and 'id="usage-drain-stale"' not in page


@pytest.mark.parametrize(("every", "says"), [("often", "is not a duration"), ("0s", "zero-length")])
def test_a_bad_every_is_an_error_naming_the_option(every: str, says: str) -> None:
    with pytest.raises(CommandError, match=f"^--every: .*{says}"):
        call_command("ratelimits_drain", "--every", every)


def test_every_and_once_exclude_each_other() -> None:
    with pytest.raises(CommandError, match="not allowed with argument"):
        call_command("ratelimits_drain", "--once", "--every", "1s")


# -- the command, as a sidecar ---------------------------------------------------------------------


@contextlib.contextmanager
def demo_stack() -> Iterator[tuple[RedisServer, str, dict[str, str]]]:
    """A private Redis and a migrated PostgreSQL database of their own, and the demo's environment for them."""
    with RedisServer() as redis_server, throwaway_database("ratelimits_drain") as database_url:
        env = celery_env(database_url=database_url, redis_url=redis_server.url, queue="unused")
        manage(env, "migrate", "--noinput", "-v", "0")
        yield redis_server, database_url, env


def drained(database_url: str) -> int:
    with psycopg.connect(database_url, connect_timeout=10) as conn:
        # Minute rows only: the upkeep rolls a closed hour (or day) up into rows of its own.
        row = conn.execute(
            "SELECT COALESCE(SUM(allowed), 0) FROM ratelimits_usagerecord WHERE granularity = 'minute'"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.slow
def test_the_sidecar_drains_on_its_cadence_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    with demo_stack() as (redis_server, database_url, env):
        store = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
        counted(store, minutes_ago=2, requests=5)
        argv = [sys.executable, "manage.py", "ratelimits_drain", "--every", "1s", "-v", "2"]
        sidecar = Service("ratelimits_drain", argv, tmp_path)
        sidecar.start(env)
        process = sidecar.process
        try:
            sidecar.wait_for_log(r"ratelimits-drain-usage: 1\b", 30, "the first drain")
            assert drained(database_url) == 5
            counted(store, minutes_ago=1, ip="198.51.100.41", requests=2)  # closed since: the next run takes it
            deadline = time.monotonic() + 30
            while drained(database_url) != 7:
                assert time.monotonic() < deadline, sidecar.log_text()[-2000:]
                time.sleep(0.2)
        finally:
            sidecar.stop()
        assert process is not None and process.returncode == 0, sidecar.tail()
        assert sidecar.log_text().rstrip().endswith("Stopped."), sidecar.tail()  # the job under way, finished
