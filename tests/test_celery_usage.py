"""Usage counters reach ``UsageRecord`` exactly once through a real Celery worker, beat and broker.

A private Redis, a PostgreSQL database of this module's own (created, migrated with the demo's
``migrate``, dropped afterwards), and RabbitMQ (``RATELIMITS_TEST_BROKER_URL``, by default
``amqp://guest:guest@127.0.0.1:5672//``) on a queue named for this run, so that runs sharing the
broker's vhost never take each other's tasks. ``celery -A project worker`` and ``celery -A project
beat`` run with ``tests.support.celery_settings``: the demo's settings with that queue, and beat draining
every 2 s. This process sends the traffic through the throttle (``/t/ping``, anonymous tier
10/m) into the shared Redis; the worker drains it into its database, which is read here with
psycopg. The drain only takes closed minutes, so each part waits for the minute to turn. The
counters name subjects by digest: the labels this process writes (into its own test database) are
copied into the worker's, where web workers sharing the worker's database would have written them.

1. Known traffic (10 admitted, 5 turned away) is drained by beat's tasks to exact totals, and
   later drains add nothing.
2. The worker (main process and pool children) is SIGKILLed in the middle of a drain: after the
   batch was claimed and rows written, before the commit. A new worker gets the unacknowledged
   task again (``acks_late``), takes the batch once the killed drain's lease ran out, and the
   totals are exact.
3. With beat stopped, one drain task is published twice with the same id; the worker's two pool
   processes run both at once. The totals are exact and the minute's batches are applied once.

And, without Celery: the drain's reads and deletes in Redis fit the limiter's 50 ms socket timeout
even for a minute of 150,000 subjects (one HGETALL of it did not, so such a minute never drained).

Every wait is a bounded poll of a condition; every process started here is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.counters import ROWS, parse_field, usage_for
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import UsageSubject
from ratelimits.usage.records import GRACE_S, LEASE_S
from ratelimits.usage.subjects import write_pending

from .support.celery_app import BROKER_URL, broker_reachable, celery_env, celery_processes
from .support.postgres import throwaway_database
from .support.processes import Service, manage
from .support.redis_server import RedisServer
from .support.settings import merged

pytestmark = pytest.mark.slow

DRAIN_EVERY_S = 2.0

#: The anonymous tier in this process: a request's counters go to its IP (``ip``, endpoint ``ping``).
LIMIT = 10
REQUESTS = 15
TIERS = {"anonymous": {"rate": f"{LIMIT}/m"}, "authenticated": {"rate": f"{LIMIT}/m"}}
#: Each subject one row of its minute. The kill needs a drain that takes a while (a bulk drain
#: applies thousands of rows in milliseconds): its filler is written straight into the counters.
KILL_FILLER = 30_000
DUPLICATE_FILLER = 500

START_TIMEOUT = 60.0
#: A minute turns within 60 s of any traffic; beat's next drain follows within DRAIN_EVERY_S.
MINUTE_TIMEOUT = 75.0
SETTLE_TIMEOUT = 45.0
#: Traffic is not started in a minute's last seconds, so each part's counts are one batch.
MINUTE_MARGIN_S = 15.0

RECEIVED = re.compile(r"Task ratelimits\.drain_usage\[([0-9a-f-]+)\] received")
SUCCEEDED = re.compile(r"Task ratelimits\.drain_usage\[([0-9a-f-]+)\] succeeded in ([\d.]+)s: (\d+)")
FINISHED = re.compile(r"Task ratelimits\.drain_usage\[([0-9a-f-]+)\] (?:succeeded|raised|retry|failed)")

Key = tuple[str, str, str]  # subject kind, subject id, endpoint
#: allowed, throttled, shed, degraded, tokens
Totals = tuple[int, int, int, int, int]


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Stack:
    redis_server: RedisServer
    database_url: str
    env: dict[str, str]
    queue: str
    client: Celery
    worker: Service
    beat: Service
    #: What every subject did, as this process saw its responses: the totals the drain must reach.
    expected: dict[Key, Totals] = field(default_factory=dict)

    def start_worker(self) -> None:
        self.worker.start(self.env)
        self.worker.wait_for_log(r"@\S+ ready\.", START_TIMEOUT, "ready line")

    def redis_client(self) -> redis.Redis:
        return self.redis_server.client()


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    if not broker_reachable():
        pytest.skip(f"no AMQP broker at {BROKER_URL} (set RATELIMITS_TEST_BROKER_URL)")
    failed_before = request.session.testsfailed
    token = secrets.token_hex(4)
    with contextlib.ExitStack() as cleanup:
        redis_server = cleanup.enter_context(RedisServer())
        database_url = cleanup.enter_context(throwaway_database("ratelimits_celery"))
        queue = f"ratelimits-test-{token}"
        env = celery_env(
            database_url=database_url,
            redis_url=redis_server.url,
            queue=queue,
            RATELIMITS_TEST_DRAIN_EVERY=f"{DRAIN_EVERY_S:g}",
        )
        manage(env, "migrate", "--noinput", "-v", "0")
        # Two pool processes, so that two deliveries of one task can run at the same time.
        processes = celery_processes(cleanup, queue=queue, node=f"ratelimits-test-{token}", concurrency=2)
        client, worker, beat = processes
        stack = Stack(redis_server, database_url, env, queue, client, worker, beat)
        stack.start_worker()
        beat.start(env)
        beat.wait_for_log("beat: Starting", START_TIMEOUT, "start")
        # Beat's tasks reach the worker through the broker, and the drain runs (on nothing yet).
        worker.wait_for_log(SUCCEEDED, START_TIMEOUT, "drain from beat")
        assert store_state(stack) == ([], [])
        yield stack
        if request.session.testsfailed != failed_before:
            processes.print_logs()


# -- traffic and totals ------------------------------------------------------------------------


@pytest.fixture
def limits(settings: Any, stack: Stack, db: None) -> Stack:
    """This process's limiter on the stack's Redis: its decisions count usage where the worker drains."""
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": stack.redis_server.url}, "TIERS": TIERS}
    )
    engine.reset()
    return stack


def send(stack: Stack, ip: str, requests: int) -> list[int]:
    """``requests`` GETs of /t/ping from ``ip``, counted into ``stack.expected`` as their statuses say."""
    client = APIClient(REMOTE_ADDR=ip)
    statuses = [client.get("/t/ping").status_code for _ in range(requests)]
    allowed, throttled = statuses.count(200), statuses.count(429)
    assert allowed + throttled == requests, statuses
    key = ("ip", ip, "ping")
    before = stack.expected.get(key, (0, 0, 0, 0, 0))
    stack.expected[key] = (before[0] + allowed, before[1] + throttled, before[2], before[3], before[4] + allowed)
    return statuses


def known_traffic(stack: Stack, ip: str, filler: int, filler_net: int) -> None:
    """The known mix from ``ip`` (LIMIT admitted, the rest 429), then one request from each of ``filler`` IPs."""
    assert send(stack, ip, REQUESTS) == [200] * LIMIT + [429] * (REQUESTS - LIMIT)
    for i in range(filler):
        assert send(stack, f"10.{filler_net}.{i // 256}.{i % 256}", 1) == [200]
    copy_labels(stack)


def counted_filler(stack: Stack, minute: int, filler: int, filler_net: int) -> None:
    """One allowed request from each of ``filler`` IPs, written into ``minute``'s counters as decisions
    write them, and their labels into the worker's database: rows enough for a drain to take a while."""
    subjects = [Subject(SubjectKind.IP, f"10.{filler_net}.{i >> 8}.{i & 255}") for i in range(filler)]
    client = stack.redis_client()
    try:
        with client.pipeline(transaction=False) as pipe:
            for start in range(0, filler, 5000):
                fields: dict[Any, Any] = {}
                for subject in subjects[start : start + 5000]:
                    row = usage_for(subject, None, "anonymous", "ping", 1).field
                    fields.update({row: 1, row + "a": 1})
                pipe.hset(f"rl:usage:{minute}", mapping=fields)
            pipe.hincrby(f"rl:usage:{minute}", ROWS, filler)
            pipe.execute()
    finally:
        client.close()
    copy_rows = "COPY ratelimits_usagesubject (digest, kind, value, first_seen, last_seen) FROM STDIN"
    now = datetime.now(tz=UTC)
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn, conn.cursor().copy(copy_rows) as copy:
        for subject in subjects:
            copy.write_row((subject.digest, "ip", subject.value, now, now))
    for subject in subjects:
        stack.expected[("ip", subject.value, "ping")] = (1, 0, 0, 0, 1)


