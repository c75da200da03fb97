"""Global policies across regions: each region enforces its share, and a reconciler round moves the shares.

Two private redis-servers are the two regions' stores (started here, stopped by PID). The
reconciler's rounds are called directly (``tests/test_regions_celery.py`` runs them under a real
Celery beat and worker); demand is real decisions in each region. What must hold:

- without any round, each region enforces an even split, so the regions together admit no more
  than the global burst;
- rounds align to just after each second's end, and a drifting beat leaves no second unread;
- a round moves the shares toward demand, they sum to exactly the limit, and a share change
  keeps the tokens a region holds (lowered: capped at its new burst; raised: refilled, not given);
- the script and the Python mirror decide a global bucket alike;
- a stale share decays linearly to the even split, in the script as in :class:`ShareRecord`;
- a region the round cannot reach (SIGSTOP) keeps its share and the others share the rest;
- two rounds at once never leave the shares summing above the limit (compare and set), and with
  PostgreSQL the second round waits its turn (an advisory lock).
"""

from __future__ import annotations

import datetime as dt
import random
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from bench.support.regions import PREFIX, global_check, region_settings, share_in
from ratelimits import engine
from ratelimits.algorithms import Algorithm, global_bucket
from ratelimits.backends import layout
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.backends.regions import RESHARE, RegionStore, ShareWrite
from ratelimits.choices import FailMode
from ratelimits.conf import conf
from ratelimits.decisions import peek
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import Override, Tier
from ratelimits.policies.snapshot import tier_policies
from ratelimits.policies.values import Check, Policy, Scope
from ratelimits.rates import parse_rate
from ratelimits.reconciler import CATCH_UP_S, ON_TIME_S, READ_AFTER_S, _lock_id, reconcile, rounds_due
from ratelimits.shares import ShareRecord, target_shares
from ratelimits.store.database import load_snapshot

from .support.redis_cluster import Cluster
from .support.redis_server import RedisServer
from .support.settings import merged

US = 1_000_000
#: A round takes the reconciliation lock in the database (on PostgreSQL).
pytestmark = pytest.mark.django_db


@pytest.fixture
def servers() -> Iterator[dict[str, RedisServer]]:
    with RedisServer() as a, RedisServer() as b:
        yield {"a": a, "b": b}


@pytest.fixture
def regions(settings: Any, servers: dict[str, RedisServer]) -> dict[str, RedisServer]:
    settings.RATELIMITS = {**settings.RATELIMITS, "BACKEND": "redis", **region_settings(servers, "a")}
    conf.clear()
    return servers


def backend(server: RedisServer) -> RedisBackend:
    return RedisBackend(server.client(), prefix=PREFIX)


def burst_admitted(server: RedisServer, check: Check, requests: int) -> int:
    store = backend(server)
    return sum(store.decide([check]).allowed for _ in range(requests))


def ask(server: RedisServer, check: Check, seconds: float, every: float = 0.005) -> None:
    """Decisions for ``seconds``: demand the next round reads (the second they fall in is then over)."""
    store = backend(server)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        store.decide([check])
        time.sleep(every)


def wait_for_next_second() -> int:
    """Sleep into the next second (a start, not a synchronisation); that second."""
    time.sleep(1.02 - time.time() % 1)
    return int(time.time())


def reconcile_second(second: int) -> Any:
    """A round reading ``second``'s demand, once that second is whole (its moment, as beat's round would
    start), even if the test comes late: a decision that ran past the second's end (a loaded machine)
    then only misses this round, rather than the round reading the next second instead."""
    time.sleep(max(second + 1 + READ_AFTER_S - time.time(), 0))
    return reconcile(now=second + 1 + READ_AFTER_S)


# -- enforcing a share ------------------------------------------------------------------------------


def test_without_a_round_each_region_enforces_an_even_split(regions: dict[str, RedisServer]) -> None:
    check = global_check("10/m", 100)
    admitted = {name: burst_admitted(server, check, 80) for name, server in regions.items()}
    assert admitted == {"a": 50, "b": 50}  # the burst split in two; 10 a minute refills nothing meanwhile
    assert sum(admitted.values()) <= check.policy.burst


