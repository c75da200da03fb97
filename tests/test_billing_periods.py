"""Quotas by billing period: a calendar day, week or month in a time zone, from a customer's anchor.

The periods themselves (month ends, daylight-saving days, the bounds a store picks from), then the
decision on every backend at a period's boundary, on a fake clock and on Redis's own, and how a
tier says it.
"""

from __future__ import annotations

import csv
import io
import math
import random
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends import layout
from ratelimits.backends import redis as redis_backend
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.codec import read_state
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.choices import FailMode
from ratelimits.conf import LocalPathSettings
from ratelimits.exceptions import ConfigurationError
from ratelimits.headers import rate_limit_headers
from ratelimits.identity import Subject
from ratelimits.models import Override, SubjectAssignment, Tier, UsageRecord
from ratelimits.periods import DAY_US, LONGEST_US, BillingPeriod, Unit, parse_calendar_quota
from ratelimits.policies import Check, Policy
from ratelimits.policies.snapshot import tier_policies
from ratelimits.policies.values import Role
from ratelimits.rates import Rate
from ratelimits.usage.subjects import write_pending

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.clock import FakeClock
from .support.redis_server import RedisServer, script_calls
from .support.settings import merged
from .test_local_path import limiter_on

PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")
ACME = Subject("api_key", "acme")
BOB = Subject("api_key", "bob")
PARIS_MONTH = BillingPeriod(Unit.MONTH, "Europe/Paris")


def us(moment: datetime) -> int:
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def quota(limit: int, period: BillingPeriod, *, soft: bool = False) -> Policy:
    rate = Rate(limit, LONGEST_US[period.unit])
    return Policy("tier:pro:quota", rate, limit, Algorithm.FIXED_WINDOW, role=Role.QUOTA, period=period, soft=soft)


# -- the periods -----------------------------------------------------------------------------------


def test_a_month_anchored_on_the_31st_renews_on_each_months_last_day_when_it_is_shorter() -> None:
    month = BillingPeriod(Unit.MONTH, "Europe/Paris", datetime(2026, 1, 31, 9, 30, tzinfo=PARIS))
    starts = [month.start(datetime(2026, m, 15, tzinfo=PARIS)) for m in (2, 3, 4)]
    assert starts == [
        datetime(2026, 1, 31, 9, 30, tzinfo=PARIS),
        datetime(2026, 2, 28, 9, 30, tzinfo=PARIS),
        datetime(2026, 3, 31, 9, 30, tzinfo=PARIS),
    ]
    assert month.start(datetime(2028, 3, 15, tzinfo=PARIS)) == datetime(2028, 2, 29, 9, 30, tzinfo=PARIS)
    # The boundary itself opens the new period; a microsecond before it is still the old one.
    boundary = datetime(2026, 2, 28, 9, 30, tzinfo=PARIS)
    assert month.start(boundary) == boundary
    assert month.start(boundary - timedelta(microseconds=1)) == datetime(2026, 1, 31, 9, 30, tzinfo=PARIS)
    assert month.next_start(boundary) == datetime(2026, 3, 31, 9, 30, tzinfo=PARIS)


def test_without_an_anchor_a_period_is_the_calendars_own_in_its_zone() -> None:
    at = datetime(2026, 12, 9, 23, 30, tzinfo=UTC)  # a Wednesday; already the 10th in Paris
    assert BillingPeriod(Unit.DAY).start(at) == datetime(2026, 12, 9, tzinfo=UTC)
    assert BillingPeriod(Unit.DAY, "Europe/Paris").start(at) == datetime(2026, 12, 10, tzinfo=PARIS)
    assert BillingPeriod(Unit.WEEK).start(at) == datetime(2026, 12, 7, tzinfo=UTC)  # Monday
    assert BillingPeriod(Unit.MONTH, "America/New_York").start(at) == datetime(2026, 12, 1, tzinfo=NEW_YORK)


def test_a_week_renews_on_its_anchors_weekday_and_time_in_the_zone() -> None:
    week = BillingPeriod(Unit.WEEK, "America/New_York", datetime(2026, 3, 4, 19, 0, tzinfo=UTC))  # Wed 14:00 EST
    start = week.start(datetime(2026, 12, 7, 12, tzinfo=UTC))
    assert start == datetime(2026, 12, 2, 14, 0, tzinfo=NEW_YORK)
    assert start.weekday() == 2