def copy_labels(stack: Stack) -> None:
    """The subjects' labels, as this process wrote them into its database, into the worker's."""
    write_pending()  # those not due yet: a later request's end would write them
    labels = list(UsageSubject.objects.values_list("digest", "kind", "value"))
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn, conn.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO ratelimits_usagesubject (digest, kind, value, first_seen, last_seen) "
            "VALUES (%s, %s, %s, now(), now()) ON CONFLICT (digest) DO NOTHING",
            labels,
        )


def labels(stack: Stack) -> dict[str, str]:
    """Digest -> label, as the worker's drain finds them."""
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        return dict(conn.execute("SELECT digest, value FROM ratelimits_usagesubject").fetchall())


def recorded(stack: Stack) -> dict[Key, Totals]:
    """The minute rows in the worker's database, summed per subject and endpoint."""
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        rows = conn.execute(
            "SELECT subject_kind, subject_id, endpoint, sum(allowed), sum(throttled), sum(shed), sum(degraded), "
            "sum(tokens) FROM ratelimits_usagerecord WHERE granularity = 'minute' "
            "GROUP BY subject_kind, subject_id, endpoint"
        ).fetchall()
    return {(kind, sid, endpoint): tuple(int(v) for v in values) for kind, sid, endpoint, *values in rows}  # type: ignore[misc]