def test_a_global_policy_needs_a_token_bucket_and_no_shards() -> None:
    with pytest.raises(ConfigurationError, match="scope 'global' needs the token_bucket algorithm"):
        Policy("g", parse_rate("10/s"), 10, algorithm=Algorithm.FIXED_WINDOW, scope=Scope.GLOBAL)
    with pytest.raises(ConfigurationError, match="cannot be sharded"):
        Policy("g", parse_rate("10/s"), 10, shards=2, scope=Scope.GLOBAL)


def test_the_script_and_the_python_mirror_decide_a_global_bucket_alike(own_redis: RedisServer) -> None:
    """Random costs and gaps against the same share (the even split of two regions): the same verdicts and figures."""
    rng = random.Random(13)
    client = own_redis.client()
    store = RedisBackend(client, prefix=PREFIX, clock=lambda: clock[0])
    with_regions = {"REGIONS": {"CURRENT": "a", "STORES": {"a": own_redis.url, "b": own_redis.url}}}
    with override_settings(RATELIMITS=with_regions):
        conf.clear()
        check = Check(Policy("g", parse_rate("7/s"), 9, scope=Scope.GLOBAL), Subject(SubjectKind.USER, "u"), 1)
        clock = [1_000_000_000_000]
        state = None
        for _ in range(400):
            clock[0] += rng.choice([0, 1, 1000, 50_000, 140_000, 400_000])
            cost = rng.choice([1, 1, 1, 2, 4])
            costly = Check(check.policy, check.subject, cost)
            ours = global_bucket(state, clock[0], 7, US, 9, cost, 0.5)
            theirs = store.decide([costly]).results[0]
            assert (theirs.allowed, theirs.remaining, theirs.retry_us) == (ours.allowed, ours.remaining, ours.retry_us)
            assert abs(theirs.reset_us - ours.reset_us) <= 1
            if ours.allowed:
                state = ours.new_state
                assert struct.unpack("<ddddd", client.get(check.key(PREFIX))) == pytest.approx(state, rel=1e-12)
    conf.clear()


def test_the_memory_backend_enforces_the_even_split(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {"REGIONS": {"CURRENT": "a", "STORES": {name: "redis://127.0.0.1:6379/0" for name in ("a", "b", "c", "d")}}},
    )
    conf.clear()
    check = global_check("1/m", 40)
    store = MemoryBackend()
    assert sum(store.decide([check]).allowed for _ in range(20)) == 10  # a quarter of the burst


# -- when rounds run ---------------------------------------------------------------------------------


def test_a_task_reads_the_last_second_at_once_only_when_it_is_just_over() -> None:
    moment = 1_800_000_000 + 1 + READ_AFTER_S  # second 1_800_000_000's: just after its end
    second = 1_800_000_000
    assert rounds_due(moment) == [(moment, second)]
    assert rounds_due(moment + ON_TIME_S) == [(moment + ON_TIME_S, second)]
    # Later: that second at once (the task before may have read the one before it only), and the next at its moment.
    assert rounds_due(moment + 0.2) == [(moment + 0.2, second), (pytest.approx(moment + 1), second + 1)]
    # Later still: the next second alone, waiting for its moment (the task before waited for this one).
    assert rounds_due(moment + CATCH_UP_S + 0.01) == [(pytest.approx(moment + 1), second + 1)]
    assert rounds_due(moment + 0.99) == [(pytest.approx(moment + 1), second + 1)]
    # Just before the moment: not yet whole (a decision named in it may still be on its way).
    assert rounds_due(moment - 0.01) == [(pytest.approx(moment), second)]