def test_a_day_lasts_23_or_25_hours_when_the_clocks_change() -> None:
    day = BillingPeriod(Unit.DAY, "Europe/Paris")
    spring = us(datetime(2026, 3, 29, 12, tzinfo=PARIS))
    autumn = us(datetime(2026, 10, 25, 12, tzinfo=PARIS))
    ordinary = us(datetime(2026, 6, 1, 12, tzinfo=PARIS))
    assert day.length_us(spring) == 23 * 3_600_000_000
    assert day.length_us(autumn) == 25 * 3_600_000_000
    assert day.length_us(ordinary) == DAY_US
    assert max(day.length_us(t) for t in (spring, autumn, ordinary)) <= LONGEST_US[Unit.DAY]


def test_an_anchor_at_a_wall_time_the_clocks_skip_renews_at_the_zones_reading_of_it() -> None:
    day = BillingPeriod(Unit.DAY, "Europe/Paris", datetime(2026, 1, 5, 2, 30, tzinfo=PARIS))
    # 02:30 does not exist on 29 March: the zone reads it as 03:30 summer time, an hour after 01:30 UTC.
    assert day.start(datetime(2026, 3, 29, 12, tzinfo=PARIS)) == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    assert day.start(datetime(2026, 3, 30, 12, tzinfo=PARIS)) == datetime(2026, 3, 30, 2, 30, tzinfo=PARIS)


def test_in_the_hour_the_clocks_repeat_the_period_is_the_one_whose_instants_hold_now() -> None:
    day = BillingPeriod(Unit.DAY, "Europe/Paris", datetime(2026, 1, 5, 2, 30, tzinfo=PARIS))
    # 25 October 2026: 02:00-03:00 happens twice. 01:10 UTC is the second 02:10, after the day's
    # renewal at the first 02:30 (00:30 UTC).
    # (Compared as instants: Python never calls a time in a repeated hour equal to another zone's.)
    moment = datetime(2026, 10, 25, 1, 10, tzinfo=UTC)
    assert us(day.start(moment)) == us(datetime(2026, 10, 25, 0, 30, tzinfo=UTC))
    assert us(day.next_start(moment)) == us(datetime(2026, 10, 26, 2, 30, tzinfo=PARIS))
    assert us(day.start(moment)) <= us(moment) < us(day.next_start(moment))


def test_the_bounds_put_the_nearest_boundary_in_the_middle() -> None:
    month = BillingPeriod(Unit.MONTH)
    early = us(datetime(2026, 12, 3, tzinfo=UTC))
    late = us(datetime(2026, 12, 29, tzinfo=UTC))
    starts = [us(datetime(2026, m, 1, tzinfo=UTC)) for m in (11, 12)] + [us(datetime(2027, 1, 1, tzinfo=UTC))]
    assert month.bounds(early) == tuple(starts)
    assert month.bounds(late) == (*starts[1:], us(datetime(2027, 2, 1, tzinfo=UTC)))
    # Asked again at other moments, each answer is the one made afresh (the kept one is reused only where it holds).
    for moment in range(early - DAY_US, late + 40 * DAY_US, 3 * DAY_US + 12_345):
        assert month.bounds(moment) == BillingPeriod(Unit.MONTH).bounds(moment)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10000/month", (10000, Unit.MONTH)),
        ("5/week", (5, Unit.WEEK)),
        ("7/mo", (7, Unit.MONTH)),
        ("9/d", (9, Unit.DAY)),
    ],
)
def test_calendar_quotas_parse(text: str, expected: tuple[int, Unit]) -> None:
    parsed = parse_calendar_quota(text)
    assert parsed is not None and (parsed[0], parsed[1].unit) == expected


def test_other_quotas_are_not_calendar_ones_and_bad_ones_are_refused() -> None:
    assert parse_calendar_quota("500/h") is None
    assert parse_calendar_quota("10000/7d") is None  # a fixed window of seven days, as before
    with pytest.raises(ConfigurationError, match=r"quota: '5/2month'.*renews every month"):
        parse_calendar_quota("5/2month")
    with pytest.raises(ConfigurationError, match="allows nothing"):
        parse_calendar_quota("0/month")
    with pytest.raises(ConfigurationError, match="not a time zone"):
        BillingPeriod(Unit.MONTH, "Mars/Olympus")
    with pytest.raises(ConfigurationError, match="aware datetime"):
        BillingPeriod(Unit.MONTH, anchor=datetime(2026, 1, 1))


# -- a tier's quota ------------------------------------------------------------------------------------


def tier(config: dict[str, Any]) -> tuple[Policy, ...]:
    return tier_policies("pro", {"rate": "10/s", **config}, field="TIERS['pro']", fail_mode=FailMode.OPEN)