def batches_applied(stack: Stack) -> int:
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        row = conn.execute("SELECT count(*) FROM ratelimits_usagebatch").fetchone()
    assert row is not None
    return int(row[0])


def grand_total(totals: dict[Key, Totals]) -> Totals:
    sums = [sum(t[i] for t in totals.values()) for i in range(5)]
    return (sums[0], sums[1], sums[2], sums[3], sums[4])


def minute_now() -> int:
    return int(time.time() // 60)


def store_state(stack: Stack) -> tuple[list[int], list[str]]:
    """Minutes still counted live in Redis, and batches claimed by a drain but not yet forgotten."""
    client = stack.redis_client()
    try:
        live = sorted(int(k.decode().rsplit(":", 1)[1]) for k in client.scan_iter(match="rl:usage:*"))
        claimed = sorted(k.decode() for k in client.scan_iter(match="rl:usage-drain:*"))
    finally:
        client.close()
    return live, claimed


COLUMNS = ("allowed", "throttled", "shed", "degraded", "tokens")


def not_yet_applied(stack: Stack) -> dict[Key, Totals]:
    """What Redis still holds that the database does not: live minutes, and claimed batches not applied."""
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        applied = {row[0] for row in conn.execute("SELECT batch FROM ratelimits_usagebatch")}
    client = stack.redis_client()
    sums: dict[Key, list[int]] = {}
    labelled = labels(stack)
    try:
        keys = [k.decode() for k in client.scan_iter(match="rl:usage:*")] + [
            k.decode() for k in client.scan_iter(match="rl:usage-drain:*")
        ]
        for key in keys:
            if key in applied:
                continue
            for raw, count in client.hgetall(key).items():
                field = raw.decode()
                parsed = parse_field(field)
                if parsed is None:  # the count of rows, or a row's own marker
                    assert field == ROWS or field.endswith("]"), field
                    continue
                (kind, digest, _, _, endpoint), metric = parsed
                sums.setdefault((kind, labelled[digest], endpoint), [0] * 5)[COLUMNS.index(metric)] += int(count)
    finally:
        client.close()
    # Counters hold the tokens beyond one per allowed request ("x"); each allowed request spent one.
    return {key: (v[0], v[1], v[2], v[3], v[4] + v[0]) for key, v in sums.items()}


def add(a: dict[Key, Totals], b: dict[Key, Totals]) -> dict[Key, Totals]:
    keys = set(a) | set(b)
    zero = (0, 0, 0, 0, 0)
    return {k: tuple(x + y for x, y in zip(a.get(k, zero), b.get(k, zero), strict=True)) for k in keys}  # type: ignore[misc]


def start_traffic_early_in_a_minute() -> None:
    """Wait out a minute's last seconds, so that the traffic sent next is one minute's batch."""
    deadline = time.monotonic() + 15
    while time.time() % 60 > 60 - MINUTE_MARGIN_S and time.monotonic() < deadline:
        time.sleep(0.1)


def wait_until_drainable(minute: int) -> None:
    """Until ``minute`` has closed and the drain's grace after it has passed: the next drain takes it."""
    deadline = time.monotonic() + MINUTE_TIMEOUT
    while time.time() < (minute + 1) * 60 + GRACE_S:
        assert time.monotonic() < deadline, f"minute {minute} still open"
        time.sleep(0.05)


def diff(expected: dict[Key, Totals], got: dict[Key, Totals]) -> str:
    keys = sorted(set(expected) | set(got))
    wrong = [f"{k}: expected {expected.get(k)}, recorded {got.get(k)}" for k in keys if expected.get(k) != got.get(k)]
    return f"{len(wrong)} subjects differ: " + "; ".join(wrong[:10])


def wait_settled(stack: Stack, timeout: float = SETTLE_TIMEOUT) -> dict[Key, Totals]:
    """Poll until every closed minute is drained and forgotten and the rows equal ``stack.expected``."""
    deadline = time.monotonic() + timeout
    while True:
        live, claimed = store_state(stack)
        got = recorded(stack)
        closed = [m for m in live if m < minute_now()]
        if not closed and not claimed and got == stack.expected:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not settled after {timeout:g} s: closed minutes still live {closed}, claimed {claimed}, "
                f"{diff(stack.expected, got)}\n--- worker log ---\n{stack.worker.tail()}"
            )
        time.sleep(0.1)


