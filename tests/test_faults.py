"""Fault injection through the real DRF stack: a private redis-server killed, paused and flushed.

Every test starts its own redis-server on a free loopback port and stops it by PID (the session
server is shared by other tests and is never touched here). Loops are bounded in count and time.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.backends.redis import DECIDE

from .factories import ApiKeyFactory
from .support.redis_server import RedisServer
from .support.settings import merged

pytestmark = pytest.mark.django_db

SOCKET_TIMEOUT = 0.1
#: For tests that assert no degraded answer while Redis is up and need no short timeout (a killed
#: server refuses at once): a call's deadline is 80% of its timeout after it is stamped, and on a
#: loaded 2-core machine six threads contending for the GIL have been seen to take 80 ms.
ROOMY_TIMEOUT = 1.0
COOLDOWN = 0.5
#: How long a restarted Redis may take to enforce limits again (the breaker cooldown is 0.5 s).
RECOVERY_BOUND = 5.0


def configure(settings: Any, own_redis: RedisServer, *, timeout_s: float = SOCKET_TIMEOUT, **overrides: Any) -> None:
    timeout = f"{int(timeout_s * 1000)}ms"
    settings.RATELIMITS = merged(
        {
            "BACKEND": "redis",
            "REDIS": {"URL": own_redis.url, "SOCKET_TIMEOUT": timeout, "CONNECT_TIMEOUT": timeout},
            "FAILURE": {"BREAKER_COOLDOWN": f"{int(COOLDOWN * 1000)}ms"},
            "TIERS": {"free": {"rate": "5/m"}, "anon": {"rate": "1000/s", "burst": 1000}},
            "POLICIES": {
                "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
                "TIER_FUNC": "project.payments.auth.tier_of",
            },
            # Every admission asks the store: these tests watch its faults (tokens leased before a
            # fault are spent through it: test_local_path's).
            "LOCAL_PATH": {"HEADER": True, "LEASES": False},
        },
        overrides,
    )
    engine.reset()


@dataclass
class Hit:
    status: int
    degraded: bool
    seconds: float
    breaker_before: str
    response: Any

    @property
    def local(self) -> str | None:
        """How the worker answered without the store (``X-RateLimit-Local``), if it did."""
        value = self.response.get("X-RateLimit-Local")
        return str(value) if value is not None else None


class Caller:
    """One API caller; every response is recorded so a test can assert on all of them."""

    def __init__(self, raw: str | None = None, path: str = "/v1/customers") -> None:
        self.client = APIClient(REMOTE_ADDR="198.51.100.20")
        if raw is not None:
            self.client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
        self.path = path
        self.hits: list[Hit] = []

    def get(self) -> Hit:
        before = engine.get_limiter().breaker.state
        start = time.perf_counter()
        response = self.client.get(self.path)
        hit = Hit(
            response.status_code,
            response.get("X-RateLimit-Degraded") == "1",
            time.perf_counter() - start,
            before,
            response,
        )
        self.hits.append(hit)
        return hit

    def burst(self, n: int) -> list[Hit]:
        return [self.get() for _ in range(n)]


def key(raw: str, tier: str = "free") -> Caller:
    ApiKeyFactory(raw=raw, tier=tier)
    return Caller(raw)


def statuses(hits: list[Hit]) -> list[int]:
    return [h.status for h in hits]


def test_killed_redis_fails_open_then_limits_return_after_restart(settings: Any, own_redis: RedisServer) -> None:
    configure(settings, own_redis, timeout_s=ROOMY_TIMEOUT)
    refused, caller = key("sk_fault_refused"), key("sk_fault_kill")

    before = refused.burst(8)
    assert statuses(before) == [200] * 5 + [429] * 3  # Redis enforces 5/m
    assert not any(h.degraded for h in before)
    # The store's first 429 is remembered: its wait (12 s) cannot end early, so the rest come from memory.
    assert [h.local for h in before] == [None] * 6 + ["denial"] * 2

    own_redis.kill()  # SIGKILL with the client's pooled connection open
    down = caller.burst(60)
    assert statuses(down) == [200] * 60  # fail open: a caller the store never refused is let through...
    assert all(h.degraded for h in down)  # ...and every such response says so
    assert engine.get_limiter().breaker.state == "open"
    # ...while the refused caller's denial, which the store would still give, goes on from memory.
    still = refused.burst(20)
    assert statuses(still) == [429] * 20
    assert all(h.local == "denial" and not h.degraded for h in still)

    own_redis.start()  # the same port
    restarted = time.monotonic()
    after: list[Hit] = []
    while len(after) < 5000 and time.monotonic() - restarted < RECOVERY_BOUND:
        after.append(caller.get())
        if after[-1].status == 429:
            break
    recovery = time.monotonic() - restarted
    assert after[-1].status == 429, f"no 429 within {RECOVERY_BOUND} s of the restart ({len(after)} requests)"
    assert recovery < RECOVERY_BOUND
    assert not after[-1].degraded
    # Redis lost its counters in the restart: once the probe got through, exactly 5 more were admitted.
    enforced = [h for h in after if not h.degraded]
    assert statuses(enforced) == [200] * 5 + [429]
    assert all(h.status == 200 for h in after if h.degraded)
    assert 500 not in statuses(caller.hits)
    print(f"\nkill: {len(down)} degraded while down; 429 again {recovery:.3f} s after restart ({len(after)} requests)")


def test_concurrent_traffic_survives_kill_and_restart(settings: Any, own_redis: RedisServer) -> None:
    """Requests in flight on several threads while Redis dies and comes back: never a 500."""
    configure(settings, own_redis, timeout_s=ROOMY_TIMEOUT)
    threads_n, per_thread_max = 6, 1500
    deadline = time.monotonic() + 20.0
    phase = ["up"]
    hits: dict[int, list[tuple[str, int, bool]]] = {i: [] for i in range(threads_n)}
    errors: list[BaseException] = []
    done = threading.Event()
    progress = threading.Condition()

    def traffic(i: int) -> None:
        client = APIClient(REMOTE_ADDR=f"198.51.100.{100 + i}")
        try:
            for _ in range(per_thread_max):
                if done.is_set() or time.monotonic() > deadline:
                    return
                response = client.get("/t/ping")
                with progress:
                    hits[i].append((phase[0], response.status_code, response.get("X-RateLimit-Degraded") == "1"))
                    progress.notify_all()
        except BaseException as exc:
            errors.append(exc)
            with progress:
                progress.notify_all()

    def all_hits() -> list[tuple[str, int, bool]]:
        return [h for thread_hits in hits.values() for h in thread_hits]

    def wait_until(predicate: Any, timeout: float) -> bool:
        with progress:
            return progress.wait_for(lambda: bool(errors) or predicate(), timeout=timeout)

    threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(threads_n)]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: len(all_hits()) >= 60, 10)
        with progress:
            phase[0] = "killing"  # requests finishing now may or may not have reached Redis
        own_redis.kill()
        with progress:
            phase[0] = "down"
        assert wait_until(lambda: sum(p == "down" for p, _, _ in all_hits()) >= 300, 10)
        with progress:
            phase[0] = "restarting"
        own_redis.start()
        restarted = time.monotonic()
        with progress:
            phase[0] = "restarted"
        recovered = wait_until(lambda: any(p == "restarted" and not d for p, _, d in all_hits()), RECOVERY_BOUND)
        recovery = time.monotonic() - restarted
    finally:
        done.set()
        for t in threads:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert recovered, f"still degraded {RECOVERY_BOUND} s after the restart"
    assert {status for _, status, _ in all_hits()} == {200}
    assert not any(d for p, _, d in all_hits() if p == "up")
    for thread_hits in hits.values():
        down = [d for p, _, d in thread_hits if p == "down"]
        # Only a request already answered by Redis when it died may finish undegraded.
        assert all(down[1:]), down
    print(f"\nconcurrent kill: {len(all_hits())} requests on {threads_n} threads, recovered in {recovery:.3f} s")


def test_paused_redis_breaker_keeps_latency_down(settings: Any, own_redis: RedisServer) -> None:
    configure(settings, own_redis)
    caller = Caller(path="/t/ping")  # anonymous, limit far above this traffic
    assert statuses(caller.burst(5)) == [200] * 5

    own_redis.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        paused_at = time.monotonic()
        paused: list[Hit] = []
        while len(paused) < 300 and time.monotonic() - paused_at < 2.0:
            paused.append(caller.get())
        paused_for = time.monotonic() - paused_at
    finally:
        own_redis.resume()

    assert 500 not in statuses(paused)
    assert statuses(paused) == [200] * len(paused)
    assert all(h.degraded for h in paused)
    slow = [h for h in paused if h.seconds >= 0.8 * SOCKET_TIMEOUT]
    # Only the calls that opened the breaker (FAILURE['BREAKER_MIN_CALLS'] = 5) and one probe per
    # cooldown wait for the socket timeout; everything else is answered without touching Redis.
    probes = int(paused_for / COOLDOWN) + 1
    assert 5 <= len(slow) <= 5 + probes, [round(h.seconds, 3) for h in slow]
    while_open = [h.seconds for h in paused if h.breaker_before == "open"]
    assert len(while_open) >= 50
    median = statistics.median(while_open)
    assert median < SOCKET_TIMEOUT / 10, f"median {median * 1000:.1f} ms with the breaker open"
    print(
        f"\npause: {len(paused)} requests in {paused_for:.2f} s, {len(slow)} paid the {SOCKET_TIMEOUT * 1000:.0f} ms "
        f"timeout, median {median * 1000:.2f} ms with the breaker open"
    )

    # Resumed: the next probe closes the breaker and answers come from Redis again.
    resumed = time.monotonic()
    after: list[Hit] = []
    while len(after) < 5000 and time.monotonic() - resumed < RECOVERY_BOUND:
        after.append(caller.get())
        if not after[-1].degraded:
            break
    assert not after[-1].degraded and after[-1].status == 200
    assert 500 not in statuses(after)


def test_fail_closed_policy_answers_503_problem_with_retry_after(settings: Any, own_redis: RedisServer) -> None:
    configure(
        settings,
        own_redis,
        TIERS={"free": {"rate": "100/s", "fail_mode": "closed"}, "anon": {"rate": "100/s"}},
        FAILURE={"BREAKER_COOLDOWN": "3s"},
    )
    closed = key("sk_fault_closed")
    anonymous = Caller(path="/t/ping")
    assert closed.get().status == 200 and anonymous.get().status == 200

    own_redis.kill()
    hits = closed.burst(10)
    assert statuses(hits) == [503] * 10
    retry_afters = []
    for hit in hits:
        response = hit.response
        assert response["Content-Type"] == "application/problem+json"
        assert hit.degraded
        retry_after = response["Retry-After"]
        assert retry_after.isdigit(), retry_after
        retry_afters.append(int(retry_after))
        body = json.loads(response.content)
        assert body["status"] == 503
        assert body["type"].endswith("#temporary-reduced-capacity")
        assert body["retry_after_ms"] >= 1000
    assert all(1 <= value <= 3 for value in retry_afters)
    # Once the breaker is open, Retry-After is the rest of its cooldown (3 s, rounded up).
    assert retry_afters[-1] == 3
    assert engine.get_limiter().breaker.state == "open"

    # The default fail mode ("open") still applies to a policy that does not fail closed.
    anon = anonymous.get()
    assert anon.status == 200 and anon.degraded


def test_fail_local_policy_is_enforced_in_process(settings: Any, own_redis: RedisServer) -> None:
    configure(
        settings,
        own_redis,
        TIERS={"free": {"rate": "4/m", "fail_mode": "local"}, "anon": {"rate": "100/s"}},
        FAILURE={"LOCAL_SHARE": 0.5},
    )
    first, second = key("sk_fault_local_1"), key("sk_fault_local_2")
    assert first.get().status == 200

    own_redis.kill()
    burst = first.burst(8)
    # 4/m scaled by FAILURE['LOCAL_SHARE'] 0.5: two admitted, then denied by the in-process limiter.
    assert statuses(burst) == [200, 200] + [429] * 6
    assert all(h.degraded for h in burst)
    denied = burst[-1].response
    assert denied["Content-Type"] == "application/problem+json"
    assert json.loads(denied.content)["type"].endswith("#quota-exceeded")
    assert int(denied["Retry-After"]) >= 1
    assert denied["X-RateLimit-Limit"] == "2"
    # Per caller, like the shared limit.
    assert statuses(second.burst(3)) == [200, 200, 429]


def _function_loads(own_redis: RedisServer) -> int:
    stats = own_redis.client().info("commandstats")
    return int(stats.get("cmdstat_function|load", {}).get("calls", 0))


def _has_decide(own_redis: RedisServer) -> bool:
    """Whether the store holds the decide script's library (a Redis Function)."""
    return bool(own_redis.client().function_list(library=DECIDE.function))