def test_a_tier_says_its_quota_by_month_in_a_zone_hard_or_soft() -> None:
    _, monthly = tier({"quota": "50000/month", "quota_zone": "Europe/Paris", "quota_mode": "soft"})
    assert monthly.role is Role.QUOTA and monthly.rate.limit == 50000 and monthly.soft
    assert monthly.period == BillingPeriod(Unit.MONTH, "Europe/Paris")
    assert monthly.describe() == "50000 per calendar month (Europe/Paris), soft (overage counted)"
    # The plain UTC day, hard, stays the epoch-aligned window it always was (the same days, the same keys).
    _, daily = tier({"quota": "10000/d"})
    assert daily.period is None and daily.rate.period_us == DAY_US
    # ...until a customer's anchor moves its days.
    anchored = daily.anchored(datetime(2026, 5, 17, 8, tzinfo=UTC))
    assert anchored.period == BillingPeriod(Unit.DAY, "UTC", datetime(2026, 5, 17, 8, tzinfo=UTC))
    assert anchored.key_suffix != daily.key_suffix


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"quota": "500/h", "quota_zone": "Europe/Paris"},
            r"TIERS\['pro'\]\['quota'\]: '500/h': a quota in a time zone",
        ),
        ({"quota": "500/h", "quota_mode": "soft"}, r"TIERS\['pro'\]\['quota'\]: '500/h'.*soft one"),
        (
            {"quota": "5/month", "quota_mode": "maybe"},
            r"TIERS\['pro'\]\['quota_mode'\]: 'maybe' must be 'hard' or 'soft'",
        ),
        ({"quota": "5/month", "quota_zone": "Paris"}, r"TIERS\['pro'\]\['quota_zone'\]: 'Paris' is not a time zone"),
        ({"quota_zone": "Europe/Paris"}, r"TIERS\['pro'\]\['quota_zone'\]: there is no quota"),
    ],
)
def test_a_tiers_bad_quota_names_its_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        tier(config)


# -- the decision, on every backend --------------------------------------------------------------------


def test_a_storm_across_a_customers_boundary_admits_exactly_the_quota_on_each_side(
    backend: Any, clock: FakeClock
) -> None:
    anchor = datetime(2026, 5, 17, 10, 0, tzinfo=PARIS)
    policy = quota(5, BillingPeriod(Unit.MONTH, "Europe/Paris", anchor))
    check = Check(policy, ACME)
    boundary = us(datetime(2026, 12, 17, 10, 0, tzinfo=PARIS))
    clock.now = boundary - 3_000_000
    before = [backend.decide([check]) for _ in range(7)]
    assert [d.allowed for d in before] == [True] * 5 + [False] * 2
    assert before[-1].retry_after_us == 3_000_000  # the customer's boundary, not UTC midnight on the 1st
    assert before[0].results[0].reset_us == 3_000_000
    clock.now = boundary - 1
    assert not backend.decide([check]).allowed
    clock.now = boundary
    after = [backend.decide([check]) for _ in range(7)]
    assert [d.allowed for d in after] == [True] * 5 + [False] * 2
    # The new period runs to the next month's 17th, 10:00 in Paris.
    assert after[0].results[0].reset_us == us(datetime(2027, 1, 17, 10, 0, tzinfo=PARIS)) - boundary


def test_a_soft_quota_admits_past_its_limit_and_counts_the_overage(backend: Any, clock: FakeClock) -> None:
    policy = quota(3, BillingPeriod(Unit.DAY, "Europe/Paris"), soft=True)
    hard = Policy("tier:pro", Rate(100, 1_000_000), 100)
    clock.now = us(datetime(2026, 12, 7, 9, tzinfo=PARIS))
    decisions = [backend.decide([Check(hard, ACME), Check(policy, ACME)]) for _ in range(5)]
    assert all(d.allowed for d in decisions)
    assert [d.results[1].remaining for d in decisions] == [2, 1, 0, 0, 0]
    # The count went on past the limit: 5 in the period, the overage 2.
    assert stored_count(backend, Check(policy, ACME)) == 5


def stored_count(backend: Any, check: Check) -> float:
    """A window's count as the backend stored it."""
    key = check.key(backend.prefix)
    if isinstance(backend, MemoryBackend):
        return backend._state[key][0][1]
    return read_state(Algorithm.FIXED_WINDOW, backend.client.get(key))[1]


