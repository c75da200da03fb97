"""Policy loading never blocks requests: bounded waits on the database, the last good snapshot, a background retry.

The finding: with ``ratelimits_tier`` held under ``LOCK TABLE ... ACCESS EXCLUSIVE`` and an
unrelated policy saved, every worker's reload waited on the lock, and no request completed for
8.2 s. These tests hold the same lock on PostgreSQL (the database CI runs first); the whole stack
under gunicorn is ``test_policy_lock.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from ratelimits import engine
from ratelimits.models import Tier
from ratelimits.store.database import DatabasePolicySource, bounded_waits

from .support.polling import wait_until
from .support.settings import merged

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="LOCK TABLE needs PostgreSQL"),
]

#: How long a load waits on the database (``POLICIES['LOAD_TIMEOUT']``): a call that waited on the lock
#: takes at least this, so a call that did not is told apart by taking well under it (half, below).
LOAD_TIMEOUT_S = 0.4
#: Bound on how long a reload that meets the lock may take: the lock timeout, plus a second for the
#: rest of the load on a loaded machine (a connection, a few queries: tens of milliseconds).
REACTION_BOUND_S = LOAD_TIMEOUT_S + 1.0


def other_connection() -> psycopg.Connection[Any]:
    """A second connection to the test database, as another process would hold it."""
    params = connection.get_connection_params()
    return psycopg.connect(
        dbname=params["dbname"], user=params.get("user"), host=params.get("host"), port=params.get("port")
    )


@contextlib.contextmanager
def locked() -> Iterator[psycopg.Connection[Any]]:
    """``ratelimits_tier`` under ACCESS EXCLUSIVE in another connection, until the test commits it."""
    locker = other_connection()
    locker.execute("LOCK TABLE ratelimits_tier IN ACCESS EXCLUSIVE MODE")
    try:
        yield locker
    finally:
        locker.rollback()
        locker.close()


@pytest.fixture
def source(settings: Any) -> DatabasePolicySource:
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"POLICIES": {"SOURCE": "database", "LOAD_TIMEOUT": f"{LOAD_TIMEOUT_S * 1000:.0f}ms"}}
    )
    engine.reset()
    built = engine.get_policy_source()
    assert isinstance(built, DatabasePolicySource)
    built.retry_backoff = (0.05, 0.2)  # quick retries, so the test's bounded wait can be short
    return built


def test_a_reload_that_meets_the_lock_serves_the_last_snapshot_and_applies_the_change_after(
    source: DatabasePolicySource,
) -> None:
    # A tier of the test's own: a transactional test before this one may have flushed the seeded ones.
    Tier.objects.update_or_create(name="lockable", defaults={"rate": "100/s", "burst": 100})
    first = source.snapshot()
    assert first.tiers["lockable"][0].rate.limit == 100
    with locked() as locker:
        source.invalidate()
        held(source, first, locker)
    assert wait_until(lambda: source.snapshot().tiers["lockable"][0].rate.limit == 7, 5.0)


def held(source: DatabasePolicySource, first: Any, locker: psycopg.Connection[Any]) -> None:

    start = time.monotonic()
    served = source.snapshot()
    assert time.monotonic() - start < REACTION_BOUND_S
    assert served is first  # the last good snapshot, not a stall

    # More requests while the lock holds: each answered at once from the snapshot in hand. One that
    # waited on the lock would take the whole lock timeout (0.4 s); one that did not takes microseconds,
    # and a loaded machine's scheduling delays are milliseconds: half the timeout tells them apart.
    for _ in range(20):
        start = time.monotonic()
        assert source.snapshot() is first
        assert time.monotonic() - start < LOAD_TIMEOUT_S / 2

    # The locker changes the tier and commits: the lock goes, and the background retry loads it.
    locker.execute("UPDATE ratelimits_tier SET rate = '7/s', burst = 7 WHERE name = 'lockable'")
    locker.commit()


def test_a_first_load_that_fails_decides_on_the_settings_policies_until_the_tables_answer(
    source: DatabasePolicySource, caplog: pytest.LogCaptureFixture
) -> None:
    Tier.objects.create(name="tables-own", rate="10/s")
    start = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="ratelimits"), locked():
        fallback = source.snapshot()
        assert time.monotonic() - start < REACTION_BOUND_S
        assert set(fallback.tiers) == {"anonymous", "authenticated"}  # the settings' default tiers
    assert any("the policy tables cannot be read (OperationalError" in r.getMessage() for r in caplog.records)
    # Unlocked: the background reload reads the tables, with no request's help.
    assert wait_until(lambda: "tables-own" in source.snapshot().tiers, 10.0)


def test_bounded_waits_leave_an_outer_transaction_its_own_timeouts() -> None:
    def timeouts() -> tuple[str, str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('lock_timeout'), current_setting('statement_timeout')")
            row = cursor.fetchone()
        return row[0], row[1]

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '7s'")
        before = timeouts()
        with bounded_waits(0.25):
            assert timeouts() == ("250ms", "250ms")
        assert timeouts() == before == ("7s", "0")
