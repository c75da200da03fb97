"""Deploy mistakes are never the outage: a table not migrated yet, and migrations not applied.

The finding: with the database source and ``migrate`` not yet run, every request returned 500
(``no such table: ratelimits_policyversion``), whatever the fail mode; with the settings source
the log said ``TransactionManagementError``, hiding the missing table. Here a table is taken away
for real (renamed, then put back), on PostgreSQL and SQLite alike.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import DatabaseError, connection
from django.db.migrations.recorder import MigrationRecorder
from django.db.transaction import TransactionManagementError
from rest_framework.test import APIClient

import ratelimits
from ratelimits import engine
from ratelimits.checks import check_database, unapplied_migrations
from ratelimits.models import EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier
from ratelimits.store.audit import audit_context
from ratelimits.store.database import DatabasePolicySource, bounded_waits
from ratelimits.usage import subjects

from .support.bursts import close_thread_connections
from .support.polling import wait_until
from .support.settings import merged

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def without(*tables: str) -> Iterator[None]:
    """``tables`` gone, as before ``migrate`` created them; back afterwards, whatever happened."""
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            for table in tables:
                cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")


@pytest.fixture
def database_source(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "POLICIES": {"SOURCE": "database"},
            # What the settings say, and what is enforced while the tables cannot be read.
            "TIERS": {"anonymous": {"rate": "5/m"}, "authenticated": {"rate": "5/m"}},
        },
    )
    engine.reset()


def test_without_the_policy_tables_no_request_fails_and_the_settings_limits_hold(
    database_source: None, caplog: pytest.LogCaptureFixture
) -> None:
    client = APIClient(REMOTE_ADDR="198.51.100.40")
    source = engine.get_policy_source()
    assert isinstance(source, DatabasePolicySource)
    with caplog.at_level(logging.ERROR, logger="ratelimits"), without("ratelimits_policyversion", "ratelimits_tier"):
        codes = [client.get("/t/ping").status_code for _ in range(100)]
        fallback = source.snapshot()
    assert set(codes) <= {200, 429} and codes[:5] == [200] * 5 and codes[5:] == [429] * 95
    said = [r.getMessage() for r in caplog.records if "policy tables cannot be read" in r.getMessage()]
    assert len(said) == 1, said  # one clear line, not one a request
    assert ": run manage.py migrate; deciding on the settings' policies" in said[0]
    assert set(fallback.tiers) == {"anonymous", "authenticated"}  # the settings' tiers
    # The tables back: the source reads them in the background, as if migrate had just run.
    assert wait_until(lambda: source.snapshot() is not fallback, 10.0)


def test_without_the_usage_labels_table_the_log_names_the_missing_table(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"TIERS": {"anonymous": "100/s", "authenticated": "100/s"}})
    engine.reset()
    with caplog.at_level(logging.WARNING, logger="ratelimits"), without("ratelimits_usagesubject"):
        # The label of a new caller is written after its response, or here if it was not due yet.
        assert APIClient(REMOTE_ADDR="198.51.100.41").get("/t/ping").status_code == 200
        assert subjects.write_pending() == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "usage subject labels not written" in said and "run manage.py migrate" in said
    assert "TransactionManagementError" not in said


def test_a_failed_statement_inside_bounded_waits_is_reported_as_itself() -> None:
    with pytest.raises(DatabaseError) as caught, bounded_waits(0.25), connection.cursor() as cursor:
        cursor.execute("SELECT * FROM ratelimits_no_such_table")
    assert not isinstance(caught.value, TransactionManagementError)
    assert "ratelimits_no_such_table" in str(caught.value)


#: The app's migrations.
MIGRATIONS = Path(ratelimits.__file__).parent / "migrations"


class TablesElsewhere:
    """A database router that keeps ratelimits' tables off every database."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if app_label == "ratelimits" else None