def test_a_denied_requests_quota_is_not_spent(backend: Any, clock: FakeClock) -> None:
    policy = quota(2, BillingPeriod(Unit.WEEK))
    tight = Policy("tier:pro", Rate(1, 1_000_000), 1)
    clock.now = us(datetime(2026, 12, 8, tzinfo=UTC))
    assert backend.decide([Check(tight, ACME), Check(policy, ACME)]).allowed
    assert not backend.decide([Check(tight, ACME), Check(policy, ACME)]).allowed  # the rate refuses it
    clock.advance(1_000_000)
    assert backend.decide([Check(tight, ACME), Check(policy, ACME)]).allowed
    clock.advance(1_000_000)
    assert not backend.decide([Check(policy, ACME)]).allowed  # two spent, not three


def test_raising_a_quota_mid_period_keeps_the_share_spent(backend: Any, clock: FakeClock) -> None:
    period = BillingPeriod(Unit.MONTH)
    clock.now = us(datetime(2026, 12, 7, tzinfo=UTC))
    for _ in range(4):
        assert backend.decide([Check(quota(4, period), ACME)]).allowed
    raised = Check(quota(8, period), ACME)
    assert [backend.decide([raised]).allowed for _ in range(5)] == [False] * 5  # 4 of 4 is 8 of 8


class _Skewed:
    """The ``time`` module as a worker whose clock runs ahead of the store's sees it."""

    def __init__(self, ahead_us: int) -> None:
        self.ahead_ns = ahead_us * 1000

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time_ns(self) -> int:
        return time.time_ns() + self.ahead_ns


