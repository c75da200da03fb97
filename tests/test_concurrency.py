"""Concurrency and window-boundary guarantees, proven against a real redis-server.

Storms: 4 processes x 8 threads, each thread with its own decisions on ONE key, all released
at once by a cross-process barrier, Redis' own clock deciding. Over-admission would show as
more admitted than the limit allows over the measured (Redis TIME) span; under-admission as
fewer than the limit although far more was asked for. Boundary tests pin the clock exactly
around a second boundary (app clock against real Redis), then repeat it on the server clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import redis

from ratelimits.algorithms import RATE_ALGORITHMS, Algorithm, State
from ratelimits.backends.redis import RedisBackend, make_client, read_state
from ratelimits.decisions import Decision
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy
from ratelimits.rates import parse_rate

from .support.clock import FakeClock
from .support.redis_server import RedisServer
from .support.storm import StormReport, redis_time_us, run_storm

pytestmark = pytest.mark.slow

PROCESSES, THREADS, ATTEMPTS = 4, 8, 50
TOTAL = PROCESSES * THREADS * ATTEMPTS
STORM_RUNS = 3
SECOND = 1_000_000

CALLER = Subject("api_key", "storm-caller")
ORG = Subject("org", "storm-org")


def policy(rate: str, burst: int, algorithm: Algorithm = Algorithm.TOKEN_BUCKET, name: str = "p") -> Policy:
    parsed = parse_rate(rate)
    return Policy(name, parsed, burst, algorithm)


def gcra_envelope_violations(admitted: Sequence[tuple[int, int]], limit: int, period_us: int, burst: int) -> list[str]:
    """Every span [a, b] of admission times: cost admitted in it <= burst + rate * (b - a).

    ``admitted`` is (now_us, cost) per admitted request, times as the script saw them. Exact
    integer arithmetic: (cost - burst) * period <= (b - a) * limit. Ties need no ordering.
    """
    per_time: dict[int, int] = {}
    for now_us, cost in admitted:
        per_time[now_us] = per_time.get(now_us, 0) + cost
    times = sorted(per_time)
    prefix = [0]
    for t in times:
        prefix.append(prefix[-1] + per_time[t])
    bad = []
    for i, a in enumerate(times):
        for j in range(i, len(times)):
            spent = prefix[j + 1] - prefix[i]
            if (spent - burst) * period_us > (times[j] - a) * limit:
                bad.append(f"{spent} tokens admitted in [{a}, {times[j]}] ({times[j] - a} us)")
    return bad


def token_bucket_bound(p: Policy, elapsed_us: int) -> int:
    """Most tokens a fresh GCRA bucket can hand out within ``elapsed_us``: burst + floor(rate * elapsed)."""
    return p.burst + elapsed_us * p.rate.limit // p.rate.period_us


def stored(client: redis.Redis, key: str, algorithm: Algorithm = Algorithm.TOKEN_BUCKET) -> State:
    """The state at ``key``, without the terms it records (a bucket's capacity, a window's limit and period)."""
    raw = client.get(key)
    assert isinstance(raw, bytes), f"{key} is missing"
    return counts_of(algorithm, read_state(algorithm, raw))


def counts_of(algorithm: Algorithm, state: State) -> State:
    return state[:1] if algorithm is Algorithm.TOKEN_BUCKET else state[:-2]


def windows_spanned(p: Policy, start_us: int, end_us: int) -> int:
    return end_us // p.rate.period_us - start_us // p.rate.period_us + 1


def overlapped(report: StormReport) -> bool:
    """Whether every process was deciding while every other was: the key was hammered at once."""
    spans = report.spans()
    return max(first for first, _ in spans.values()) < min(last for _, last in spans.values())


def storm(url: str, redis_client: redis.Redis, checks_for: Callable[[int, int], Sequence[Check]]) -> StormReport:
    """A storm of PROCESSES x THREADS x ATTEMPTS decisions whose processes overlapped in time.

    On a loaded two-core machine the OS may run one process's 400 decisions only after another's
    (the storm lasts tens of milliseconds): nothing was concurrent then, so such a storm proves
    nothing and is run again on a flushed Redis, at most STORM_RUNS times.
    """
    for _ in range(STORM_RUNS):
        redis_client.flushall()
        report = run_storm(url, checks_for, processes=PROCESSES, threads=THREADS, attempts=ATTEMPTS)
        if report.errors or len(report.pids) != PROCESSES or overlapped(report):
            return report
    return report


def assert_clean(report: StormReport) -> None:
    """Every worker ran every attempt, and the processes really hammered the key at the same time."""
    assert not report.errors, "\n".join(report.errors)
    assert len(report.pids) == PROCESSES, f"expected {PROCESSES} worker processes, saw {report.pids}"
    assert len(report.attempts) == TOTAL
    assert len({a.worker for a in report.attempts}) == PROCESSES * THREADS
    assert overlapped(report), f"worker processes did not overlap in {STORM_RUNS} storms: {report.spans()}"
    assert all(report.start_us <= a.now_us <= report.end_us for a in report.attempts)


def summary(label: str, report: StormReport, bound: int) -> str:
    winners = len({a.worker[0] for a in report.admitted})
    return (
        f"{label}: {len(report.admitted)} admitted / {len(report.attempts)} attempts, "
        f"admitted cost {report.admitted_cost} (bound {bound}), admissions from {winners} processes, "
        f"storm span {report.elapsed_us / 1000:.1f} ms"
    )


# --- storms ------------------------------------------------------------------------------------


def test_storm_token_bucket_admits_exactly_the_burst(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """1600 concurrent attempts on one bucket of 100: exactly 100 admitted, each token once."""
    bucket = policy("100/h", burst=100)
    check = Check(bucket, CALLER)
    report = storm(redis_server.url, redis_client, lambda p, t: [check])
    assert_clean(report)
    bound = token_bucket_bound(bucket, report.elapsed_us)
    print(summary("token bucket 100/h burst 100", report, bound))

    # Refill is accounted for exactly; the storm is far shorter than one token's 36 s refill.
    assert report.elapsed_us < bucket.rate.interval_us
    assert bound == bucket.burst
    admitted = report.admitted
    assert len(admitted) <= bound, "over-admission"
    assert len(admitted) >= bucket.burst, "under-admission: the bucket started full"
    # Serialised: the k-th admission saw exactly 100 - k tokens left, so every value 99..0 once.
    assert sorted(a.results[0][1] for a in admitted) == list(range(bucket.burst))
    assert not gcra_envelope_violations([(a.now_us, a.cost) for a in admitted], 100, bucket.rate.period_us, 100)
    # One key was hammered, and its state holds exactly 100 spent intervals.
    key = check.key("rl")
    assert redis_client.keys("*") == [key.encode()]
    first = min(a.now_us for a in admitted)
    assert stored(redis_client, key) == (first + bucket.burst * bucket.rate.interval_us,)
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    assert backend.decide([check], consume=False).results[0].remaining == 0


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS, ids=[a.value for a in RATE_ALGORITHMS])
def test_storm_with_costs_never_over_or_under_admits(
    redis_server: RedisServer, redis_client: redis.Redis, algorithm: Algorithm
) -> None:
    """Threads spending 1, 2, 3 or 4 tokens: admitted cost <= limit, and within max_cost of it."""
    limit = policy("100/h", burst=100, algorithm=algorithm)
    costs = [1, 2, 3, 4]
    report = storm(redis_server.url, redis_client, lambda p, t: [Check(limit, CALLER, cost=costs[t % len(costs)])])
    assert_clean(report)
    if algorithm is Algorithm.TOKEN_BUCKET:
        bound = token_bucket_bound(limit, report.elapsed_us)
        assert not gcra_envelope_violations(
            [(a.now_us, a.cost) for a in report.admitted], limit.rate.limit, limit.rate.period_us, limit.burst
        )
    else:
        # A window counter admits at most `limit` per calendar window; the storm almost always
        # fits in one hour-long window, but if it straddles a boundary the bound says so exactly.
        bound = limit.rate.limit * windows_spanned(limit, report.start_us, report.end_us)
    print(summary(f"{algorithm.value} 100/h, costs {costs}", report, bound))
    spent = report.admitted_cost
    assert spent <= bound, "over-admission"
    # Every denial saw spent + cost > limit and spending only grows: no under-admission.
    assert spent >= limit.rate.limit - max(costs) + 1, "under-admission"
    assert {a.cost for a in report.admitted} <= set(costs)

    # The stored state accounts for exactly the admitted cost: no lost update, no charge for denials.
    key = Check(limit, CALLER).key("rl")
    assert redis_client.keys("*") == [key.encode()]
    value = stored(redis_client, key, algorithm)
    if algorithm is Algorithm.TOKEN_BUCKET:
        assert report.elapsed_us < limit.rate.interval_us and bound == limit.burst
        first = min(a.now_us for a in report.admitted)
        assert value == (first + spent * limit.rate.interval_us,)
    elif windows_spanned(limit, report.start_us, report.end_us) == 1:
        window = report.start_us // limit.rate.period_us
        expected = (window, spent, 0) if algorithm is Algorithm.SLIDING_WINDOW else (window, spent)
        assert value == expected


def test_storm_two_checks_is_all_or_nothing(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Roomy org limit first, tight caller limit second: denied requests must charge neither.

    1600 attempts against an org budget of 1000: if denials leaked into the roomy bucket it
    would be drained (and start denying) instead of holding exactly 1000 - admitted.
    """
    roomy = policy("1000/d", burst=1000, name="roomy")
    tight = policy("100/h", burst=100, name="tight")
    checks = [Check(roomy, ORG), Check(tight, CALLER)]
    report = storm(redis_server.url, redis_client, lambda p, t: checks)
    assert_clean(report)
    bound = token_bucket_bound(tight, report.elapsed_us)
    print(summary("two checks: roomy 1000/d + tight 100/h", report, bound))
    admitted = len(report.admitted)
    assert report.elapsed_us < roomy.rate.interval_us  # neither bucket refills a token during the storm
    assert admitted == tight.burst == bound
    # Every decision: roomy allowed, tight alone decided the outcome.
    assert all(a.results[0][0] for a in report.attempts)
    assert all(a.allowed == a.results[1][0] for a in report.attempts)

    # Roomy consumption equals exactly the number of admitted requests.
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    peek = backend.decide([checks[0]], consume=False)
    assert peek.allowed
    assert peek.results[0].remaining == roomy.burst - admitted - 1  # a peek reports "after this one"
    first = min(a.now_us for a in report.admitted)  # one script invocation charged both keys at this time
    assert stored(redis_client, checks[0].key("rl")) == (first + admitted * roomy.rate.interval_us,)
    assert stored(redis_client, checks[1].key("rl")) == (first + admitted * tight.rate.interval_us,)


