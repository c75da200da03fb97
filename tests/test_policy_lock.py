"""The finding's lock, under gunicorn and traffic: a locked policy table does not stall the API.

``gunicorn --workers 2 --threads 4 project.wsgi`` on a private Redis and a throwaway PostgreSQL
database (``migrate`` and ``seed_demo`` run against it). Four client threads call
``GET /v1/customers`` for a baseline, then another connection holds ``ratelimits_tier`` under
``ACCESS EXCLUSIVE`` for 10 s while an unrelated endpoint policy is changed and published: every
worker then wants to reload, and meets the lock. Requests keep their latency (none waits for the
release; the p99 within 2x the baseline's plus one reload's bounded wait), and the change applies
once the lock is released.

Every wait is a bounded poll; every process started here is stopped by its PID.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from .support.demo import Demo, demo_server
from .support.http import fetch

pytestmark = pytest.mark.slow

GLOBEX_KEY = "sk_std_demo_globex_000000000"
VERSION_KEY = "rl:policy-version"
CLIENTS = 4
#: Traffic before the lock: the first WARM_UP_S of it (workers' first loads and connections) is left out.
#: What is left is as long as the lock is held: two p99s over as many requests, each as exposed to a
#: busy machine's stalls (a 4 s baseline's p99 was a handful of requests, and a spike in the longer
#: lock window alone could double it).
BASELINE_S, WARM_UP_S = 12.0, 2.0
LOCK_S = 10.0
#: POLICIES['LOAD_TIMEOUT']'s default: the longest a reload waits on the lock before it gives up.
LOAD_TIMEOUT_S = 0.1
#: What the change makes of the customers endpoint: a per-caller limit ``RateLimit-Policy`` then lists.
NEW_LIMIT = '"endpoint:customers";q=7;w=60'


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


class Traffic:
    """Client threads calling the API until stopped; each latency is kept with when it started."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[tuple[float, float, int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {GLOBEX_KEY}"}
        while not self._stop.is_set():
            start = time.monotonic()
            reply = fetch(self.port, "GET", "/v1/customers", headers=headers)
            self.samples.append(
                (start, time.monotonic() - start, reply.status, reply.headers.get("RateLimit-Policy", ""))
            )

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def between(self, start: float, end: float) -> list[float]:
        return [seconds for at, seconds, _, _ in list(self.samples) if start <= at < end]


@pytest.fixture
def demo() -> Iterator[Demo]:
    with demo_server("lock", workers=2, threads=4) as server:
        yield server


def test_a_locked_tier_table_keeps_latency_and_the_change_applies_after(demo: Demo) -> None:
    port, database_url, redis_server = demo.port, demo.database_url, demo.redis
    with Traffic(port) as traffic:
        time.sleep(BASELINE_S)  # the baseline's length: traffic runs meanwhile
        locked_at = time.monotonic()
        with psycopg.connect(database_url) as locker, psycopg.connect(database_url, autocommit=True) as editor:
            locker.execute("LOCK TABLE ratelimits_tier IN ACCESS EXCLUSIVE MODE")
            # An unrelated endpoint policy saved from another connection, and published to Redis as
            # a commit through the app would: every worker now wants to reload, and meets the lock.
            editor.execute("UPDATE ratelimits_endpointpolicy SET per_caller_rate = '7/m' WHERE endpoint = 'customers'")
            editor.execute("UPDATE ratelimits_policyversion SET value = value + 1 WHERE id = 1")
            version = editor.execute("SELECT value FROM ratelimits_policyversion WHERE id = 1").fetchone()
            assert version is not None
            client = redis_server.client()
            client.set(VERSION_KEY, str(version[0]))
            client.close()
            time.sleep(LOCK_S)  # how long the lock is held: the finding's stall lasted 8.2 s
            locker.rollback()
        released_at = time.monotonic()
        deadline = released_at + 10
        while time.monotonic() < deadline and not any(
            NEW_LIMIT in policies.split(", ") for at, _, _, policies in list(traffic.samples) if at > released_at
        ):
            time.sleep(0.05)  # a bounded poll for the change to show
    baseline = traffic.between(locked_at - BASELINE_S + WARM_UP_S, locked_at)
    during = traffic.between(locked_at, released_at)
    applied = [at for at, _, _, policies in traffic.samples if NEW_LIMIT in policies.split(", ")]
    print(
        f"\nbaseline p50 {statistics.median(baseline) * 1000:.1f} ms, p99 {p99(baseline) * 1000:.1f} ms over "
        f"{len(baseline)} requests; locked p50 {statistics.median(during) * 1000:.1f} ms, "
        f"p99 {p99(during) * 1000:.1f} ms over {len(during)}; max {max(during) * 1000:.1f} ms; "
        f"change applied {(min(applied) - released_at) * 1000:.0f} ms after the release"
    )
    assert len(during) > 20 * LOCK_S  # requests kept completing while the lock held
    # No request waited for the lock's release (the finding's stall: 8.2 s of it).
    assert max(during) < LOCK_S / 2
    # Each worker thread's first reload after the change waits up to POLICIES['LOAD_TIMEOUT'] on the
    # lock, then keeps its snapshot: up to 8 requests of the ~600 (gunicorn 2x4), about the 1% the
    # p99 reads, may carry that wait. So the p99 is within 2x the baseline's plus that wait (the
    # bound without it failed once beside the CPU hogs and a test suite: 281 ms against 238).
    assert p99(during) <= 2 * p99(baseline) + LOAD_TIMEOUT_S
    assert applied and min(applied) >= released_at - 0.5  # not before the lock went (the reload needs it)
    assert min(applied) - released_at < 6  # the background retry's backoff caps at 5 s
    # The demo's fleet sheds "normal" requests above 4 in flight: a 503 now and then is the shedder.
    assert {status for _, _, status, _ in traffic.samples} <= {200, 429, 503}
