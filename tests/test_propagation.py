"""Policy changes reach real, separate worker processes: within one request each, or by polling.

Two ``gunicorn --workers 1 --threads 1 project.wsgi`` servers (one worker process each, on their
own loopback ports) share a private Redis and a PostgreSQL database of their own, created for
this module and dropped afterwards. The demo's ``migrate`` and ``seed_demo`` run against it.

1. A change made through the admin over HTTP (log in, load the change form, post it) is enforced
   by both workers within one request each: every response names the policy that decided it in
   ``RateLimit-Policy``, and only a worker's first request after the commit may show the old one.
2. With Redis killed, changes committed to the database cannot bump the version stamp (one saved
   through the model, whose bump fails, then one by a plain UPDATE); both workers still pick each
   up within ``POLICIES['POLL_INTERVAL']`` (1 s in ``tests/support/propagation_settings.py``), and
   not before their snapshot is that old: they poll on a timer, they do not reload on every request.

Every wait is a bounded poll of a condition; every process started here is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from .support.http import AdminSession, Reply, fetch, form_fields, page_errors, serving
from .support.postgres import throwaway_database
from .support.processes import Service, gunicorn, manage
from .support.propagation_settings import POLICY_POLL_INTERVAL_S
from .support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.slow
#: Seeded by ``seed_demo``: Acme's key is on the free tier; Acme's override only covers "customers".
ACME_KEY = "sk_free_demo_acme_0000000000"
ADMIN_USER, ADMIN_PASSWORD = "admin", "admin"
VERSION_KEY = "rl:policy-version"

#: The seeded free tier (migration 0002): a token bucket of 25/s with a burst of 50.
OLD_POLICY = '"tier:free";q=50;w=2'
#: What the admin change makes of it. A sliding window of 10 per hour: capacity 10, which the
#: guardrail accepts (the seeded reports.export endpoint costs 10, no more than 10), and a
#: different algorithm, so its counter is a key of its own. The count of new-policy admissions
#: is then exactly 10 whatever the order of requests: an old-policy request, if any, spends from
#: the old token bucket and cannot shift the new window by the microseconds it leaves behind.
NEW_RATE, NEW_BURST, NEW_ALGORITHM = "10/h", 10, "sliding_window"
NEW_LIMIT = 10
NEW_POLICY = f'"tier:free";q={NEW_LIMIT};w=3600'
#: The two changes made while Redis is down (capacities 12 and 14 also clear the guardrail).
OUTAGE_LIMITS = (12, 14)
#: How far past the poll interval a pickup may come: the request that notices the snapshot is
#: older than the interval is still decided on it, the next one reloads, and polls are ~50 ms apart.
POLL_SLACK_S = 1.5

START_TIMEOUT = 30.0


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Stack:
    redis: RedisServer
    database_url: str
    env: dict[str, str]
    a: Service
    b: Service
    free_tier_id: int


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    failed_before = request.session.testsfailed
    with contextlib.ExitStack() as cleanup:
        redis_server = cleanup.enter_context(RedisServer())
        database_url = cleanup.enter_context(throwaway_database("ratelimits_propagation"))
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_server.url,
            "SECRET_KEY": "propagation-test-" + secrets.token_hex(8),
            "DEBUG": "0",
            "PYTHONUNBUFFERED": "1",
        }
        manage(env, "migrate", "--noinput", "-v", "0")
        manage(env, "seed_demo")
        with psycopg.connect(database_url, connect_timeout=10) as conn:
            row = conn.execute("SELECT id FROM ratelimits_tier WHERE name = 'free'").fetchone()
            assert row is not None, "migration 0002 seeds the free tier"
            # Fail over to per-process limits rather than open, so that the tier's limits still
            # show (and apply) while Redis is down. Set before any worker starts: nothing to notify.
            conn.execute("UPDATE ratelimits_tier SET fail_mode = 'local' WHERE id = %s", (row[0],))

        logs = Path(tempfile.mkdtemp(prefix="ratelimits-propagation-"))
        cleanup.callback(shutil.rmtree, logs, ignore_errors=True)
        worker_env = {**env, "DJANGO_SETTINGS_MODULE": "tests.support.propagation_settings"}
        a, b = (gunicorn(name, port=free_port(), logs=logs) for name in ("A", "B"))
        for worker in (a, b):
            cleanup.callback(worker.stop, grace=10)
            worker.start(worker_env)
        for worker in (a, b):
            worker.wait_until(lambda w=worker: serving(w.port), START_TIMEOUT, "answer to GET /admin/login/")
        yield Stack(redis_server, database_url, env, a, b, int(row[0]))
        if request.session.testsfailed != failed_before:
            for worker in (a, b):
                print(f"\n--- worker {worker.name} log (tail) ---\n{worker.tail(5000)}")


def api(port: int, path: str) -> Reply:
    return fetch(port, "GET", path, headers={"Authorization": f"Bearer {ACME_KEY}"})


# -- observations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One response: its status, the policy that decided it (its ``RateLimit-Policy`` item) and what is left."""

    worker: str
    status: int
    policy: str
    remaining: int | None
    #: ``X-RateLimit-Local``: "denial" or "lease" when the worker answered from memory.
    local: str | None = None

    def __str__(self) -> str:
        local = f" ({self.local})" if self.local else ""
        return f"{self.worker}:{self.status} {self.policy} r={self.remaining}{local}"