def test_function_flush_is_transparent(settings: Any, own_redis: RedisServer) -> None:
    configure(settings, own_redis)
    caller = key("sk_fault_noscript")
    hits = caller.burst(2)
    assert [h.response["X-RateLimit-Remaining"] for h in hits] == ["4", "3"]
    loads = _function_loads(own_redis)

    own_redis.client().function_flush()
    assert not _has_decide(own_redis)
    hit = caller.get()
    assert hit.status == 200 and not hit.degraded
    assert hit.response["X-RateLimit-Remaining"] == "2"  # counted once, on top of the earlier two
    assert _function_loads(own_redis) == loads + 1  # "Function not found" answered by exactly one load
    assert _has_decide(own_redis)
    assert statuses(caller.burst(3)) == [200, 200, 429]
    assert engine.get_limiter().breaker.state == "closed"


def test_a_lost_function_after_restart_is_transparent(settings: Any, own_redis: RedisServer) -> None:
    configure(settings, own_redis)
    caller = key("sk_fault_restart")
    assert statuses(caller.burst(3)) == [200] * 3

    own_redis.kill()
    own_redis.start()  # same port, no functions and no data (no persistence)
    assert not _has_decide(own_redis)
    hit = caller.get()
    assert hit.status == 200 and not hit.degraded  # the stale pooled connection and the lost function both absorbed
    assert hit.response["X-RateLimit-Remaining"] == "4"
    assert _has_decide(own_redis)
    assert statuses(caller.burst(5)) == [200] * 4 + [429]