def drains_done(stack: Stack) -> int:
    return len(SUCCEEDED.findall(stack.worker.log_text()))


def wait_for_more_drains(stack: Stack, done: int, more: int) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while drains_done(stack) < done + more:
        assert time.monotonic() < deadline, f"fewer than {more} more drains:\n{stack.worker.tail()}"
        time.sleep(0.1)


def assert_stays_exact(stack: Stack, more_drains: int = 2) -> dict[Key, Totals]:
    """Later drains find nothing to add: the totals stay exact."""
    wait_for_more_drains(stack, drains_done(stack), more_drains)
    got = recorded(stack)
    assert got == stack.expected, diff(stack.expected, got)
    return got


def report(title: str, stack: Stack, got: dict[Key, Totals], started: float) -> None:
    allowed, throttled, shed, degraded, tokens = grand_total(got)
    print(
        f"\n{title}: {len(got)} subjects, allowed {allowed}, throttled {throttled}, shed {shed}, "
        f"degraded {degraded}, tokens {tokens}; {batches_applied(stack)} batches applied "
        f"({time.monotonic() - started:.1f} s)"
    )


def unfinished_tasks(log: str) -> set[str]:
    """Drain tasks the worker received but never finished, as its log tells."""
    return set(RECEIVED.findall(log)) - set(FINISHED.findall(log))


# -- the tests ---------------------------------------------------------------------------------


