"""Bounded usage: a cap on the rows a minute counts, a drain that applies a batch in bulk, leases."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import redis
from django.db import connection
from django.db.models.signals import post_save
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.backends import layout
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.counters import DEGRADED, OVERFLOW, ROWS, Usage, parse_field, usage_for
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import UsageBatch, UsageRecord, UsageSubject
from ratelimits.policies import Check, Policy
from ratelimits.rates import parse_rate
from ratelimits.usage import drain
from ratelimits.usage.subjects import write_pending

from .support.clock import FakeClock
from .support.redis_server import RedisServer
from .support.settings import merged

pytestmark = pytest.mark.django_db

LIMITS = {"TIERS": {"anonymous": {"rate": "100/m"}, "authenticated": {"rate": "100/m"}}}


@pytest.fixture(params=["memory", "redis"])
def backend_name(request: pytest.FixtureRequest, settings: Any) -> str:
    if request.param == "redis":
        request.getfixturevalue("use_redis")
    settings.RATELIMITS = merged(merged(settings.RATELIMITS, LIMITS), {"USAGE": {"MAX_SUBJECTS": 3}})
    return str(request.param)


def later() -> float:
    return time.time() + 120


def rows() -> dict[tuple[str, str, str], tuple[int, int]]:
    return {(r.subject_kind, r.subject_id, r.endpoint): (r.allowed, r.tokens) for r in UsageRecord.objects.all()}


def test_rows_beyond_the_cap_are_counted_in_the_overflow_row(backend_name: str) -> None:
    ips = [f"198.51.100.{50 + n}" for n in range(5)]
    for ip in ips:
        for _ in range(2):
            assert APIClient(REMOTE_ADDR=ip).get("/t/ping").status_code == 200
    # A subject counted before the cap was reached keeps its own row.
    assert APIClient(REMOTE_ADDR=ips[0]).get("/t/ping").status_code == 200
    write_pending()  # labels not due yet: a later response would write them
    assert drain(now=later()) == 1
    assert rows() == {
        ("ip", ips[0], "ping"): (3, 3),
        ("ip", ips[1], "ping"): (2, 2),
        ("ip", ips[2], "ping"): (2, 2),
        ("overflow", "ip", "ping"): (4, 4),
    }


def counters_of(backend: Any, minute: int) -> dict[str, int]:
    """One minute's usage counters as the backend holds them, every field."""
    if isinstance(backend, MemoryBackend):
        return dict(backend.usage_counts.get(minute, {}))
    stored = backend.client.hgetall(layout.usage_key(backend.prefix, minute))
    return {field.decode(): int(value) for field, value in stored.items()}


