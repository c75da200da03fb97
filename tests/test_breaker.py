"""CircuitBreaker unit tests, driven by an injected monotonic clock (no sleeping)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import pytest

from ratelimits.backends.memory import MemoryBackend
from ratelimits.counters import Usage
from ratelimits.decisions import Decision, Verdict
from ratelimits.engine import Limiter
from ratelimits.engine.breaker import CircuitBreaker
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy
from ratelimits.rates import parse_rate

COOLDOWN = 2.0


class Clock:
    """Monotonic seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class YieldingClock(Clock):
    """Gives up the GIL on every read, so unsynchronised check-then-act code would interleave."""

    def __call__(self) -> float:
        os.sched_yield()
        return self.now


def breaker(
    clock: Clock, *, window: int = 10, min_calls: int = 5, failure_rate: float = 0.5, cooldown: float = COOLDOWN
) -> CircuitBreaker:
    return CircuitBreaker(window=window, min_calls=min_calls, failure_rate=failure_rate, cooldown=cooldown, clock=clock)


def feed(b: CircuitBreaker, outcomes: str) -> None:
    """Report calls in order: ``"F"`` a failure, ``"S"`` a success; each call asks allow() first."""
    for outcome in outcomes:
        assert b.allow(), f"breaker rejected a call while feeding {outcomes!r}"
        if outcome == "F":
            b.record_failure()
        else:
            b.record_success()


def open_breaker(b: CircuitBreaker) -> None:
    feed(b, "F" * b.min_calls)
    assert b.state == "open"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_starts_closed(clock: Clock) -> None:
    b = breaker(clock)
    assert b.state == "closed"
    assert b.allow()
    assert b.retry_after() == 0.0


def test_stays_closed_below_min_calls(clock: Clock) -> None:
    b = breaker(clock, min_calls=5)
    feed(b, "FFFF")  # 100 % failures, but only 4 calls
    assert b.state == "closed"
    assert all(b.allow() for _ in range(10))
    feed(b, "F")
    assert b.state == "open"


def test_opens_on_interleaved_failures_not_only_consecutive(clock: Clock) -> None:
    b = breaker(clock, window=10, min_calls=10, failure_rate=0.5)
    feed(b, "SFSFSFSFS")  # 4 of 9: never two failures in a row
    assert b.state == "closed"
    feed(b, "F")  # 5 of 10 = 50 %
    assert b.state == "open"
    assert not b.allow()


def test_below_the_rate_stays_closed(clock: Clock) -> None:
    b = breaker(clock, window=10, min_calls=10, failure_rate=0.5)
    feed(b, "SSFSFSFSSF" * 3)  # 40 % of every window
    assert b.state == "closed"


def test_old_outcomes_leave_the_window(clock: Clock) -> None:
    b = breaker(clock, window=4, min_calls=4, failure_rate=0.75)
    feed(b, "FFSS")  # 2 of 4
    feed(b, "SS")  # the two failures slide out: 0 of 4
    feed(b, "FF")  # 2 of 4; had the old failures been kept in the count it would be 4 of 4
    assert b.state == "closed"
    feed(b, "F")  # S F F F: 3 of 4
    assert b.state == "open"


@pytest.mark.parametrize(("rate", "successes", "failures"), [(0.7, 3, 7), (0.3, 7, 3), (0.6, 4, 6), (0.1, 9, 1)])
def test_opens_exactly_at_the_configured_rate(clock: Clock, rate: float, successes: int, failures: int) -> None:
    """The share 'reaches' the rate: 7 failures of 10 open a 0.7 breaker (no float rounding slack)."""
    b = breaker(clock, window=10, min_calls=10, failure_rate=rate)
    feed(b, "S" * successes + "F" * (failures - 1))
    assert b.state == "closed"
    feed(b, "F")
    assert b.state == "open"


def test_min_calls_above_window_is_clamped(clock: Clock) -> None:
    b = breaker(clock, window=4, min_calls=50, failure_rate=0.5)
    feed(b, "FFFF")
    assert b.state == "open"


def test_rejects_for_the_whole_cooldown(clock: Clock) -> None:
    b = breaker(clock)
    open_breaker(b)
    for _ in range(19):
        clock.advance(COOLDOWN / 20)
        assert b.state == "open"
        assert not b.allow()
    clock.advance(COOLDOWN / 20)
    assert b.state == "half-open"
    assert b.allow()


def test_retry_after_counts_down_the_cooldown(clock: Clock) -> None:
    b = breaker(clock)
    assert b.retry_after() == 0.0
    open_breaker(b)
    assert b.retry_after() == pytest.approx(COOLDOWN)
    clock.advance(0.5)
    assert b.retry_after() == pytest.approx(COOLDOWN - 0.5)
    clock.advance(COOLDOWN)
    assert b.retry_after() == 0.0
    assert b.allow()  # the probe
    b.record_success()
    assert b.retry_after() == 0.0