def test_a_drifting_beat_leaves_no_second_unread_and_reads_each_just_after_its_end() -> None:
    """An hour of Celery beat's ticks: each due a second after the last one *ran* (they drift later, by
    up to 12 ms here), each task starting up to 80 ms after its tick (a busy worker). Every second is
    read, at most ``CATCH_UP_S`` after its moment; the rounds a task runs for a second already read
    (the catch-up's) stay few. Rounds at beat's own ticks would leave a second unread at every
    crossing of a second's end, and read each up to a second late: both fail here.
    """
    for seed in range(5):
        rng = random.Random(seed)
        tick = 1_800_000_000 + rng.random()
        first_read: dict[int, float] = {}
        rounds = 0
        for _ in range(3600):
            tick += 1 + rng.uniform(0, 0.012)
            for start, second in rounds_due(tick + rng.uniform(0, 0.08)):
                assert start >= second + 1 + READ_AFTER_S - 1e-6  # never before the second is whole
                first_read.setdefault(second, start)
                rounds += 1
        seconds = sorted(first_read)
        assert [s for s in range(seconds[0], seconds[-1] + 1) if s not in first_read] == [], seed
        assert max(first_read[s] - (s + 1 + READ_AFTER_S) for s in seconds) <= CATCH_UP_S + 1e-6, seed
        # A task reads twice only while its ticks fall in (ON_TIME_S, CATCH_UP_S] after a moment: 15 % of
        # a second, which the drift sweeps evenly (measured: 14-16 % over these seeds).
        assert rounds <= 3600 * 1.2, (seed, rounds)


def test_a_round_started_mid_second_waits_for_its_end_and_reads_it(regions: dict[str, RedisServer]) -> None:
    """Demand in a for half of second s, a round called at once: it reads s once s is over, not s - 1."""
    check = global_check("100/s", 100)
    second = wait_for_next_second()
    ask(regions["a"], check, 0.5)
    done = reconcile()  # called about half way through s: as beat's task calls it
    assert done.second == second, done
    # The round starts just after s is whole: never before (the demand named in s could be on its way),
    # and late only by the sleep's overshoot: milliseconds, tens of them with both cores busy (the
    # flake check's CPU hogs). 0.5 s is ten times that, and still well short of the next second's end.
    assert second + 1 + READ_AFTER_S <= done.at < second + 1 + READ_AFTER_S + 0.5, (done.at, second)
    assert share_in(regions["a"], check, 2) == pytest.approx(1 - conf.regions.reconcile.floor)


# -- a round -----------------------------------------------------------------------------------------


def test_a_round_moves_the_shares_toward_demand_and_they_sum_to_the_limit(regions: dict[str, RedisServer]) -> None:
    check = global_check("100/s", 100)
    second = wait_for_next_second()
    ask(regions["a"], check, 0.9)
    done = reconcile_second(second)
    # Both regions told the round's shares (b lowered, a held), then a raised: three writes.
    assert done.reached == ["a", "b"] and done.subjects == 1 and done.written == 3, done
    a, b = (share_in(regions[name], check, 2) for name in ("a", "b"))
    floor = conf.regions.reconcile.floor
    assert a == pytest.approx(1 - floor) and b == pytest.approx(floor)
    assert a + b == pytest.approx(1.0, abs=1e-12)
    # Demand in both, three to one: the floor each, the rest three to one.
    second = wait_for_next_second()
    thread = threading.Thread(target=ask, args=(regions["b"], check, 0.9, 0.015))
    thread.start()
    ask(regions["a"], check, 0.9)
    thread.join()
    reconcile_second(second)
    records = {
        name: ShareRecord.unpack(regions[name].client().get(layout.share_key(check.key(PREFIX)))) for name in regions
    }
    assert {records["a"].epoch, records["b"].epoch} <= {3, 4}  # the second round's: 3, and 4 where raised
    assert records["a"].shares == records["b"].shares  # every region holds the round's whole vector
    assert records["a"].share + records["b"].share == pytest.approx(1.0, abs=1e-12)
    assert records["a"].share > records["b"].share > floor


def test_a_share_change_keeps_the_tokens_each_region_holds(regions: dict[str, RedisServer]) -> None:
    """Lowered, a region keeps what fits its new burst; raised, it gets capacity, not tokens."""
    check = global_check("1/m", 100)  # refills nothing meanwhile
    assert burst_admitted(regions["a"], check, 50) == 50  # a has spent its whole half
    assert burst_admitted(regions["b"], check, 1) == 1  # b spent 1 of its 50
    second = wait_for_next_second()
    ask(regions["a"], check, 0.5)  # then demand in a only (all denied): a's share goes up
    reconcile_second(second)
    assert share_in(regions["a"], check, 2) == pytest.approx(0.95)
    # a holds 95 of capacity but no tokens were made: still none; b keeps 5 of its 49.
    assert burst_admitted(regions["a"], check, 20) == 0
    assert burst_admitted(regions["b"], check, 20) == 5
    assert check.policy.burst >= 50 + 1 + 5