def test_memory_and_redis_count_usage_alike_up_to_the_cap_and_beyond(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Random traffic of more subjects than the cap, decided and counted by both: the same counters."""
    rng = random.Random("usage-cap")
    memory_clock, redis_clock = FakeClock(), FakeClock()
    memory = MemoryBackend(clock=memory_clock, usage_cap=4)
    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=redis_clock, usage_cap=4)
    callers = [Subject(SubjectKind.IP, f"198.51.100.{n}") for n in range(5)] + [
        Subject(SubjectKind.API_KEY, f"ApiKey:{n}") for n in range(3)
    ]
    acme = Subject(SubjectKind.ORG, "acme")
    minute = int(time.time() // 60)
    degraded: dict[tuple[int, str], int] = {}
    for _ in range(400):
        caller = rng.choice(callers)
        cost = rng.choice([1, 1, 2])
        usage = usage_for(caller, rng.choice([None, acme]), "free", rng.choice(["ping", "export"]), cost)
        usage = Usage(minute, usage.field, usage.tokens, usage.overflow)  # one minute, however long this takes
        checks = [Check(Policy("p", parse_rate("4/s"), 4), caller, cost)]
        if rng.random() < 0.1:  # decided without the store: added to the counters later
            degraded[(minute, usage.field + DEGRADED)] = degraded.get((minute, usage.field + DEGRADED), 0) + 1
            continue
        verdicts = memory.decide(checks, usage=usage).verdict, remote.decide(checks, usage=usage).verdict
        assert verdicts[0] == verdicts[1]
        step = rng.choice([0, 50_000, 300_000])
        memory_clock.advance(step)
        redis_clock.advance(step)
    memory.add_usage(degraded)
    remote.add_usage(degraded)
    counted = counters_of(memory, minute)
    assert counted == counters_of(remote, minute)
    parsed = [found for found in map(parse_field, counted) if found is not None]
    rows = {row for row, _ in parsed}
    assert len([row for row in rows if row.kind != OVERFLOW]) == 4 < counted[ROWS]  # the cap held; more rows came
    assert OVERFLOW in {row.kind for row in rows}
    assert {metric for _, metric in parsed} == {"allowed", "throttled", "degraded", "tokens"}


@pytest.mark.django_db(transaction=True)
def test_two_drains_at_once_never_wait_on_each_others_batch(use_redis: RedisServer, redis_client: redis.Redis) -> None:
    """The first drain is held inside its transaction, its batch applied; the second finishes meanwhile."""
    if connection.vendor != "postgresql":
        pytest.skip("two drains writing at once need a database server (SQLite takes one writer at a time)")
    backend = engine.get_limiter().backend
    minute = int(time.time() // 60) - 10
    subjects = {minute: "198.51.100.61", minute + 1: "198.51.100.62"}
    for at, ip in subjects.items():
        backend.add_usage({(at, usage_for(Subject(SubjectKind.IP, ip), None, "anonymous", "ping", 1).field + "a"): 5})
    write_pending()

    held, let_go = threading.Event(), threading.Event()
    applied: dict[str, int] = {}

    def run(name: str) -> None:
        try:
            applied[name] = drain(backend)
        finally:
            connection.close()

    first = threading.Thread(target=run, args=("first",), name="first drain")
    second = threading.Thread(target=run, args=("second",), name="second drain")

    def hold_the_first(sender: Any, **kwargs: Any) -> None:
        if threading.current_thread() is first:  # inside its transaction: its rows and batch row written
            held.set()
            let_go.wait(60)

    post_save.connect(hold_the_first, sender=UsageBatch, weak=False, dispatch_uid="hold-the-first-drain")
    try:
        first.start()
        assert held.wait(30), "the first drain never applied a batch"
        second.start()
        second.join(timeout=20)
        second_finished_while_first_held = not second.is_alive()
    finally:
        let_go.set()
        first.join(60)
        second.join(60)
        post_save.disconnect(sender=UsageBatch, dispatch_uid="hold-the-first-drain")
    assert second_finished_while_first_held, "the second drain waited on the first drain's batch"
    assert applied == {"first": 1, "second": 1}
    assert rows() == {("ip", ip, "ping"): (5, 5) for ip in subjects.values()}
    assert UsageBatch.objects.count() == 2
    assert drain(backend) == 0


BUSY_MINUTE = 100_000
#: Far inside the minute a drain has (and its lease): twice the slowest drain measured on this
#: machine so far (7.6 s when this test was written; 10.7 s on 2026-12-01, the same code, on a
#: slower day for the VM, which failed the 10 s budget this test first had).
DRAIN_BUDGET_S = 15.0


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # a real commit, as a drain's
def test_a_minute_of_100k_subjects_is_drained_within_the_budget(
    use_redis: RedisServer, redis_client: redis.Redis
) -> None:
    minute = int(time.time() // 60) - 5
    key = f"rl:usage:{minute}"
    ips = [f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}" for i in range(BUSY_MINUTE)]
    subjects = [Subject(SubjectKind.IP, ip) for ip in ips]
    # Counted as decisions count them (a row marker and the row count too), labels written as workers write them.
    with redis_client.pipeline(transaction=False) as pipe:
        for start in range(0, BUSY_MINUTE, 5000):
            fields: dict[Any, Any] = {}
            for subject in subjects[start : start + 5000]:
                row = usage_for(subject, None, "anonymous", "ping", 2).field
                fields.update({row: 1, row + "a": 3, row + "x": 1})
            pipe.hset(key, mapping=fields)
        pipe.hset(key, "#", BUSY_MINUTE)
        pipe.execute()
    UsageSubject.objects.bulk_create(UsageSubject(digest=s.digest, kind="ip", value=s.value) for s in subjects)
    started = time.monotonic()
    assert drain(now=time.time()) == 1
    took = time.monotonic() - started
    print(f"\n{BUSY_MINUTE} subjects drained in {took:.2f} s on {connection.vendor}")
    assert UsageRecord.objects.count() == BUSY_MINUTE
    assert UsageRecord.objects.get(subject_id=ips[-1]).tokens == 4
    assert took <= DRAIN_BUDGET_S


def test_a_leased_batch_is_handed_to_no_other_drain(backend: Any) -> None:
    usage = usage_for(Subject(SubjectKind.IP, "198.51.100.70"), None, "", "ping", 1)
    backend.add_usage({(usage.minute - 5, usage.field + DEGRADED): 3})
    ((batch, minute),) = backend.claim_usage(usage.minute)
    assert minute == usage.minute - 5
    assert backend.lease_usage(batch, 30) == {usage.field + DEGRADED: 3, usage.field: 1, ROWS: 1}
    assert backend.lease_usage(batch, 30) is None  # a second drain: it skips the batch
    assert backend.claim_usage(usage.minute) == [(batch, minute)]  # claimed until finished
    backend.finish_usage(batch)
    assert backend.claim_usage(usage.minute) == []
    assert backend.lease_usage(batch, 30) is None  # gone: nothing to apply


def test_the_batch_of_a_drain_that_died_is_taken_over_once_its_lease_runs_out(backend: Any, clock: FakeClock) -> None:
    usage = usage_for(Subject(SubjectKind.IP, "198.51.100.71"), None, "", "ping", 1)
    backend.add_usage({(usage.minute - 5, usage.field + DEGRADED): 2})
    ((batch, _),) = backend.claim_usage(usage.minute)
    assert backend.lease_usage(batch, 0.05) is not None  # the drain that dies
    assert backend.lease_usage(batch, 30) is None
    deadline = time.monotonic() + 10
    while (counts := backend.lease_usage(batch, 30)) is None:
        assert time.monotonic() < deadline, "the lease never ran out"
        clock.advance(10_000)  # the memory backend's time; Redis' passes on its own
    assert counts == {usage.field + DEGRADED: 2, usage.field: 1, ROWS: 1}