def charge_list(worker: Service) -> Seen:
    """GET /v1/charges as Acme: a consuming request (cost 1; no override applies to it)."""
    reply = api(worker.port, "/v1/charges")
    assert reply.status in (200, 429), (reply.status, reply.text)
    left = re.search(r";r=(\d+)", reply.headers.get("RateLimit", ""))
    policy, local = decided_by(reply.headers), reply.headers.get("X-RateLimit-Local")
    return Seen(worker.name, reply.status, policy, int(left[1]) if left else None, local)


def decided_by(headers: http.client.HTTPMessage) -> str:
    """The free tier's ``RateLimit-Policy`` item: what the change under test is seen in. (Not the
    closest policy's: the IP backstop can be closer to its limit, depending on timing.)"""
    items = headers.get("RateLimit-Policy", "").split(", ")
    return next((item for item in items if item.partition(";")[0] == '"tier:free"'), "")


def free_tier_limits(worker: Service) -> tuple[bool, dict[str, Any] | None]:
    """GET /v1/rate_limit (consumes nothing): whether degraded, and the free tier's entry."""
    reply = api(worker.port, "/v1/rate_limit?endpoint=charges")
    assert reply.status == 200, (reply.status, reply.text)
    data = reply.json()
    entries = [r for r in data["resources"] if r["policy"] == "tier:free"]
    return data["degraded"], entries[0] if entries else None


def policy_version(stack: Stack) -> int:
    client = stack.redis.client()
    try:
        raw = client.get(VERSION_KEY)
    finally:
        client.close()
    return int(raw or 0)


def change_tier_through_admin(worker: Service, tier_id: int, changes: dict[str, str], reason: str) -> None:
    """Log in, load the tier's change form and post it back with ``changes``, as a browser would."""
    browser = AdminSession(worker.port)
    login = browser.request("GET", "/admin/login/")
    assert login.status == 200 and "csrftoken" in browser.cookies, login.status
    token = form_fields(login.text, "login-form")["csrfmiddlewaretoken"]
    form = [
        ("csrfmiddlewaretoken", token),
        ("username", ADMIN_USER),
        ("password", ADMIN_PASSWORD),
        ("next", "/admin/"),
    ]
    reply = browser.request("POST", "/admin/login/", form)
    assert reply.status == 302 and "sessionid" in browser.cookies, page_errors(reply.text)

    page = browser.request("GET", f"/admin/ratelimits/tier/{tier_id}/change/")
    assert page.status == 200, page.status
    fields = form_fields(page.text, "tier_form")
    assert fields["name"] == "free" and "revision" in fields, sorted(fields)
    fields.update(changes, change_reason=reason, _save="Save")
    reply = browser.request("POST", f"/admin/ratelimits/tier/{tier_id}/change/", list(fields.items()))
    assert reply.status == 302, f"the admin refused the change: {page_errors(reply.text)}"
    assert reply.headers["Location"] == "/admin/ratelimits/tier/", reply.headers["Location"]