def test_beat_and_worker_drain_known_traffic_to_exact_totals(limits: Stack) -> None:
    stack, started = limits, time.monotonic()
    start_traffic_early_in_a_minute()
    known_traffic(stack, "198.51.100.10", filler=0, filler_net=0)
    assert stack.expected == {("ip", "198.51.100.10", "ping"): (LIMIT, REQUESTS - LIMIT, 0, 0, LIMIT)}
    live, _ = store_state(stack)
    assert live, "the decisions counted usage in Redis"
    # Nothing is drained while the minute is open...
    assert recorded(stack) == {}
    wait_until_drainable(max(live))
    # ...and beat's next drains bring it in, exactly, and add nothing after.
    wait_settled(stack)
    got = assert_stays_exact(stack)
    assert grand_total(got) == (LIMIT, REQUESTS - LIMIT, 0, 0, LIMIT)
    report("drained by beat", stack, got, started)


def test_a_worker_killed_mid_drain_leaves_exact_totals_after_it_restarts(limits: Stack) -> None:
    stack, started = limits, time.monotonic()
    before = wait_settled(stack)
    start_traffic_early_in_a_minute()
    known_traffic(stack, "198.51.100.20", filler=0, filler_net=20)
    live, _ = store_state(stack)
    counted_filler(stack, max(live), KILL_FILLER, filler_net=20)
    wait_until_drainable(max(live))

    # Mid-drain: a batch is claimed in Redis and the drain's transaction has written rows that
    # are not committed yet (it holds a transaction id). Kill the worker, pool and all, right then.
    db_name = urllib.parse.urlsplit(stack.database_url).path.lstrip("/")
    deadline = time.monotonic() + MINUTE_TIMEOUT
    with psycopg.connect(stack.database_url, autocommit=True, connect_timeout=10) as conn:
        while True:
            assert time.monotonic() < deadline, f"no drain seen in progress\n{stack.worker.tail()}"
            writing = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
                "AND backend_xid IS NOT NULL",
                (db_name,),
            ).fetchone()
            if writing and writing[0] and store_state(stack)[1]:
                break
            time.sleep(0.005)
    stack.worker.kill()
    in_flight = unfinished_tasks(stack.worker.log_text())
    live, claimed = store_state(stack)
    at_kill = recorded(stack)
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        applied = {row[0] for row in conn.execute("SELECT batch FROM ratelimits_usagebatch")}
    print(
        f"\nkilled mid-drain: in flight {sorted(in_flight)}, live minutes {live}, claimed batches "
        f"{[(b, 'applied' if b in applied else 'not applied') for b in claimed]}, "
        f"{'rows as before the traffic' if at_kill == before else diff(stack.expected, at_kill)}"
    )
    assert in_flight, "the killed worker was running a drain"
    assert claimed, "the killed drain had claimed its batch and not forgotten it"
    # Nothing lost, nothing counted twice, even now: what the database has, plus what Redis holds
    # that it has not applied, is every request. (A batch's transaction is all or nothing.)
    in_sum = add(at_kill, not_yet_applied(stack))
    assert in_sum == stack.expected, diff(stack.expected, in_sum)

    # Restarted, the worker gets the unacknowledged task again and, once the killed drain's lease
    # on its batch ran out, applies it: the totals are exact.
    stack.start_worker()
    got = wait_settled(stack, SETTLE_TIMEOUT + LEASE_S)
    redelivered = set(RECEIVED.findall(stack.worker.log_text())) & in_flight
    assert redelivered, f"none of {in_flight} was delivered again:\n{stack.worker.tail()}"
    got = assert_stays_exact(stack)
    assert got[("ip", "198.51.100.20", "ping")] == (LIMIT, REQUESTS - LIMIT, 0, 0, LIMIT)
    print(f"delivered again to the new worker: {sorted(redelivered)}")
    report("after the kill and restart", stack, got, started)