def test_a_stale_share_decays_to_the_even_split_in_the_script_as_in_the_record(
    regions: dict[str, RedisServer],
) -> None:
    check = global_check("1/h", 1000)
    settings = conf.regions.reconcile
    # Written by a round long ago: a's 0.95 went stale half the decay ago.
    long_ago = time.time() - settings.stale_after - settings.decay / 2
    store = RegionStore("a", regions["a"].client(), prefix=PREFIX)
    record = ShareRecord(0.95, long_ago * US, settings.stale_after * US, settings.decay * US, 0.5, 7, (0.95, 0.05))
    key = check.key(PREFIX)
    assert store.write([ShareWrite(key, 0, record, 0.0, 0.0, 0.0)], 600_000, time.time() + 5) == {key: "w"}
    now_us = time.time() * US
    expected = record.effective(now_us)
    assert expected == pytest.approx(0.725, abs=0.01)  # half way from 0.95 to 0.5
    assert burst_admitted(regions["a"], check, 1000) == pytest.approx(1000 * expected, abs=3)


def test_a_share_below_the_even_split_never_rises_by_decay(regions: dict[str, RedisServer]) -> None:
    """Only a write raises a share: a region left low by a round the others outlived cannot grow on its own."""
    check = global_check("1/h", 1000)
    settings = conf.regions.reconcile
    long_ago = time.time() - settings.stale_after - settings.decay * 2  # fully decayed, were it above
    record = ShareRecord(0.05, long_ago * US, settings.stale_after * US, settings.decay * US, 0.5, 3, (0.95, 0.05))
    store = RegionStore("b", regions["b"].client(), prefix=PREFIX)
    key = check.key(PREFIX)
    assert store.write([ShareWrite(key, 0, record, 0.0, 0.0, 0.0)], 600_000, time.time() + 5) == {key: "w"}
    assert record.effective(time.time() * US) == 0.05
    assert burst_admitted(regions["b"], check, 1000) == 50


def test_a_region_raised_before_it_ever_admitted_gets_capacity_not_tokens(regions: dict[str, RedisServer]) -> None:
    """A region with demand but no state (everything it asked was denied) is not made a full bucket by a raise."""
    check = global_check("1/m", 100)  # refills nothing meanwhile
    costly = Check(check.policy, check.subject, 60)  # more than b's even half holds: always denied there
    assert burst_admitted(regions["a"], check, 50) == 50  # a spent its half
    second = wait_for_next_second()
    assert burst_admitted(regions["b"], costly, 10) == 0  # demand in b, and no state
    reconcile_second(second)
    assert share_in(regions["b"], check, 2) == pytest.approx(0.95)
    # b was a full half (50) when raised: it holds those 50 and may refill to 95, but is given nothing.
    assert burst_admitted(regions["b"], costly, 1) == 0
    assert burst_admitted(regions["b"], check, 100) == 50
    assert burst_admitted(regions["a"], check, 10) == 0  # together 100: the burst, no more


def test_a_write_that_arrives_too_late_is_refused(regions: dict[str, RedisServer]) -> None:
    """A stopped store runs what queued up once resumed: a share write that old must not land."""
    check = global_check("1/h", 1000)
    key = check.key(PREFIX)
    settings = conf.regions.reconcile
    record = ShareRecord(0.9, time.time() * US, settings.stale_after * US, settings.decay * US, 0.5, 1, (0.9, 0.1))
    store = RegionStore("a", regions["a"].client(), prefix=PREFIX)  # 5 s timeout: waits out the stop
    store.client.script_load(RESHARE.text)  # so the write is sent once, not again after a NOSCRIPT
    regions["a"].pause()
    outcome: list[dict[str, bool]] = []
    writer = threading.Thread(
        target=lambda: outcome.append(store.write([ShareWrite(key, 0, record, 0, 0, 0)], 60_000, time.time() + 0.1))
    )
    writer.start()
    try:
        writer.join(0.4)  # the write is on its way to a store that does not answer
        assert writer.is_alive()
    finally:
        regions["a"].resume()
    writer.join(5)
    assert outcome == [{key: "l"}]
    assert regions["a"].client().get(layout.share_key(key)) is None