# --- window boundaries -------------------------------------------------------------------------


def fire(backend: RedisBackend, checks: list[Check], count: int, threads: int = 10) -> list[Decision]:
    """``count`` decisions from ``threads`` threads released together (bounded: count / threads each)."""
    assert count % threads == 0
    start = threading.Barrier(threads)
    out: list[list[Decision]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            start.wait(10)
            for _ in range(count // threads):
                out[i].append(backend.decide(checks))
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
        assert not worker.is_alive(), "a boundary thread hung"
    assert not errors, errors
    return [d for decisions in out for d in decisions]


K = 1_700_000_123  # a whole second; the boundary under test is K * 1 s
BEFORE, AFTER = K * SECOND - 1_000, K * SECOND + 1_000


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS, ids=[a.value for a in RATE_ALGORITHMS])
def test_boundary_with_exact_clock(redis_server: RedisServer, redis_client: redis.Redis, algorithm: Algorithm) -> None:
    """100 requests 1 ms before and 100 requests 1 ms after a second boundary, limit 100/s.

    token bucket:   bound = burst + floor(rate * 2 ms) = 100 + floor(0.2) = 100.
    sliding window: after the boundary the previous 100 still weigh 100 * 999/1000 = 99.9, so
                    room = floor(100 - 99.9) = 0: bound = 100 + floor(100 * 1 ms / 1 s) = 100.
    fixed window:   documented weakness: the counter resets at the boundary, 200 pass.

    The app clock is frozen at each instant while real time runs on; the script's one-second
    TTL slack keeps Redis from expiring state a real clock would still hold.
    """
    limit = policy("100/s", burst=100, algorithm=algorithm)
    period, rate_limit = limit.rate.period_us, limit.rate.limit
    clock = FakeClock()
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock)
    check = Check(limit, Subject("api_key", "boundary"))
    clock.now = BEFORE
    before = sum(d.allowed for d in fire(backend, [check], 100, threads=1))
    state = redis_client.get(check.key("rl"))
    clock.now = AFTER
    after = sum(d.allowed for d in fire(backend, [check], 100, threads=1))
    total = before + after
    print(f"{algorithm.value} 100/s across a boundary: {before} before + {after} after = {total}")

    assert before == 100  # a fresh limit admits its whole capacity
    if algorithm is Algorithm.TOKEN_BUCKET:
        assert state is not None and counts_of(algorithm, read_state(algorithm, state)) == (
            BEFORE + 100 * limit.rate.interval_us,
        )
        bound = token_bucket_bound(limit, AFTER - BEFORE)
        assert bound == 100
        assert total == bound
    elif algorithm is Algorithm.SLIDING_WINDOW:
        assert state is not None and counts_of(algorithm, read_state(algorithm, state)) == (K - 1, 100, 0)
        elapsed_in_window = AFTER - K * SECOND
        # room after = floor(limit - previous * (period - elapsed) / period), exact in integers
        room = (rate_limit * period - before * (period - elapsed_in_window)) // period
        bound = rate_limit + max(room, 0)
        assert bound == 100
        assert total <= bound
        assert after == max(room, 0)
    else:
        assert total == 2 * rate_limit  # the documented fixed-window burst across a boundary
        assert after == 100