def test_the_store_clock_picks_the_period_at_the_boundary(
    redis_server: RedisServer, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Redis TIME (the default), the store's clock decides which period a request is counted in,
    even from a worker whose own clock is 2 s ahead (were the worker's clock to pick, the requests of
    the boundary's last 2 s would be counted in the next period, and more than the quota admitted
    before the boundary)."""
    monkeypatch.setattr(redis_backend, "time", _Skewed(2_000_000))
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    # A day renewing a few seconds from now: the boundary falls during the storm.
    anchor = datetime.now(UTC) + timedelta(seconds=4)
    policy = quota(20, BillingPeriod(Unit.DAY, "UTC", anchor))
    boundary = us(anchor)
    sides = {False: 0, True: 0}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        decision = backend.decide([Check(policy, ACME)])
        after = decision.now_us >= boundary
        sides[after] += decision.allowed
        if after and not decision.allowed:
            break
        if not decision.allowed:
            time.sleep(0.001)  # pacing the wait for the boundary, not synchronising with it
    assert sides == {False: 20, True: 20}


@pytest.mark.parametrize("soft", [False, True])
def test_memory_and_redis_agree_on_random_traffic_across_periods(
    redis_server: RedisServer, redis_client: Any, soft: bool
) -> None:
    """The reference and the Lua script count billing periods alike, to the microsecond, across
    daylight-saving days and renewals: days renewing at 02:30 in Paris, from late March on."""
    rng = random.Random(f"periods-{soft}")
    memory_clock, redis_clock = FakeClock(), FakeClock()
    memory = MemoryBackend(clock=memory_clock)
    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=redis_clock)
    day = BillingPeriod(Unit.DAY, "Europe/Paris", datetime(2026, 1, 5, 2, 30, tzinfo=PARIS))
    week = BillingPeriod(Unit.WEEK, "Europe/Paris", datetime(2026, 1, 7, 9, 0, tzinfo=PARIS))
    policies = [quota(6, day, soft=soft), replace(quota(20, week, soft=soft), name="tier:pro:weekly")]
    memory_clock.now = redis_clock.now = us(datetime(2026, 3, 27, 12, tzinfo=PARIS))
    seen = set()
    for _ in range(400):
        step = rng.choice([0, 1_000, 600_000_000, 3_600_000_000, 5 * 3_600_000_000, 20 * 3_600_000_000])
        memory_clock.advance(step)
        redis_clock.advance(step)
        checks = [Check(p, rng.choice([ACME, BOB]), cost=rng.randint(1, 3)) for p in policies]
        consume = rng.random() > 0.1
        ours, theirs = memory.decide(checks, consume=consume), remote.decide(checks, consume=consume)
        assert ours.verdict == theirs.verdict and ours.retry_after_us == theirs.retry_after_us
        assert [(r.allowed, r.remaining, r.reset_us, r.retry_us) for r in ours.results] == [
            (r.allowed, r.remaining, r.reset_us, r.retry_us) for r in theirs.results
        ]
        seen.add(theirs.allowed)
    assert seen == ({True} if soft else {True, False})


def test_a_quota_by_month_rides_in_the_decisions_one_call(own_redis: RedisServer) -> None:
    """No extra round trip: a request with a rate and a monthly quota is one script call and nothing else."""
    backend = RedisBackend(make_client(own_redis.url, 2.0, 2.0))
    checks = [Check(Policy("tier:pro", Rate(100, 1_000_000), 100), ACME), Check(quota(1000, PARIS_MONTH), ACME)]
    backend.decide(checks)  # the script loaded, the connection made
    client = own_redis.client()
    client.config_resetstat()
    for _ in range(20):
        assert backend.decide(checks).allowed
    client.close()
    assert script_calls(own_redis) == 20  # one per decision, its MGET, TIME and SETs inside it


def test_a_cluster_request_refused_in_another_slot_gives_its_period_back(
    redis_cluster: Any, cluster_client: Any, clock: FakeClock
) -> None:
    """All or nothing across slot groups: the quota's group admits and counts, another refuses, and
    the refund takes the count back out of the billing period it went into."""
    backend = ClusterBackend(make_client(redis_cluster.url, 2.0, 2.0), clock=clock)  # type: ignore[arg-type]
    policy = quota(2, BillingPeriod(Unit.MONTH, "Europe/Paris"))
    tight = Policy("tier:tight", Rate(1, 60_000_000), 1)

    def slot(check: Check) -> int:
        return layout.key_slot(check.key(backend.prefix).encode())

    mine = slot(Check(policy, ACME))
    other = next(s for s in (Subject("api_key", f"other-{n}") for n in range(100)) if slot(Check(tight, s)) != mine)
    clock.now = us(datetime(2026, 12, 7, 9, tzinfo=PARIS))
    assert backend.decide([Check(tight, other)]).allowed  # the other slot's limit, spent
    for _ in range(3):
        refused = backend.decide([Check(policy, ACME), Check(tight, other)])
        assert not refused.allowed and refused.results[0].allowed  # the quota's group admitted it
    assert stored_count(backend, Check(policy, ACME)) == 0
    assert [backend.decide([Check(policy, ACME)]).allowed for _ in range(3)] == [True, True, False]


def test_a_leased_quota_gives_its_unused_tokens_back_to_the_period(own_redis: RedisServer) -> None:
    """The local path leases a hard monthly quota like a fixed window; what a lease leaves unused
    goes back into the billing period it was taken from, so the count is what was admitted."""
    limiter = limiter_on(own_redis, prefix="plans", local=LocalPathSettings(leases=True, lease_share=0.25))
    check = Check(quota(1000, BillingPeriod(Unit.MONTH, "Europe/Paris")), ACME)
    admitted = sum(limiter.decide([check]).allowed for _ in range(40))
    path = limiter.local_path
    assert path is not None and path.counts["leases"] > 0, path.counts  # leased, not all asked of the store
    deadline = time.monotonic() + 10
    while path._expiring and time.monotonic() < deadline:  # leases run out (0.5 s) and go back
        limiter.return_leases()
        time.sleep(0.01)  # polling the leases' expiry, a state no event announces
    assert not path._expiring
    assert path.counts["tokens_returned"] > 0, path.counts
    stored = read_state(Algorithm.FIXED_WINDOW, own_redis.client().get(check.key("plans")))
    assert (admitted, stored[1]) == (40, 40)


# -- what callers see ----------------------------------------------------------------------------------


def test_the_headers_give_the_quota_over_the_period_in_force(clock: FakeClock) -> None:
    backend = MemoryBackend(clock=clock)
    policy = quota(1000, BillingPeriod(Unit.MONTH, "Europe/Paris"))
    clock.now = us(datetime(2027, 2, 10, tzinfo=PARIS))
    february = rate_limit_headers(backend.decide([Check(policy, ACME)]))
    assert february["RateLimit-Policy"] == f'"tier:pro:quota";q=1000;w={28 * 86_400}'
    assert february["RateLimit"] == f'"tier:pro:quota";r=999;t={19 * 86_400}'
    clock.now = us(datetime(2027, 3, 10, tzinfo=PARIS))
    march = rate_limit_headers(backend.decide([Check(policy, ACME)]))
    assert march["RateLimit-Policy"] == f'"tier:pro:quota";q=1000;w={31 * 86_400 - 3600}'  # summer time on the 28th


# -- admin-managed: a tier's row and a customer's anchor -----------------------------------------------


@pytest.fixture
def metered(settings: Any) -> Tier:
    """A tier sold by the month in Paris, the database source in force."""
    row = Tier.objects.create(name="metered", rate="100/s", burst=100, quota="3/month", quota_zone="Europe/Paris")
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    engine.reset()
    return row


@pytest.mark.django_db
def test_a_customers_quota_renews_on_their_anchor_and_the_429_says_when(metered: Tier) -> None:
    key = ApiKeyFactory(raw="sk_metered_customer")
    anchor = timezone.now() - timedelta(days=20, hours=5)  # renews in about ten days, at its own hour
    SubjectAssignment.objects.create(
        subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=metered, quota_anchor=anchor
    )
    engine.reset()
    client = client_for("sk_metered_customer")
    assert [client.get("/v1/customers").status_code for _ in range(3)] == [200, 200, 200]
    renews = BillingPeriod(Unit.MONTH, "Europe/Paris", anchor).next_start(timezone.now())
    before = (renews - timezone.now()).total_seconds()
    refused = client.get("/v1/customers")
    after = (renews - timezone.now()).total_seconds()
    assert refused.status_code == 429
    assert refused.json()["violated-policies"] == ["tier:metered:quota"]
    assert math.floor(after) <= int(refused["Retry-After"]) <= math.ceil(before)
    # The status API names the quota's period and when it renews.
    resources = client.get("/v1/rate_limit", {"endpoint": "customers"}).json()["resources"]
    (quota_row,) = [r for r in resources if r["policy"] == "tier:metered:quota"]
    assert quota_row["remaining"] == 0
    assert (quota_row["period_unit"], quota_row["period_zone"], quota_row["soft"]) == ("month", "Europe/Paris", False)
    assert datetime.fromisoformat(quota_row["period_end"]) == renews
    assert quota_row["reset"] == math.ceil(renews.timestamp())
    start = BillingPeriod(Unit.MONTH, "Europe/Paris", anchor).start(timezone.now())
    assert quota_row["window_seconds"] == math.ceil((renews - start).total_seconds())


@pytest.mark.django_db
def test_an_anchor_on_a_tier_whose_quota_never_renews_is_refused(metered: Tier) -> None:
    hourly = Tier.objects.create(name="hourly", rate="10/s", quota="500/h")
    assignment = SubjectAssignment(
        subject_kind="api_key", subject_id="ApiKey:1", tier=hourly, quota_anchor=timezone.now(), revision=0
    )
    with pytest.raises(ValidationError) as caught:
        assignment.full_clean()
    assert "no quota per calendar day, week or month" in " ".join(caught.value.message_dict["quota_anchor"])
    assignment.tier = metered
    assignment.full_clean()  # a monthly quota renews on it


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"quota": "5/2month"}, "quota", "renews every month"),
        ({"quota": "500/h", "quota_zone": "Europe/Paris"}, "quota_zone", "per calendar day, week or month"),
        ({"quota": "500/h", "quota_mode": "soft"}, "quota_mode", "per calendar day, week or month"),
        ({"quota_zone": "Europe/Paris"}, "quota_zone", "no quota"),
        ({"quota": "5/month", "quota_zone": "Europe/Pariss"}, "quota_zone", "not a time zone"),
        ({"quota": "2000000000/month"}, "quota", "too large"),
    ],
)
def test_a_tier_rows_bad_quota_fails_its_field(fields: dict[str, str], field: str, message: str) -> None:
    row = Tier(name="bad", rate="10/s", **fields)
    with pytest.raises(ValidationError) as caught:
        row.full_clean()
    assert message in " ".join(caught.value.message_dict[field])


# -- usage against the quota, per billing period ------------------------------------------------------


def hour_row(subject: str, start: datetime, tokens: int) -> UsageRecord:
    start = start.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return UsageRecord.objects.create(
        granularity="hour",
        period_start=start,
        subject_kind="api_key",
        subject_id=subject,
        endpoint="charges",
        allowed=tokens,
        tokens=tokens,
    )


@pytest.mark.django_db
def test_the_customer_api_gives_usage_and_overage_per_billing_period_with_csv(metered: Tier) -> None:
    Tier.objects.filter(pk=metered.pk).update(quota="5/month", quota_mode="soft")
    key = ApiKeyFactory(raw="sk_metered_usage")
    subject = f"ApiKey:{key.pk}"
    anchor = (timezone.now() - timedelta(days=40)).replace(minute=0, second=0, microsecond=0)
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=subject, tier=metered, quota_anchor=anchor)
    month = BillingPeriod(Unit.MONTH, "Europe/Paris", anchor)
    current = month.start(timezone.now())
    previous = month.start(current - timedelta(microseconds=1))
    hour_row(subject, previous + timedelta(days=1), 7)  # two past the quota: admitted, soft
    hour_row(subject, previous - timedelta(hours=1), 50)  # the period before: not asked for
    hour_row(subject, current + timedelta(hours=1), 3)
    hour_row("ApiKey:someone-else", current + timedelta(hours=1), 40)
    engine.reset()
    client = client_for("sk_metered_usage")
    assert [client.get("/v1/customers").status_code for _ in range(2)] == [200, 200]  # over the quota: soft
    engine.get_limiter().flush_usage(now=True)  # the minute's counters in the store, under the caller's label
    write_pending()
    reply = client.get("/v1/usage/quota", {"periods": 2})
    assert reply.status_code == 200, reply.content
    (quota_entry,) = reply.json()["quotas"]
    assert (quota_entry["policy"], quota_entry["period_unit"], quota_entry["period_zone"], quota_entry["soft"]) == (
        "tier:metered:quota",
        "month",
        "Europe/Paris",
        True,
    )
    past, now = quota_entry["periods"]
    assert (datetime.fromisoformat(past["start"]), datetime.fromisoformat(past["end"])) == (previous, current)
    assert (past["quota"], past["used"], past["remaining"], past["overage"]) == (5, 7, 0, 2)
    # Beside the drained hour, counted live: the two requests just made, and this one (a request of
    # the caller's, which the quota counted as it decided it): 6 of 5, one over (a soft quota).
    assert datetime.fromisoformat(now["end"]) == month.next_start(timezone.now())
    assert (now["used"], now["remaining"], now["overage"], now["live"]) == (6, 0, 1, True)
    csv_reply = client.get("/v1/usage/quota", {"periods": 2, "format": "csv"})
    assert csv_reply.status_code == 200 and csv_reply["Content-Type"].startswith("text/csv")
    lines = csv_reply.content.decode().splitlines()
    assert lines[0] == "policy,subject,period_unit,period_zone,soft,start,end,quota,used,remaining,overage,live"
    assert lines[1].endswith(",5,7,0,2,False")
    assert len(lines) == 3


@pytest.mark.django_db
@pytest.mark.parametrize("periods", ["0", "13", "two", "\u0661"])
def test_a_bad_period_count_is_a_400_naming_it(metered: Tier, periods: str) -> None:
    ApiKeyFactory(raw="sk_metered_bad")
    reply = client_for("sk_metered_bad").get("/v1/usage/quota", {"periods": periods})
    assert reply.status_code == 400
    assert "periods" in reply.json()


# -- an override's own quota: a deal for one customer -------------------------------------------------


def override_for(key: Any, **fields: Any) -> Override:
    return Override.objects.create(
        subject_kind="api_key",
        subject_id=f"ApiKey:{key.pk}",
        reason="the annual deal",
        expires_at=timezone.now() + timedelta(days=365),
        **fields,
    )


@pytest.mark.django_db
def test_an_overrides_quota_replaces_the_tiers_from_the_customers_anchor(metered: Tier) -> None:
    key = ApiKeyFactory(raw="sk_metered_deal")
    anchor = timezone.now() - timedelta(days=20, hours=5)
    SubjectAssignment.objects.create(
        subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=metered, quota_anchor=anchor
    )
    deal = override_for(key, quota="5/month")
    engine.reset()
    client = client_for("sk_metered_deal")
    assert [client.get("/v1/customers").status_code for _ in range(6)] == [200] * 5 + [429]
    refused = client.get("/v1/customers")
    assert refused.json()["violated-policies"] == ["tier:metered:quota"]
    renews = BillingPeriod(Unit.MONTH, "Europe/Paris", anchor).next_start(timezone.now())
    assert abs(int(refused["Retry-After"]) - (renews - timezone.now()).total_seconds()) <= 2
    resources = client.get("/v1/rate_limit", {"endpoint": "customers"}).json()["resources"]
    (quota_row,) = [r for r in resources if r["policy"] == "tier:metered:quota"]
    assert (quota_row["limit"], quota_row["origin"], quota_row["period_zone"]) == (5, "override", "Europe/Paris")
    assert deal.describe() == "quota 5/month"


@pytest.mark.django_db
def test_an_overrides_quota_gives_one_to_a_customer_whose_tier_has_none(settings: Any) -> None:
    plain = Tier.objects.create(name="plain", rate="100/s", burst=100)
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    key = ApiKeyFactory(raw="sk_plain_deal")
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=plain)
    override_for(key, quota="2/week", quota_mode="hard")
    engine.reset()
    client = client_for("sk_plain_deal")
    assert [client.get("/v1/customers").status_code for _ in range(3)] == [200, 200, 429]
    resources = client.get("/v1/rate_limit", {"endpoint": "customers"}).json()["resources"]
    (quota_row,) = [r for r in resources if r["policy"] == "tier:plain:quota"]
    assert (quota_row["period_unit"], quota_row["remaining"]) == ("week", 0)


@pytest.mark.django_db
def test_an_overrides_hourly_quota_on_a_soft_zoned_tier_is_a_fixed_window(metered: Tier) -> None:
    """The tier's zone and soft mode belong to its calendar quota: an override's "500/h" takes neither."""
    Tier.objects.filter(pk=metered.pk).update(quota_mode="soft")
    key = ApiKeyFactory(raw="sk_metered_hourly")
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=metered)
    override_for(key, quota="2/h")
    engine.reset()
    client = client_for("sk_metered_hourly")
    assert [client.get("/v1/customers").status_code for _ in range(3)] == [200, 200, 429]
    resources = client.get("/v1/rate_limit", {"endpoint": "customers"}).json()["resources"]
    (quota_row,) = [r for r in resources if r["policy"] == "tier:metered:quota"]
    assert (quota_row["window_seconds"], quota_row["algorithm"], "period_unit" in quota_row) == (
        3600,
        "fixed_window",
        False,
    )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"quota": "5/month", "endpoint": "charges"}, "quota"),
        ({"rate": "5/s", "quota_mode": "soft"}, "quota_mode"),
        ({"quota": "5/2month"}, "quota"),
        ({"quota": "500/h", "quota_mode": "soft"}, "quota_mode"),
    ],
)
def test_an_overrides_bad_quota_fails_its_field(fields: dict[str, str], error: str) -> None:
    row = Override(
        subject_kind="api_key", subject_id="ApiKey:9", reason="a deal", expires_at=timezone.now() + timedelta(days=1)
    )
    for name, value in fields.items():
        setattr(row, name, value)
    with pytest.raises(ValidationError) as caught:
        row.full_clean()
    assert error in caught.value.message_dict


@pytest.mark.django_db
def test_the_admin_report_of_one_customer_has_its_billing_periods_with_csv(metered: Tier, admin_client: Any) -> None:
    Tier.objects.filter(pk=metered.pk).update(quota="5/month", quota_mode="soft")
    key = ApiKeyFactory(raw="sk_metered_report")
    subject = f"ApiKey:{key.pk}"
    anchor = (timezone.now() - timedelta(days=40)).replace(minute=0, second=0, microsecond=0)
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=subject, tier=metered, quota_anchor=anchor)
    month = BillingPeriod(Unit.MONTH, "Europe/Paris", anchor)
    current = month.start(timezone.now())
    previous = month.start(current - timedelta(microseconds=1))
    hour_row(subject, previous + timedelta(days=1), 7)
    hour_row(subject, current + timedelta(hours=1), 3)
    engine.reset()
    params = {
        "subject": f"api_key:{subject}",
        "granularity": "day",
        "from": (previous + timedelta(days=2)).astimezone(UTC).strftime("%Y-%m-%d %H:%M"),
        "to": (timezone.now() + timedelta(hours=1)).astimezone(UTC).strftime("%Y-%m-%d %H:%M"),
    }
    page = admin_client.get("/admin/ratelimits/fleetsettings/usage/", params)
    assert page.status_code == 200 and page.context["form"].is_valid(), page.context["form"].errors
    [table] = [s["table"] for s in page.context["sections"] if s["table"].name == "billing_periods"]
    found = [(r["period_start"], r["quota"], r["used"], r["overage"]) for r in table.rows]
    assert found == [(previous, 5, 7, 2), (current, 5, 3, 0)]  # the range starts inside the earlier period
    exported = admin_client.get(
        "/admin/ratelimits/fleetsettings/usage/", {**params, "format": "csv", "table": "billing_periods"}
    )
    header, *rows = csv.reader(io.StringIO(exported.content.decode()))
    assert header[:2] == ["Quota", "Period start"] and [row[4] for row in rows] == ["7", "3"]
    # Not one subject: the table says how to get it.
    everyone = admin_client.get(
        "/admin/ratelimits/fleetsettings/usage/", {k: v for k, v in params.items() if k != "subject"}
    )
    [empty] = [s["table"] for s in everyone.context["sections"] if s["table"].name == "billing_periods"]
    assert empty.rows == [] and "Filter the report by one" in empty.description