def test_only_one_probe_until_it_reports(clock: Clock) -> None:
    b = breaker(clock)
    open_breaker(b)
    clock.advance(COOLDOWN)
    assert b.allow()
    assert b.state == "half-open"
    assert [b.allow() for _ in range(20)] == [False] * 20
    clock.advance(10 * COOLDOWN)  # however long the probe takes, nobody else gets through
    assert not b.allow()


def race_for_probe(b: CircuitBreaker, threads_n: int) -> list[bool]:
    """``threads_n`` real threads call ``allow()`` at once (released together by a barrier)."""
    barrier = threading.Barrier(threads_n)
    granted: list[bool] = []
    lock = threading.Lock()

    def call() -> None:
        barrier.wait(timeout=10)
        ok = b.allow()
        with lock:
            granted.append(ok)

    threads = [threading.Thread(target=call) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert len(granted) == threads_n
    return granted


def test_exactly_one_probe_among_concurrent_threads() -> None:
    clock = YieldingClock()
    b = breaker(clock)
    open_breaker(b)
    for _ in range(30):
        assert race_for_probe(b, 16).count(True) == 0  # still cooling down
        clock.advance(COOLDOWN)
        assert race_for_probe(b, 16).count(True) == 1
        b.record_failure()  # the probe fails: open again for the next round
        assert b.state == "open"


def test_successful_probe_closes_with_a_fresh_window(clock: Clock) -> None:
    b = breaker(clock, window=10, min_calls=5)
    open_breaker(b)
    clock.advance(COOLDOWN)
    assert b.allow()
    b.record_success()
    assert b.state == "closed"
    assert all(b.allow() for _ in range(10))
    feed(b, "FFFF")  # the failures from before the probe are forgotten: 4 of 4 is below min_calls
    assert b.state == "closed"
    feed(b, "F")
    assert b.state == "open"


def test_failed_probe_reopens_for_another_full_cooldown(clock: Clock) -> None:
    b = breaker(clock)
    open_breaker(b)
    clock.advance(COOLDOWN + 7.0)  # the probe comes late
    assert b.allow()
    clock.advance(0.05)  # the probe times out
    b.record_failure()
    assert b.state == "open"
    assert b.retry_after() == pytest.approx(COOLDOWN)
    clock.advance(COOLDOWN - 0.001)
    assert not b.allow()
    clock.advance(0.001)
    assert b.allow()
    assert not b.allow()


def test_late_outcomes_of_calls_admitted_before_opening_do_not_change_an_open_breaker(clock: Clock) -> None:
    """Calls in flight when the breaker opens report afterwards: a success must not close it, a
    failure must not extend the cooldown."""
    b = breaker(clock, window=10, min_calls=5)
    assert all(b.allow() for _ in range(7))  # seven concurrent calls admitted while closed
    for _ in range(5):
        b.record_failure()
    assert b.state == "open"
    b.record_success()  # one of the other two, answered late
    assert b.state == "open"
    assert not b.allow()
    clock.advance(COOLDOWN / 2)
    b.record_failure()  # the last one, timed out
    clock.advance(COOLDOWN / 2)
    assert b.state == "half-open"
    assert b.allow()


class FlakyBackend(MemoryBackend):
    """A backend whose next calls raise the given exceptions (for the Limiter's wiring only)."""

    def __init__(self, errors: Sequence[BaseException]) -> None:
        super().__init__()
        self.errors = list(errors)

    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        if self.errors:
            raise self.errors.pop(0)
        return super().decide(checks, consume=consume, usage=usage)


def _checks() -> list[Check]:
    policy = Policy("tier:t", parse_rate("100/s"), 100)
    return [Check(policy, Subject("ip", "192.0.2.1"))]


def test_limiter_probe_that_dies_unexpectedly_does_not_wedge_the_breaker(clock: Clock) -> None:
    """A probe ended by anything but BackendUnavailable (a bug, a worker timeout) still reports."""
    b = breaker(clock, min_calls=1)
    limiter = Limiter(
        FlakyBackend([BackendUnavailable("down"), RuntimeError("boom")]), b, local=MemoryBackend(), local_share=1.0
    )
    assert limiter.decide(_checks()).degraded
    assert b.state == "open"
    clock.advance(COOLDOWN)
    with pytest.raises(RuntimeError):
        limiter.decide(_checks())  # the probe
    assert b.state == "open"  # counted as a failed probe, not left "in flight" forever
    clock.advance(COOLDOWN)
    decision = limiter.decide(_checks())
    assert decision.verdict is Verdict.ALLOW and not decision.degraded
    assert b.state == "closed"