def test_a_malformed_share_record_reads_as_the_even_split(regions: dict[str, RedisServer]) -> None:
    check = global_check("1/h", 100)
    key = check.key(PREFIX)
    regions["a"].client().set(layout.share_key(key), b"not a record")
    assert burst_admitted(regions["a"], check, 80) == 50
    assert backend(regions["a"]).shares([check]) == {}
    second = wait_for_next_second()
    ask(regions["a"], check, 0.2)
    done = reconcile_second(second)  # reads it as none, and writes a record over it
    assert done.written == 3  # both regions told, then a raised
    assert share_in(regions["a"], check, 2) == pytest.approx(0.95)


def test_a_region_left_nothing_admits_nothing_and_says_when_to_retry(own_redis: RedisServer) -> None:
    check = global_check("10/s", 10)
    now_us = time.time() * US
    record = ShareRecord(0.0, now_us, 10 * US, 30 * US, 0.5, 1, (0.0, 1.0))
    own_redis.client().set(layout.share_key(check.key(PREFIX)), record.pack())
    result = backend(own_redis).decide([check]).results[0]
    assert (result.allowed, result.remaining, result.reset_us, result.retry_us) == (False, 0, 0, 1_000_000)
    mirror = global_bucket(None, int(now_us), 10, US, 10, 1, 0.0)
    assert (mirror.allowed, mirror.remaining, mirror.reset_us, mirror.retry_us) == (False, 0, 0, 1_000_000)


def test_an_unreachable_region_keeps_its_share_and_the_others_get_only_the_rest(
    regions: dict[str, RedisServer],
) -> None:
    check = global_check("100/s", 100)
    second = wait_for_next_second()
    ask(regions["b"], check, 0.9)
    reconcile_second(second)
    assert share_in(regions["b"], check, 2) == pytest.approx(0.95)
    second = wait_for_next_second()
    ask(regions["a"], check, 0.9)  # demand moves to a, but b cannot be reached
    regions["b"].pause()
    try:
        done = reconcile_second(second)
    finally:
        regions["b"].resume()
    assert done.unreachable == ["b"] and done.reached == ["a"], done
    # b may still hold 0.95: a may not be raised above what is left.
    assert share_in(regions["a"], check, 2) == pytest.approx(0.05)
    assert share_in(regions["b"], check, 2) == pytest.approx(0.95)
    # Reached again, the shares follow demand.
    second = wait_for_next_second()
    ask(regions["a"], check, 0.9)
    done = reconcile_second(second)
    assert done.unreachable == []
    assert share_in(regions["a"], check, 2) == pytest.approx(0.95)
    assert share_in(regions["b"], check, 2) == pytest.approx(0.05)


def test_target_shares_give_the_floor_and_the_rest_by_demand() -> None:
    assert target_shares({"a": 30.0, "b": 10.0}, 1.0, 0.1, {}) == pytest.approx({"a": 0.7, "b": 0.3})
    assert target_shares({"a": 0.0, "b": 0.0}, 1.0, 0.1, {"a": 0.2, "b": 0.8}) == {"a": 0.2, "b": 0.8}
    assert target_shares({"a": 5.0}, 0.5, 0.05, {}) == pytest.approx({"a": 0.5})  # b unreachable, holds 0.5
    assert target_shares({"a": 1.0, "b": 1.0, "c": 1.0}, 0.12, 0.05, {}) == pytest.approx(dict.fromkeys("abc", 0.04))


# -- two rounds at once --------------------------------------------------------------------------------