def test_one_drain_task_delivered_twice_counts_once(limits: Stack) -> None:
    stack, started = limits, time.monotonic()
    wait_settled(stack)
    # Only the duplicates may drain this part: stop beat, then let the worker finish what it had.
    stack.beat.stop()
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        with stack.client.connection_for_write() as conn:
            ready = conn.default_channel.queue_declare(queue=stack.queue, passive=True).message_count
        if not ready and not unfinished_tasks(stack.worker.log_text()):
            break
        assert time.monotonic() < deadline, f"the queue never emptied ({ready} ready)"
        time.sleep(0.1)
    batches_before = batches_applied(stack)

    start_traffic_early_in_a_minute()
    known_traffic(stack, "198.51.100.30", filler=DUPLICATE_FILLER, filler_net=30)
    live, claimed = store_state(stack)
    assert len(live) == 1 and not claimed, (live, claimed)
    wait_until_drainable(max(live))
    assert store_state(stack) == (live, []), "nothing drains while beat is stopped"

    # The same task, id and all, published twice: as a broker redelivers a message, or a client retries.
    task_id = str(uuid.uuid4())
    for _ in range(2):
        stack.client.send_task("ratelimits.drain_usage", task_id=task_id, queue=stack.queue)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while len(runs := [r for r in SUCCEEDED.findall(stack.worker.log_text()) if r[0] == task_id]) < 2:
        assert time.monotonic() < deadline, f"the two deliveries did not both run:\n{stack.worker.tail()}"
        time.sleep(0.1)
    log = stack.worker.log_text()
    pools = Counter(re.findall(rf"\[[^\]]*/(\S+?)\] Task ratelimits\.drain_usage\[{task_id}\] succeeded", log))
    print(f"\nboth deliveries of {task_id}: {[f'{s}s -> {n} applied' for _, s, n in runs]}, pool processes {pools}")
    got = wait_settled(stack)
    # Exactly one batch (this minute's) applied between them, by one of the two.
    assert sorted(int(n) for _, _, n in runs) == [0, 1], runs
    assert batches_applied(stack) == batches_before + 1
    # A plain drain afterwards has nothing left either.
    done = drains_done(stack)
    stack.client.send_task("ratelimits.drain_usage", queue=stack.queue)
    wait_for_more_drains(stack, done, 1)
    assert recorded(stack) == stack.expected
    assert got[("ip", "198.51.100.30", "ping")] == (LIMIT, REQUESTS - LIMIT, 0, 0, LIMIT)
    report("after the duplicate delivery", stack, got, started)


BUSY_MINUTE_SUBJECTS = 150_000


def test_a_busy_minute_is_claimed_and_forgotten_within_the_limiters_timeouts(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The drain uses the limiter's own client (50 ms timeouts): a busy minute must still be read in full."""
    backend = RedisBackend(make_client(redis_server.url, 0.05, 0.05))
    minute = minute_now() - 5
    key = f"rl:usage:{minute}"
    with redis_client.pipeline(transaction=False) as pipe:
        for start in range(0, BUSY_MINUTE_SUBJECTS, 5000):
            fields: dict[Any, Any] = {}
            for i in range(start, min(start + 5000, BUSY_MINUTE_SUBJECTS)):
                ip = Subject(SubjectKind.IP, f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}")
                prefix = usage_for(ip, None, "anonymous", "ping", 1).field
                fields[prefix + "a"] = 1
                fields[prefix + "x"] = 1  # an extra token: a cost-2 request
            pipe.hset(key, mapping=fields)
        pipe.execute()
    started = time.monotonic()
    ((batch, claimed_minute),) = backend.claim_usage(minute + 1)
    counts = backend.lease_usage(batch, 30)
    claimed_in = time.monotonic() - started
    assert counts is not None
    assert claimed_minute == minute
    assert len(counts) == 2 * BUSY_MINUTE_SUBJECTS and set(counts.values()) == {1}
    backend.finish_usage(batch)
    assert redis_client.exists(batch) == 0
    assert backend.claim_usage(minute + 1) == []
    print(f"\n{BUSY_MINUTE_SUBJECTS} subjects claimed in {claimed_in:.2f} s and forgotten")