def wait_for_redis_time(client: redis.Redis, done: Callable[[int], bool], timeout: float = 3.0) -> int:
    """Poll Redis TIME until ``done(now_us)``; bounded by count and wall time. Returns that time."""
    deadline = time.monotonic() + timeout
    for _ in range(1_000_000):
        now = redis_time_us(client)
        if done(now):
            return now
        if time.monotonic() > deadline:
            break
    pytest.fail("Redis TIME did not reach the awaited instant in time")


def test_boundary_with_redis_clock(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Token bucket on the server clock: 100 concurrent requests just before a second boundary,
    100 just after. Admitted <= burst + rate * elapsed (Redis TIME), and no under-admission."""
    limit = policy("100/s", burst=100)
    check = Check(limit, CALLER)
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=None)
    # Start in the last 50 ms of a second, so the boundary falls between the two batches.
    start_us = wait_for_redis_time(redis_client, lambda now: now % SECOND >= 950_000)
    boundary = (start_us // SECOND + 1) * SECOND
    first = fire(backend, [check], 100)
    first_end_us = redis_time_us(redis_client)
    second_start_us = wait_for_redis_time(redis_client, lambda now: now >= boundary)
    second = fire(backend, [check], 100)
    end_us = redis_time_us(redis_client)

    before, after = sum(d.allowed for d in first), sum(d.allowed for d in second)
    bound = token_bucket_bound(limit, end_us - start_us)
    print(
        f"token bucket 100/s on Redis time: {before} + {after} = {before + after} admitted "
        f"over {(end_us - start_us) / 1000:.1f} ms (bound {bound})"
    )
    assert all(start_us <= d.now_us <= first_end_us for d in first)
    assert all(boundary <= d.now_us <= end_us for d in second)
    assert before == 100
    assert before + after <= bound, "over-admission across the boundary"
    # No under-admission: by the second batch at least the refill since the first ended is back.
    assert after >= min(100, (second_start_us - first_end_us) * limit.rate.limit // limit.rate.period_us)
    admitted = [(d.now_us, 1) for d in first + second if d.allowed]
    assert not gcra_envelope_violations(admitted, limit.rate.limit, limit.rate.period_us, limit.burst)