def test_two_rounds_at_once_never_leave_the_shares_above_the_limit(regions: dict[str, RedisServer]) -> None:
    """Rounds that read different seconds (demand in a, then in b) race on every subject.

    Each lowers one region and raises the other. Without the compare and set, the interleaving
    lower, lower, raise, raise leaves both regions at 0.95. Run without the lock (as on a database
    other than PostgreSQL), many times from the same start.
    """
    checks = [global_check("100/s", 100, subject=f"org-{i}") for i in range(20)]
    wait_for_next_second()
    first = int(time.time())
    for check in checks:
        ask(regions["a"], check, 0.03, every=0.001)
    wait_for_next_second()
    for check in checks:
        ask(regions["b"], check, 0.03, every=0.001)
    wait_for_next_second()
    conflicts = 0
    for _ in range(15):
        for server in regions.values():
            server.client().delete(*[layout.share_key(c.key(PREFIX)) for c in checks])
        barrier = threading.Barrier(2)
        rounds: list[Any] = []
        threads = [
            threading.Thread(target=race, args=(regions, second, barrier, rounds)) for second in (first, first + 1)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        conflicts += sum(r.conflicts for r in rounds)
        for check in checks:
            total = sum(share_in(server, check, 2) for server in regions.values())
            assert total <= 1 + 1e-9, (check.subject, total, rounds)
    print(f"\n15 races of 2 rounds on 20 subjects: {conflicts} writes refused by the compare and set")


def race(regions: dict[str, RedisServer], second: int, barrier: threading.Barrier, rounds: list[Any]) -> None:
    """One round reading ``second``'s demand, started with another (the barrier)."""
    stores = {name: RegionStore(name, server.client(), prefix=PREFIX) for name, server in regions.items()}
    barrier.wait(5)
    rounds.append(reconcile(stores=stores, now=second + 1.5, lock=False))


@pytest.mark.django_db(transaction=True)
def test_a_second_round_waits_for_the_first_on_postgresql(regions: dict[str, RedisServer]) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the reconciliation lock is PostgreSQL's advisory lock (the PostgreSQL run has it)")
    params = connection.get_connection_params()
    holder = psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "host", "port", "password")})
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", [_lock_id()])
        assert reconcile().skipped
        # Released by the holder, which returns once it is: a closed connection's backend lets
        # its locks go after close() has returned (a flake in CI).
        holder.execute("SELECT pg_advisory_unlock(%s)", [_lock_id()])
    finally:
        holder.close()
    assert not reconcile().skipped


# -- settings and the admin ---------------------------------------------------------------------------


def test_a_global_tier_in_the_settings_and_its_quota(settings: Any) -> None:
    (rate,) = tier_policies("gold", {"rate": "10/s", "scope": "global"}, field="t", fail_mode=FailMode.OPEN)
    assert rate.is_global and rate.key_suffix.endswith("g")
    with pytest.raises(ConfigurationError, match=r"t\['quota'\]: a global tier cannot have a quota"):
        tier_policies("gold", {"rate": "10/s", "scope": "global", "quota": "100/d"}, field="t", fail_mode=FailMode.OPEN)
    with pytest.raises(ConfigurationError, match=r"t\['scope'\]: 'planet' must be 'region' or 'global'"):
        tier_policies("gold", {"rate": "10/s", "scope": "planet"}, field="t", fail_mode=FailMode.OPEN)


def test_the_admin_refuses_a_global_tier_it_cannot_split() -> None:
    tier = Tier(name="g", rate="10/s", scope="global", algorithm="sliding_window")
    with pytest.raises(ValidationError) as refused:
        tier.full_clean()
    assert "scope" in refused.value.message_dict
    tier = Tier(name="g", rate="10/s", scope="global", quota="100/d")
    with pytest.raises(ValidationError) as refused:
        tier.full_clean()
    assert "quota" in refused.value.message_dict
    override = Override(
        subject_kind="user", subject_id="7", concurrency=3, scope="global", reason="x", expires_at="2099-01-01T00:00Z"
    )
    with pytest.raises(ValidationError) as refused:
        override.full_clean()
    assert "scope" in refused.value.message_dict


def test_the_rate_limit_view_shows_the_global_limit_and_this_regions_share(
    regions: dict[str, RedisServer], settings: Any
) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "REDIS": {"URL": regions["a"].url, "KEY_PREFIX": PREFIX},
            "TIERS": {
                "anonymous": {"rate": "100/s", "burst": 100, "scope": "global"},
                "authenticated": {"rate": "100/s"},
            },
        },
    )
    conf.clear()
    engine.reset()
    client = APIClient(REMOTE_ADDR="203.0.113.9")
    body = client.get("/v1/rate_limit").json()
    (tier,) = [r for r in body["resources"] if r["policy"] == "tier:anonymous"]
    assert tier["scope"] == "global" and tier["region"] == "a"
    assert tier["region_share"] == 0.5 and tier["region_limit"] == 50 and tier["reconciled_at"] is None
    assert tier["limit"] == 100