def test_unapplied_migrations_are_a_database_check(settings: Any) -> None:
    recorded = MigrationRecorder(connection).migration_qs
    assert unapplied_migrations() == [] and check_database(databases=["default"]) == []
    # The newest two, as a deploy that has not migrated yet leaves them.
    rows = sorted(recorded.filter(app="ratelimits"), key=lambda row: row.name)[-2:]
    names = [row.name for row in rows]
    assert names[-1] == max(path.stem for path in MIGRATIONS.glob("0*.py"))
    recorded.filter(pk__in=[row.pk for row in rows]).delete()
    try:
        assert unapplied_migrations() == names
        messages = check_database(databases=["default"])
        assert [m.id for m in messages] == ["ratelimits.W014"]
        assert messages[0].msg.startswith(
            f"ratelimits' migrations {names[0]}, {names[1]} are not applied on the database 'default'"
        )
        assert messages[0].hint == "Run manage.py migrate --database default."
        assert check_database() == []  # manage.py check without --database asks no database
        settings.DATABASE_ROUTERS = [f"{__name__}.{TablesElsewhere.__qualname__}"]
        assert check_database(databases=["default"]) == []  # the app's tables are not kept there
        settings.DATABASE_ROUTERS = []
    finally:
        for row in rows:
            recorded.create(app=row.app, name=row.name, applied=row.applied)
    assert check_database(databases=["default"]) == []


def test_with_the_database_source_the_check_names_drf_rates_the_tables_replace(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"anon": "2/min"}}
    Tier.objects.create(name="anonymous", rate="10/s")  # the anonymous callers' tier, in the tables
    engine.reset()
    messages = check_database(databases=["default"])
    assert [m.id for m in messages] == ["ratelimits.W010"]
    assert messages[0].msg.startswith("REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['anon'] ('2/min') is replaced by")


def test_requests_that_wait_for_the_first_load_share_its_fallback(
    database_source: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Eight threads asking at once while the tables are missing: one load fails, one line is logged."""
    source = engine.get_policy_source()
    assert isinstance(source, DatabasePolicySource)
    start = threading.Barrier(8)
    found: list[object] = []

    def ask() -> None:
        start.wait(timeout=10)
        found.append(source.snapshot())
        close_thread_connections()

    with caplog.at_level(logging.ERROR, logger="ratelimits"), without("ratelimits_policyversion", "ratelimits_tier"):
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert len(found) == 8 and len({id(snapshot) for snapshot in found}) == 1
    said = [r for r in caplog.records if "policy tables cannot be read" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's busy timeout is the connection's")
def test_a_failed_statement_leaves_the_connections_busy_timeout_as_it_was() -> None:
    def busy_timeout() -> int:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            return int(cursor.fetchone()[0])

    before = busy_timeout()
    with pytest.raises(DatabaseError), bounded_waits(0.05), connection.cursor() as cursor:
        cursor.execute("SELECT * FROM ratelimits_no_such_table")
    assert busy_timeout() == before != 50


def test_the_tables_placing_no_anonymous_caller_leave_drfs_anon_rate_in_force(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"anon": "2/min"}}
    with audit_context(reason="no tiers"):
        for model in (Override, SubjectAssignment, EndpointPolicy, FleetSettings, Tier):
            for row in model.objects.all():
                row.delete()
    engine.reset()
    client = APIClient(REMOTE_ADDR="198.51.100.42")
    assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 429]


def test_a_disabled_default_tier_stays_no_limits_and_the_check_says_it_replaces_anon(settings: Any) -> None:
    """The admin's "no limits for anonymous callers" is a choice DRF's ``anon`` rate must not undo."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"anon": "2/min"}}
    off = Tier.objects.create(name="off", rate="1/min", enabled=False)
    FleetSettings.objects.update_or_create(pk=1, defaults={"anonymous_tier": off})
    engine.reset()
    client = APIClient(REMOTE_ADDR="198.51.100.43")
    assert [client.get("/t/ping").status_code for _ in range(4)] == [200] * 4
    messages = [m for m in check_database(databases=["default"]) if m.id == "ratelimits.W010"]
    assert len(messages) == 1
    assert "'off', anonymous callers' default" in messages[0].msg
    assert "no limits (the tier is disabled)" in messages[0].msg
