"""Deadlines: a script that runs after its worker stopped waiting does nothing (ratelimits/backends/deadline.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio

from ratelimits.backends import layout
from ratelimits.backends.deadline import ANSWER_SHARE, StoreClock
from ratelimits.backends.redis import ADD_USAGE, DECIDE, Functions, RedisBackend, _arun, make_client, with_deadline
from ratelimits.choices import FailMode
from ratelimits.counters import usage_for
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject
from ratelimits.policies import Check
from ratelimits.policies.values import concurrency_policy

from .support.redis_server import RedisServer
from .test_contract import policy

ALICE = Subject("api_key", "alice")


def test_the_offset_is_the_least_bound_seen_and_never_below_the_true_one() -> None:
    clock = StoreClock()
    assert clock.offset_us() is None and clock.deadline_us(1_000, 0.05) == 0  # nothing known: no deadline
    true_offset = 5_000  # the store's clock is 5 ms ahead
    for sent, trip in ((1_000_000, 300), (2_000_000, 40), (3_000_000, 9_000)):
        clock.observe(sent, sent + trip + true_offset)  # the script ran ``trip`` after the send
    assert clock.offset_us() == true_offset + 40
    assert clock.deadline_us(10_000_000, 0.05) == 10_000_000 + true_offset + 40 + int(0.05 * (1 - ANSWER_SHARE) * 1e6)
    assert clock.deadline_us(10_000_000, 0.05, waiting_s=0.1) == clock.deadline_us(10_000_000, 0.05) + 100_000
    assert StoreClock(in_step=True).offset_us() == 0  # the app's clock decides: taken as the store's


def test_bounds_from_two_windows_ago_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("ratelimits.backends.deadline.time.monotonic", lambda: now[0])
    clock = StoreClock()
    clock.observe(0, 10)
    now[0] += 31
    clock.observe(0, 500)
    assert clock.offset_us() == 10  # the last window's still counts
    now[0] += 31
    clock.observe(0, 700)
    assert clock.offset_us() == 500  # the clocks drifted: the oldest bound is gone


@pytest.fixture
def backend(redis_server: RedisServer, redis_client: redis.Redis) -> RedisBackend:
    return RedisBackend(make_client(redis_server.url, 2.0, 2.0))


def test_a_decision_that_runs_late_takes_spends_and_counts_nothing(
    backend: RedisBackend, redis_client: redis.Redis
) -> None:
    slot_check = Check(concurrency_policy("c", 1, fail_mode=FailMode.OPEN), ALICE)
    checks = [Check(policy("10/s"), ALICE), slot_check]
    usage = usage_for(ALICE, None, "free", "e", 1)
    keys, args = backend.decide_call(checks, consume=True, usage=usage, slot="s1", deadline=1)  # long past
    with pytest.raises(BackendUnavailable, match="LATE"):
        backend._run(DECIDE, keys, args)
    assert redis_client.exists(*keys[1:]) == 0  # no bucket spent, no slot taken, no usage counted
    keys, args = backend.decide_call(checks, consume=True, usage=usage, slot="s1", deadline=2**52)  # far ahead
    reply: Any = backend._run(DECIDE, keys, args)
    assert all(retry == 0 for retry in reply[4::3])  # in time: decided as ever
    assert redis_client.zcard(checks[1].key(backend.prefix)) == 1


def test_a_usage_flush_that_runs_late_counts_nothing(backend: RedisBackend, redis_client: redis.Redis) -> None:
    usage = usage_for(ALICE, None, "free", "e", 1)
    minutes, args = backend.add_usage_call({(usage.minute, usage.field + "d"): 3})
    args[2] = 1  # its deadline, long past
    usage_keys = [layout.usage_key(backend.prefix, minute) for minute in minutes]
    with pytest.raises(BackendUnavailable, match="LATE"):
        backend._run(ADD_USAGE, usage_keys, args)
    assert redis_client.exists(*usage_keys) == 0
    args[2] = 0  # none
    backend._run(ADD_USAGE, usage_keys, args)
    assert redis_client.hget(usage_keys[0], usage.field + "d") == b"3"


def test_a_worker_learns_the_offset_from_its_decisions_and_sends_deadlines(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    timed = RedisBackend(make_client(redis_server.url, 0.05, 0.05), timeouts=(0.05, 0.05))
    check = Check(policy("10/s"), ALICE)
    assert timed.decide([check]).allowed  # the first call carries no deadline, and teaches the offset
    offset = timed.store_clock.offset_us()
    assert offset is not None and abs(offset) < 1_000_000  # one machine's clocks: a trip apart
    assert timed.decide([check]).allowed  # sent with a deadline, in time


@pytest.mark.parametrize("on_a_loop", [False, True], ids=["sync", "asyncio"])
def test_a_call_sent_again_is_stamped_again(own_redis: RedisServer, on_a_loop: bool) -> None:
    """A call the store did not run (it lost the decide Function) is sent again after the load, and
    stamped again: the worker waits its timeout from the new send, so the deadline counts from it."""
    backend = RedisBackend(make_client(own_redis.url, 2.0, 2.0))
    checks = [Check(policy("10/s"), ALICE)]
    assert backend.decide(checks).allowed  # the Function loaded
    own_redis.client().function_flush()
    keys, args = backend.decide_call(checks, consume=True, usage=None, slot=None)
    deadlines = [1, 2**52]  # the first send's deadline long past (it never runs), the second's far ahead
    stamps: list[int] = []

    def stamp(sent: Any) -> Any:
        stamps.append(deadlines[len(stamps)])
        return with_deadline(sent, stamps[-1])

    if on_a_loop:

        async def run() -> Any:
            client = redis.asyncio.Redis.from_url(own_redis.url)
            try:
                return await _arun(client, DECIDE, keys, args, Functions(), stamp)
            finally:
                await client.aclose()

        reply: Any = asyncio.run(run())
    else:
        reply = backend._run(DECIDE, keys, args, stamp)
    assert stamps == deadlines  # stamped as each send went out
    assert all(retry == 0 for retry in reply[4::3])  # the second send ran, in time