# -- a cluster as a region -----------------------------------------------------------------------------


def test_a_cluster_region_is_reconciled_like_a_single_server(
    settings: Any, own_redis: RedisServer, redis_cluster: Cluster, cluster_client: Any
) -> None:
    """Region b on a Redis Cluster: demand counted per slot, read from every node, shares written per slot."""
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"REGIONS": {"CURRENT": "a", "STORES": {"a": own_redis.url, "b": redis_cluster.url}}}
    )
    conf.clear()
    in_b = ClusterBackend(make_client(redis_cluster.url, 2.0, 2.0), prefix=PREFIX)  # type: ignore[arg-type]
    checks = [global_check("1/m", 100, subject=f"org-{i}") for i in range(12)]  # over every master; no refill
    in_b.decide(checks, consume=False)  # connections to every master, scripts loaded: no demand counted
    wait_for_next_second()
    for check in checks:
        for _ in range(5):
            in_b.decide([check])
    # A round reads one second: the 60 decisions take a fraction of one, but may straddle a second's end
    # on a busy machine. A round for each second their demand was counted in (as the store names it),
    # each once that second is whole. (Not every second from the first decision's to the last's: a
    # round over 16,384 slots' hashes took 4 s with both cores busy, and a hash lives 10 s.)
    keys = [key for node in redis_cluster.masters() for key in node.client().scan_iter(match=f"{PREFIX}*demand:*")]
    seconds = sorted({int(key.rsplit(b":", 1)[-1]) for key in keys})
    time.sleep(max(seconds[-1] + 1 + READ_AFTER_S - time.time(), 0))
    rounds = [reconcile(now=second + 1 + READ_AFTER_S) for second in seconds]  # the oldest (first to expire) first
    for done in rounds:
        assert done.reached == ["a", "b"] and done.written == 3 * done.subjects, rounds  # both told, then b raised
    assert len(checks) <= sum(done.subjects for done in rounds), rounds  # every subject's demand, once or twice
    shares = in_b.shares(checks)
    assert len(shares) == len(checks)
    for check in checks:
        assert shares[check.key(PREFIX)].effective(time.time() * US) == pytest.approx(0.95)
        assert share_in(own_redis, check, 2) == pytest.approx(0.05)
    # b's buckets were converted where they live: the 45 of 50 they held are kept, under a burst of 95
    # (a look that spends nothing answers what would be left after one more request).
    assert in_b.decide([checks[0]], consume=False).results[0].remaining == 44


def test_what_is_left_of_a_global_policy_counts_this_regions_slower_refill(own_redis: RedisServer) -> None:
    """A region at share 0.5 refills 50 of 100/s: 10 spent are whole again in 0.2 s, not 0.1 s."""
    store = RedisBackend(own_redis.client(), prefix=PREFIX, clock=lambda: clock[0])
    clock = [1_800_000_000_000_000]
    with override_settings(RATELIMITS={"REGIONS": {"CURRENT": "a", "STORES": {n: own_redis.url for n in "ab"}}}):
        conf.clear()
        check = global_check("100/s", 100)
        for _ in range(10):
            assert store.decide([check]).allowed
        looked = store.decide([check], consume=False).results[0]
        seen = peek(looked, now_us=clock[0], share=0.5)
        assert (seen.limit, seen.remaining, seen.reset_after_us) == (100, 40, 200_000)
    conf.clear()


def test_an_override_saved_with_a_bad_scope_is_left_out_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    expires = timezone.now() + dt.timedelta(days=1)
    good = Override.objects.create(
        subject_kind="user", subject_id="7", rate="5/s", scope="global", reason="r", expires_at=expires
    )
    Override.objects.create(
        subject_kind="user", subject_id="8", rate="5/s", scope="planet", reason="r", expires_at=expires
    )
    snapshot = load_snapshot()
    assert [rule.id for rules in snapshot.overrides.values() for rule in rules] == [good.pk]
    assert "override #" in caplog.text and "'planet' must be 'region' or 'global'" in caplog.text