# -- the tests ---------------------------------------------------------------------------------


def test_admin_change_is_enforced_by_both_workers_within_one_request_each(stack: Stack) -> None:
    a, b = stack.a, stack.b
    # Warm both workers: the first decision loads a snapshot and learns the version stamp (a
    # reload follows), the next ones run on a snapshot stamped with the current version.
    # /v1/rate_limit consumes nothing, so no counter is touched before the change.
    for worker in (a, b):
        for _ in range(3):
            degraded, free = free_tier_limits(worker)
            assert not degraded and free is not None
            assert (free["limit"], free["algorithm"]) == (50, "token_bucket"), free
    before = [charge_list(a), charge_list(b)]
    assert [(s.status, s.policy) for s in before] == [(200, OLD_POLICY)] * 2, before

    version = policy_version(stack)
    reason = f"propagation test {secrets.token_hex(4)}"
    change_tier_through_admin(
        a,
        stack.free_tier_id,
        {"rate": NEW_RATE, "burst": str(NEW_BURST), "algorithm": NEW_ALGORITHM},
        reason,
    )
    # The save committed, was audited, and its commit bumped the stamp in Redis exactly once.
    assert policy_version(stack) == version + 1
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        audited = conn.execute(
            "SELECT e.action, u.username, e.before ->> 'rate', e.after ->> 'rate', e.after ->> 'algorithm' "
            "FROM ratelimits_auditentry e LEFT JOIN auth_user u ON u.id = e.actor_id "
            "WHERE e.model = 'ratelimits.Tier' AND e.reason = %s",
            (reason,),
        ).fetchall()
    assert audited == [("changed", ADMIN_USER, "25/s", NEW_RATE, NEW_ALGORITHM)], audited

    # Alternate between the workers, B (which has not heard of the change) first. Both share
    # Acme's counters in Redis, so the new limit admits exactly NEW_LIMIT requests in all.
    seen: list[Seen] = []
    for _ in range(NEW_LIMIT + 2):
        seen += [charge_list(b), charge_list(a)]
    per_worker = {w.name: [s for s in seen if s.worker == w.name] for w in (a, b)}
    print("\nafter the admin change on A:")
    for name, sequence in per_worker.items():
        print(f"  worker {name}: " + ", ".join(f"{s.status} {s.policy} r={s.remaining}" for s in sequence))

    for name, sequence in per_worker.items():
        # Only a worker's first request after the commit may still be decided on the old
        # snapshot (it brings the new stamp back); from its second request on, the new policy.
        assert sequence[0].policy in (OLD_POLICY, NEW_POLICY), sequence[0]
        assert all(s.policy == NEW_POLICY for s in sequence[1:]), (name, [str(s) for s in sequence])
        # The old token bucket was nowhere near empty: a stale request is admitted by it.
        assert all(s.status == 200 for s in sequence if s.policy == OLD_POLICY), sequence
    # Under the new policy: exactly NEW_LIMIT admissions across both workers, then only 429s,
    # and each worker turns requests away under it.
    new = [s for s in seen if s.policy == NEW_POLICY]
    assert [s.status for s in new] == [200] * NEW_LIMIT + [429] * (len(new) - NEW_LIMIT), [str(s) for s in new]
    # The window counts exactly (even across the top of the hour): 9, 8, ... 0 left, then none.
    assert [s.remaining for s in new] == [*range(NEW_LIMIT - 1, -1, -1)] + [0] * (len(new) - NEW_LIMIT), new
    for name, sequence in per_worker.items():
        assert any(s.status == 429 and s.policy == NEW_POLICY for s in sequence), name
    stale = {name: sequence[0].policy == OLD_POLICY for name, sequence in per_worker.items()}
    print(f"  first request decided on the old policy: {stale}")


