"""The preview's bounds hold the truth: recorded traffic replayed through the real algorithms, at the
instants it came, is refused no less than the fewest and no more than the most the bounds allow."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime

import pytest

from ratelimits.algorithms import fixed_window, token_bucket
from ratelimits.algorithms import period_window as period_window_algorithm
from ratelimits.periods import BillingPeriod, Unit, counted_period
from ratelimits.replay import Demand, Limit, period_window, refused_bounds

MINUTE = 60_000_000
START = 1_800_000_000_000_000 // MINUTE * MINUTE


def traffic(rng: random.Random, minutes: int, mean: float) -> list[int]:
    """Arrival instants (us): quiet minutes, busy ones, and bursts packed into a second."""
    instants = []
    for m in range(minutes):
        style = rng.random()
        count = 0 if style < 0.3 else int(rng.expovariate(1 / mean)) + 1
        base = START + m * MINUTE
        if style > 0.85:  # a burst: all inside one second, at either end of the minute or within
            at = rng.choice([0, MINUTE - 1_000_000, rng.randrange(MINUTE - 1_000_000)])
            instants += [base + at + rng.randrange(1_000_000) for _ in range(count)]
        else:
            instants += [base + rng.randrange(MINUTE) for _ in range(count)]
    return sorted(instants)


def replayed(instants: list[int], limit: str, rate: int, period_us: int, burst: int, cost: int) -> int:
    """How many of ``instants`` the real algorithm refuses (each request of ``cost``)."""
    state = None
    refused = 0
    for at in instants:
        if limit == "bucket":
            outcome = token_bucket(state, at, rate, period_us, burst, cost)
        else:
            outcome = fixed_window(state, at, rate, period_us, burst, cost)
        if outcome.allowed:
            state = outcome.new_state
        else:
            refused += 1
    return refused


def recorded(instants: list[int], cost: int, period_us: int = MINUTE) -> list[Demand]:
    """What the usage records keep of ``instants``: a count per period."""
    counts: dict[int, int] = {}
    for at in instants:
        start = at // period_us * period_us
        counts[start] = counts.get(start, 0) + 1
    return [Demand(start, period_us, n, float(cost)) for start, n in sorted(counts.items())]


@pytest.mark.parametrize("seed", range(40))
def test_a_token_buckets_refusals_lie_within_the_bounds(seed: int) -> None:
    rng = random.Random(seed)
    rate, period_us = rng.choice([(1, 1_000_000), (10, 1_000_000), (100, 60_000_000), (30, 60_000_000), (2, 1_000_000)])
    burst = rng.choice([rate, rate * 2, 5, 50])
    cost = rng.choice([1, 1, 2, 3])
    if cost > burst:
        cost = 1
    instants = traffic(rng, 240, rng.choice([20, 80, 200]))
    fewest, most = refused_bounds(recorded(instants, cost), Limit(rate, period_us, burst))
    truth = replayed(instants, "bucket", rate, period_us, burst, cost)
    assert fewest <= truth <= most, (fewest, truth, most)


@pytest.mark.parametrize("seed", range(20))
def test_hour_records_bound_it_too_only_wider(seed: int) -> None:
    rng = random.Random(1000 + seed)
    instants = traffic(rng, 300, 60)
    limit = Limit(20, 1_000_000, 40)
    by_minute = refused_bounds(recorded(instants, 1), limit)
    by_hour = refused_bounds(recorded(instants, 1, 60 * MINUTE), limit)
    truth = replayed(instants, "bucket", 20, 1_000_000, 40, 1)
    assert by_hour[0] <= by_minute[0] <= truth <= by_minute[1] <= by_hour[1]


@pytest.mark.parametrize("seed", range(20))
def test_a_window_the_records_align_with_is_replayed_exactly(seed: int) -> None:
    """A quota of so many an hour over minute records: each hour's count is known, so both bounds
    are the real refusals."""
    rng = random.Random(2000 + seed)
    instants = traffic(rng, 600, 40)
    hour = 60 * MINUTE
    limit = Limit(700, hour, 700, window_of=period_window(hour), window_us=hour)
    assert refused_bounds(recorded(instants, 1), limit) == (replayed(instants, "window", 700, hour, 700, 1),) * 2


@pytest.mark.parametrize("seed", range(20))
def test_a_window_shorter_than_the_records_is_bounded(seed: int) -> None:
    rng = random.Random(3000 + seed)
    instants = traffic(rng, 240, 80)
    limit = Limit(5, 1_000_000, 5, window_of=period_window(1_000_000), window_us=1_000_000)
    fewest, most = refused_bounds(recorded(instants, 1), limit)
    truth = replayed(instants, "window", 5, 1_000_000, 5, 1)
    assert fewest <= truth <= most


def test_traffic_well_within_the_limit_is_surely_never_refused() -> None:
    """Recorded since well before its first request (nothing came before to empty the bucket)."""
    rng = random.Random(7)
    instants = traffic(rng, 120, 5)
    assert refused_bounds(recorded(instants, 1), Limit(100, 1_000_000, 200), since_us=START - MINUTE) == (0, 0)


# -- the worst cases, built on purpose ----------------------------------------------------------------

S = 10**12  # an instant every window here starts at
SECOND = 1_000_000


def worst_and_best(periods: list[tuple[int, int, list[int]]], limit: Limit, kinds: str = "bucket") -> tuple[int, int]:
    """Every way of placing each period's requests (costs in order, or dearest first) at its start,
    at its end, or split between the two, after a bucket full or empty: the fewest and the most
    refusals the real algorithm meets."""
    placements = []
    for start, length, costs in periods:
        options = []
        for order in (costs, sorted(costs, reverse=True), sorted(costs)):
            options.append([(start, c) for c in order])
            options.append([(start + length - 1, c) for c in order])
            half = len(order) // 2
            options.append([(start, c) for c in order[:half]] + [(start + length - 1, c) for c in order[half:]])
        placements.append(options)
    seen = []
    for empty in (False, True):
        for choice in itertools.product(*placements):
            arrivals = sorted((at, n, cost) for n, option in enumerate(choice) for at, cost in option)
            state = None
            if empty and kinds == "bucket":
                state = (
                    float(periods[0][0] + limit.burst * limit.period_us / limit.limit),
                    limit.burst * limit.period_us / limit.limit,
                )
            refused = 0
            for at, _, cost in arrivals:
                if kinds == "bucket":
                    outcome = token_bucket(state, at, limit.limit, limit.period_us, limit.burst, cost)
                else:
                    outcome = fixed_window(state, at, limit.limit, limit.period_us, limit.burst, cost)
                if outcome.allowed:
                    state = outcome.new_state
                else:
                    refused += 1
            seen.append(refused)
    return min(seen), max(seen)


def demand_of(periods: list[tuple[int, int, list[int]]]) -> list[Demand]:
    return [Demand(start, length, len(costs), min(costs), max(costs)) for start, length, costs in periods]


CASES = {
    "a trailing period after an emptying one": (
        Limit(10, SECOND, 5),
        [(S, SECOND, [1] * 2), (S + SECOND, SECOND, [1]), (S + 2 * SECOND, SECOND, [1] * 5)],
    ),
    "a trailing period, a small burst": (
        Limit(5, SECOND, 2),
        [(S, SECOND, [1]), (S + SECOND, SECOND, [1]), (S + 2 * SECOND, SECOND, [1] * 5)],
    ),
    "a pair far apart, the first drained": (
        Limit(10, SECOND, 10),
        [(S, SECOND, [1] * 12), (S + 1000 * SECOND, SECOND, [1] * 5)],
    ),
    "one period after an empty bucket": (Limit(10, SECOND, 10), [(S, SECOND, [1] * 10)]),
    "costs that differ between periods": (Limit(5, SECOND, 10), [(S, SECOND, [5] * 3), (S + SECOND, SECOND, [1] * 10)]),
    "costs that differ inside a period": (Limit(1, 3600 * SECOND, 10), [(S, SECOND, [1] * 10 + [10])]),
    "three periods, a burst the size of a second's rate": (
        Limit(10, SECOND, 10),
        [(S + k * SECOND, SECOND, [1] * 10) for k in range(3)],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_bounds_hold_in_the_worst_cases_built_on_purpose(case: str) -> None:
    limit, periods = CASES[case]
    best, worst = worst_and_best(periods, limit)
    fewest, most = refused_bounds(demand_of(periods), limit)
    assert fewest <= best and worst <= most, (fewest, best, worst, most)


WINDOW_CASES = {
    "a 150 s window over minute records": (150, [(S + k * MINUTE, MINUTE, [1] * 10) for k in range(3)]),
    "a record straddling two windows": (150, [(S + 2 * MINUTE, MINUTE, [1] * 20)]),
    "a minute window, costs mixed": (60, [(S, MINUTE, [1, 1, 2, 2])]),
    "a 90 s window": (90, [(S + k * MINUTE, MINUTE, [1] * 6) for k in range(4)]),
}


@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_the_bounds_hold_for_windows_that_do_not_align_or_costs_that_differ(case: str) -> None:
    seconds, periods = WINDOW_CASES[case]
    window = seconds * SECOND
    limit = Limit(
        10 if seconds != 60 else 4,
        window,
        10 if seconds != 60 else 4,
        window_of=period_window(window),
        window_us=window,
    )
    best, worst = worst_and_best(periods, limit, "window")
    fewest, most = refused_bounds(demand_of(periods), limit)
    assert fewest <= best and worst <= most, (fewest, best, worst, most)


def test_a_day_quota_in_a_half_hour_zone_over_hour_records_is_bounded() -> None:
    """Asia/Kolkata's days start at :30 past an hour: hour records straddle them, and the range
    still holds what the real quota refuses (and its fewest is no more than its most)."""
    day = BillingPeriod(Unit.DAY, "Asia/Kolkata")
    base = int(datetime(2026, 12, 1, tzinfo=UTC).timestamp()) * SECOND
    hour = 3600 * SECOND
    limit = Limit(100, 25 * hour, 100, window_of=lambda at: counted_period(day.bounds(at), at)[0])
    demand = [Demand(base + k * hour, hour, 50, 1.0) for k in range(48)]
    state, refused = None, 0
    for period in demand:
        for i in range(period.requests):
            at = period.start_us + i
            outcome = period_window_algorithm(state, at, 100, 25 * hour, 1, day.bounds(at), False)
            if outcome.allowed:
                state = outcome.new_state
            else:
                refused += 1
    fewest, most = refused_bounds(demand, limit)
    assert fewest <= refused <= most