# -- a call that arrives late changes nothing -----------------------------------------------------

#: How long past the client's timeout Redis stays stopped (the finding's stall).
STALL_S = 3.0
#: Requests in all (at least), before, during and after the stall: each counted exactly once.
TOTAL = 400
#: The fleet: 4 in flight, nothing shed below that; these requests come one at a time.
FLEET = {"FLEET_CAPACITY": 4, "TENANT_SHARE": 100, "THRESHOLDS": {"low": 100, "normal": 100, "high": 100}}


def counted(server: RedisServer) -> int:
    """Every request the store's usage counters hold (allowed, limited, shed, degraded), all minutes."""
    total = 0
    client = server.client()
    for key in client.scan_iter(match="rl:usage:*"):
        fields = {k.decode(): int(v) for k, v in client.hgetall(key).items()}
        rows = {f for f in fields if f != "#" and any(f + m in fields for m in "alsd")}
        total += sum(fields.get(row + metric, 0) for row in rows for metric in "alsd")
    return total


def test_calls_that_run_after_a_stall_take_no_slots_and_count_nothing_twice(
    settings: Any, own_redis: RedisServer
) -> None:
    # A breaker that opens on 5 failures of the last 10 calls, as it does under a busy worker's traffic.
    configure(settings, own_redis, SHEDDING=FLEET, FAILURE={"BREAKER_WINDOW": 10})
    caller = Caller(path="/t/ping")  # anonymous: far below its limit
    before = caller.burst(100)
    assert statuses(before) == [200] * 100 and not any(h.degraded for h in before)

    own_redis.pause()  # SIGSTOP: the calls sent now time out, and run when it resumes
    try:
        paused_at = time.monotonic()
        during = []
        while time.monotonic() - paused_at < SOCKET_TIMEOUT + STALL_S and len(during) < 200:
            during.append(caller.get())
            time.sleep(0.01)  # pacing the traffic through the stall
    finally:
        own_redis.resume()
    assert statuses(during) == [200] * len(during)
    late_calls = sum(1 for h in during if h.seconds >= 0.8 * SOCKET_TIMEOUT)
    assert late_calls >= 5  # the calls that opened the breaker, and its probes: all ran on resume

    # On until the breaker's probe found the store back, and TOTAL requests in all.
    resumed, after = time.monotonic(), []
    while len(before) + len(during) + len(after) < TOTAL or after[-1].degraded:
        assert time.monotonic() - resumed < RECOVERY_BOUND, "the breaker never closed again"
        after.append(caller.get())
    # The late calls took no fleet slot: nothing is shed while their slots would have lasted.
    assert 503 not in statuses(after), statuses(after)
    assert statuses(after) == [200] * len(after)

    total = len(before) + len(during) + len(after)
    engine.get_limiter().flush_usage(now=True)  # what was decided without the store, added once
    assert counted(own_redis) == total
    print(f"\nstall: {len(during)} requests in it, {late_calls} sent to the stopped store; {total} counted {total}")