#: What the next test makes of the free tier: a token bucket busy enough to be leased (100/s,
#: burst 200), then a smaller one (20/s, burst 40). Both clear the guardrail (capacity >= 10).
LEASED_RATE, LEASED_BURST = "100/s", 200
LEASED_POLICY = f'"tier:free";q={LEASED_BURST};w=2'
FINAL_RATE, FINAL_BURST = "20/s", 40
FINAL_POLICY = f'"tier:free";q={FINAL_BURST};w=2'


def test_a_change_reaches_workers_answering_from_memory_on_their_next_request(stack: Stack) -> None:
    """The demo's workers remember denials and lease tokens (LOCAL_PATH): neither asks Redis for
    such requests, so neither would see the version stamp. The invalidation channel tells them."""
    a, b = stack.a, stack.b
    # After the test above, Acme's 10/h window is spent: each worker refuses it from memory.
    held = {w.name: [charge_list(w) for _ in range(3)] for w in (a, b)}
    for name, sequence in held.items():
        assert all(s.status == 429 and s.policy == NEW_POLICY for s in sequence), (name, [str(s) for s in sequence])
        assert sequence[-1].local == "denial", (name, [str(s) for s in sequence])

    # A request is answered from leases only if every check is leased: no slots (the seeded free
    # tier's concurrency, the fleet's in-flight set). The fleet's capacity goes in the database,
    # and is picked up with the tier change below (which bumps the version).
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        conn.execute("UPDATE ratelimits_fleetsettings SET capacity = NULL")
    change_tier_through_admin(
        a,
        stack.free_tier_id,
        {"rate": LEASED_RATE, "burst": str(LEASED_BURST), "algorithm": "token_bucket", "concurrency": ""},
        f"local path test {secrets.token_hex(4)}",
    )
    # The very next request of each worker is decided on the new policy: no denial from memory.
    after = {w.name: charge_list(w) for w in (b, a)}
    assert all(s.status == 200 and s.policy == LEASED_POLICY and s.local is None for s in after.values()), after

    # Busy enough for leases: each worker now spends tokens it took in its decide calls (of the tier,
    # and of the IP and organisation backstops: a request is answered locally only if all are leased).
    busy = {w.name: [charge_list(w) for _ in range(12)] for w in (a, b)}
    for name, sequence in busy.items():
        assert all(s.status == 200 for s in sequence), (name, sequence)
        assert any(s.local == "lease" for s in sequence), (name, [str(s) for s in sequence])

    change_tier_through_admin(
        b,
        stack.free_tier_id,
        {"rate": FINAL_RATE, "burst": str(FINAL_BURST), "algorithm": "token_bucket"},
        f"local path test {secrets.token_hex(4)}",
    )
    # The next request of each worker holding a lease is decided on the newer policy, not the lease.
    final = {w.name: charge_list(w) for w in (a, b)}
    print("\nanswered from memory, then a change:")
    for name in (a.name, b.name):
        print(f"  worker {name}: held {[str(s) for s in held[name]]}, then {after[name]}, leases "
              f"{sum(s.local == 'lease' for s in busy[name])}/12, then {final[name]}")  # fmt: skip
    assert all(s.policy == FINAL_POLICY and s.local is None for s in final.values()), final


@dataclass
class Pickup:
    """When a worker first reported a limit: that request's send and reply times, and what it saw before."""

    started: float
    answered: float
    trail: list[int]


def poll_until_limit(workers: tuple[Service, ...], limit: int, since: float) -> dict[str, Pickup]:
    """Ask each worker for the free tier's limit (degraded) until it reports ``limit``; at most 10 s."""
    found: dict[str, Pickup] = {}
    trails: dict[str, list[int]] = {w.name: [] for w in workers}
    deadline = since + 10.0
    while len(found) < len(workers) and time.monotonic() < deadline:
        for worker in workers:
            if worker.name in found:
                continue
            started = time.monotonic()
            degraded, free = free_tier_limits(worker)
            answered = time.monotonic()
            assert degraded and free is not None, free
            trails[worker.name].append(free["limit"])
            if free["limit"] == limit:
                found[worker.name] = Pickup(started, answered, trails[worker.name])
        time.sleep(0.05)  # poll spacing, not synchronisation: the loop ends on the condition
    for worker in workers:
        seen = trails[worker.name]
        took = f"{found[worker.name].answered - since:.2f} s" if worker.name in found else "never (10 s)"
        print(f"  worker {worker.name}: {len(seen)} polls, limits seen {sorted(set(seen), key=seen.index)}, {took}")
    assert set(found) == {w.name for w in workers}, trails
    return found


def test_workers_poll_the_database_while_redis_is_down(stack: Stack) -> None:
    a, b = stack.a, stack.b
    interval = POLICY_POLL_INTERVAL_S
    # Both workers answer while Redis is up, on whatever the free tier is now (the same on both).
    limits: set[int] = set()
    for worker in (a, b):
        free_tier_limits(worker)  # may bring back a new version stamp; the next one is current
        degraded, free = free_tier_limits(worker)
        assert not degraded and free is not None
        limits.add(free["limit"])
    assert len(limits) == 1 and not limits & set(OUTAGE_LIMITS), limits
    (limit_before,) = limits

    stack.redis.kill()
    # Degraded now, and the free tier fails over to per-process limits, so its policy still shows.
    for worker in (a, b):
        degraded, free = free_tier_limits(worker)
        assert degraded and free is not None and free["limit"] == limit_before, free

    # 1. A change saved the usual way (audited): its version bump cannot reach Redis.
    first, second = OUTAGE_LIMITS
    code = (
        "from ratelimits.models import Tier\n"
        "tier = Tier.objects.get(name='free')\n"
        f"tier.rate, tier.burst = '{first}/h', {first}\n"
        "tier.full_clean()\n"
        "tier.save()\n"
    )
    result = manage(stack.env, "shell", "-c", code)
    committed = time.monotonic()
    assert "could not publish policy version" in result.stderr, result.stderr
    print(f"\nRedis down; free tier {limit_before} -> {first}, saved by manage.py shell (bump failed):")
    pickups = poll_until_limit((a, b), first, committed)
    for name, pickup in pickups.items():
        assert pickup.answered - committed <= interval + POLL_SLACK_S, (name, pickup)

    # 2. Each worker has just loaded its snapshot (during the request that first showed the
    # change). Change the row again, straight in the database: the worker cannot see it before
    # its snapshot is older than the poll interval, and does see it soon after.
    with psycopg.connect(stack.database_url, connect_timeout=10) as conn:
        conn.execute(
            "UPDATE ratelimits_tier SET rate = %s, burst = %s, revision = revision + 1, updated_at = now() "
            "WHERE id = %s",
            (f"{second}/h", second, stack.free_tier_id),
        )
    committed = time.monotonic()
    age = committed - max(p.started for p in pickups.values())
    print(f"free tier {first} -> {second} by an UPDATE, the newer snapshot {age:.2f} s old:")
    again = poll_until_limit((a, b), second, committed)
    for name, pickup in again.items():
        assert pickup.answered - pickups[name].started > interval, (name, pickups[name], pickup)
        assert pickup.answered - committed <= interval + POLL_SLACK_S, (name, pickup)

    # And each worker enforces it on its own, degraded: headers from the local fallback.
    for worker in (a, b):
        reply = api(worker.port, "/v1/charges")
        print(
            f"  worker {worker.name}: GET /v1/charges {reply.status}, RateLimit-Policy "
            f"{reply.headers.get('RateLimit-Policy')}, X-RateLimit-Degraded {reply.headers.get('X-RateLimit-Degraded')}"
        )
        assert reply.status == 200, reply.text
        assert reply.headers.get("X-RateLimit-Degraded") == "1"
        assert decided_by(reply.headers) == f'"tier:free";q={second};w=3600'
