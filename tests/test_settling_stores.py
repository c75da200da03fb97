"""Settling a spend after the response, in every store: given back no more than the state still
holds, charged whether or not the limit has room (a debt the next requests wait for), in the
terms and window it was spent in; memory, Redis and Redis Cluster alike, to the microsecond."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest

from ratelimits.algorithms import Algorithm
from ratelimits.backends.codec import read_state
from ratelimits.backends.memory import MemoryBackend
from ratelimits.choices import FailMode
from ratelimits.counters import usage_for
from ratelimits.decisions import Decision
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy
from ratelimits.policies.values import concurrency_policy
from ratelimits.rates import parse_rate

from .support.clock import FakeClock

ALICE = Subject("api_key", "alice")
WINDOWS = [Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW]


def check(rate: str, algorithm: Algorithm = Algorithm.TOKEN_BUCKET, *, cost: int = 1, name: str = "p") -> Check:
    parsed = parse_rate(rate)
    return Check(Policy(name, parsed, parsed.limit, algorithm), ALICE, cost)


def admit(backend: Any, checks: list[Check], **kwargs: Any) -> Decision:
    decision = backend.decide_to_settle(checks, **kwargs)
    assert decision.allowed
    return decision


def admitted_in_a_row(backend: Any, checks: list[Check], most: int = 100) -> int:
    for n in range(most):
        if not backend.decide(checks).allowed:
            return n
    return most


@pytest.mark.parametrize("algorithm", [Algorithm.TOKEN_BUCKET, *WINDOWS])
def test_an_admission_given_back_is_as_if_never_made(backend: Any, algorithm: Algorithm) -> None:
    c = check("5/s", algorithm)
    spends = [admit(backend, [c]).spent for _ in range(5)]
    assert [len(spent) for spent in spends] == [1] * 5
    assert all(spent[0].tokens == 1 and spent[0].check is c for spent in spends)
    assert not backend.decide([c]).allowed
    assert sum(backend.settle([(spent[0], -1)]) for spent in spends) == 5
    assert admitted_in_a_row(backend, [c]) == 5


@pytest.mark.parametrize("algorithm", [Algorithm.TOKEN_BUCKET, *WINDOWS])
def test_a_charge_spends_what_the_limit_had_left(backend: Any, algorithm: Algorithm) -> None:
    c = check("10/m", algorithm)
    spent = admit(backend, [c]).spent
    assert backend.settle([(spent[0], 6)]) == 1
    assert admitted_in_a_row(backend, [c]) == 3  # 10 - 1 - 6


def test_a_charge_past_the_limit_is_a_debt_the_next_requests_wait_for(backend: Any, clock: FakeClock) -> None:
    """10/s: one request admitted, then trued up by 19 more: 20 spent, 10 beyond the burst. The
    next request waits for its own token and the debt: 1.1 s, to the microsecond, and not before."""
    c = check("10/s")
    spent = admit(backend, [c]).spent
    backend.settle([(spent[0], 19)])
    refused = backend.decide([c])
    assert not refused.allowed
    assert refused.retry_after_us == 1_100_000
    clock.advance(1_099_999)
    assert not backend.decide([c]).allowed
    clock.advance(1)
    assert backend.decide([c]).allowed


def test_what_time_refilled_is_not_given_back_again(backend: Any, clock: FakeClock) -> None:
    """A spend the bucket has refilled since is owed nothing: giving it back then creates no token."""
    c = check("10/s")
    spent = admit(backend, [c]).spent
    clock.advance(1_000_000)  # refilled: the bucket is full again
    assert backend.settle([(spent[0], -1)]) == 0
    assert admitted_in_a_row(backend, [c]) == 10


def test_half_refilled_is_half_given_back(backend: Any, clock: FakeClock) -> None:
    """A request of cost 4 on a 10/s bucket, given back 0.2 s later: time paid half of it, so
    half comes back. Giving it back twice gives nothing more."""
    c = check("10/s", cost=4)
    spent = admit(backend, [c]).spent
    for _ in range(6):
        assert backend.decide([check("10/s")]).allowed  # the bucket is empty
    clock.advance(200_000)  # 2 tokens refilled of the 10 spent: the request's 4 are the oldest
    assert backend.settle([(spent[0], -4)]) == 1
    assert backend.settle([(spent[0], -4)]) == 0
    assert admitted_in_a_row(backend, [check("10/s")]) == 4  # 2 refilled + 2 of the 4 given back


def test_a_charge_to_a_bucket_gone_idle_spends_from_a_full_one(backend: Any, clock: FakeClock) -> None:
    c = check("10/s")
    spent = admit(backend, [c]).spent
    clock.advance(60_000_000)  # the key has expired
    assert backend.settle([(spent[0], 4)]) == 1
    assert admitted_in_a_row(backend, [c]) == 6


@pytest.mark.parametrize("algorithm", WINDOWS)
def test_a_true_up_after_its_window_is_over_lands_in_the_window_now(
    backend: Any, clock: FakeClock, algorithm: Algorithm
) -> None:
    """The request's window no longer counts (a sliding window's, two periods on) when its response
    closes: its true-up is charged to the window now, or a slow response would skip its charge."""
    c = check("10/s", algorithm)
    clock.now = 1_800_000_000_000_000  # the start of a second
    spent = admit(backend, [c]).spent
    clock.advance(2_000_000)
    assert backend.decide([c]).allowed  # a new window's state
    assert backend.settle([(spent[0], 5)]) == 1
    assert admitted_in_a_row(backend, [c]) == 4


@pytest.mark.parametrize("algorithm", WINDOWS)
def test_a_true_up_in_a_window_nobody_wrote_makes_its_state(
    backend: Any, clock: FakeClock, algorithm: Algorithm
) -> None:
    c = check("10/m", algorithm)
    clock.now = 1_800_000_000_000_000 // 60_000_000 * 60_000_000
    spent = admit(backend, [c]).spent
    clock.advance(180_000_000)  # three windows on: the request's state has expired
    assert backend.settle([(spent[0], 7)]) == 1
    assert admitted_in_a_row(backend, [c]) == 3


def test_a_sliding_windows_previous_window_is_charged(backend: Any, clock: FakeClock) -> None:
    """Charged in the window it was made in, now the previous one: it weighs by what is left of it."""
    c = check("10/s", Algorithm.SLIDING_WINDOW)
    clock.now = 1_800_000_000_000_000
    spent = admit(backend, [c]).spent
    clock.advance(1_500_000)  # half into the next window
    assert backend.decide([c]).allowed  # the state rolls: the request's window is the previous one
    assert backend.settle([(spent[0], 9)]) == 1
    # The previous window holds 10, weighing 5 at half; the current 1: 4 left.
    assert admitted_in_a_row(backend, [c]) == 4


def test_a_state_in_other_terms_is_left_alone(backend: Any) -> None:
    """The policy changed since the spend (a new rate): its state is converted to the new terms by
    the next decision, and the old spend is neither given back nor charged in them."""
    old, new = check("10/s"), check("60/m")
    spent = admit(backend, [old]).spent
    assert backend.decide([new]).allowed  # converted, and spent in the new terms
    assert backend.settle([(spent[0], -1)]) == 0
    assert backend.settle([(spent[0], 5)]) == 0
    # A tenth of the old burst spent is a tenth of the new one (6), and the request: 53 left.
    assert admitted_in_a_row(backend, [new]) == 53


def test_slots_are_not_spends(backend: Any) -> None:
    """A concurrency slot is held and released, not spent: an admission records the rate checks only."""
    rate = check("10/s")
    slots = Check(concurrency_policy("in-flight", 2, fail_mode=FailMode.OPEN), ALICE, 1)
    decision = admit(backend, [rate, slots])
    assert [spent.check for spent in decision.spent] == [rate]
    assert decision.slot is not None
    backend.release(decision.slot, decision.slot_keys)


def test_a_denial_records_nothing(backend: Any) -> None:
    c = check("1/s")
    admit(backend, [c])
    refused = backend.decide_to_settle([c])
    assert not refused.allowed
    assert refused.spent == ()


def test_every_check_of_a_request_is_settled_in_one_go(backend: Any) -> None:
    """A caller's checks across policies (on a cluster, perhaps across slots): each gets its change."""
    a, b = check("10/s", name="a"), check("10/m", Algorithm.FIXED_WINDOW, name="b")
    decision = admit(backend, [a, b])
    assert [spent.check for spent in decision.spent] == [a, b]
    assert backend.settle([(spent, 4) for spent in decision.spent]) == 2
    assert admitted_in_a_row(backend, [a]) == 5
    assert admitted_in_a_row(backend, [b]) == 5


def test_the_usage_row_counts_what_the_request_cost_in_the_end(backend: Any, clock: FakeClock) -> None:
    """Counted at its estimate when admitted; the row's tokens follow the settlement, never below none."""
    c = check("100/s", cost=5)
    usage = usage_for(ALICE, None, "free", "export", 5)
    clock.now = usage.minute * 60_000_000 + 1_000_000
    first = admit(backend, [c], usage=usage).spent
    second = admit(backend, [c], usage=usage).spent
    backend.settle([(first[0], 7)], usage, 7)  # cost 12 in the end
    backend.settle([(second[0], -5)], usage, -5)  # not counted: 0
    counts = backend.peek_usage([usage.minute], 100).counts[usage.minute]
    assert counts[usage.field + "a"] == 2
    assert counts[usage.field + "a"] + counts[usage.field + "x"] == 12
    backend.settle([(second[0], -50)], usage, -50)  # more than the row holds: it stops at none
    counts = backend.peek_usage([usage.minute], 100).counts[usage.minute]
    assert counts[usage.field + "a"] + counts[usage.field + "x"] == 0


def test_memory_and_redis_store_the_same_settled_state(backend: Any, clock: FakeClock) -> None:
    """The Python rule (``algorithms.settled``) and ``lua/refund.lua`` write the same state."""
    c = check("10/s", cost=2)
    spent = admit(backend, [c]).spent  # arrival time now + 0.2 s
    clock.advance(50_000)
    backend.settle([(spent[0], -2)])  # 0.15 s still owed: given back, the bucket full again
    backend.settle([(admit(backend, [c]).spent[0], 3)])  # 0.2 s, then 0.3 s more
    assert _state(backend, c) == (clock.now + 500_000, 1_000_000)


def _state(backend: Any, c: Check) -> tuple[float, ...]:
    store = getattr(backend, "_state", None)
    if store is not None:
        return tuple(store[c.key(backend.prefix)][0])
    client = backend.client
    return tuple(read_state(c.policy.algorithm, client.get(c.key(backend.prefix))))


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_refunds_in_any_order_give_back_all_time_has_not_paid(backend: Any, clock: FakeClock, order: str) -> None:
    """8 a minute, 8 admitted, then given back in any order, with time passing between (which pays
    the queue from its front): each gives back exactly the part of its own spend time has not
    paid, so the bucket ends as if none of them had been made, not a token more or less."""
    c = check("8/m")
    spends = []
    for _ in range(8):
        spends.append(admit(backend, [c]).spent[0])
        clock.advance(100_000)
    assert not backend.decide([c]).allowed
    ordered = {"forward": spends, "reverse": spends[::-1], "shuffled": random.Random(7).sample(spends, 8)}[order]
    for spent in ordered[:5]:
        backend.settle([(spent, -1)])
        clock.advance(100_000)
    # As if those five had never been made: three spent, five back, and not a token more.
    assert admitted_in_a_row(backend, [c]) == 5


def test_the_stores_agree_on_any_mix_of_spends_refunds_and_charges(backend: Any, clock: FakeClock) -> None:
    """A random mix on one bucket and one window, made on this store and on the memory backend (the
    readable reference) side by side: every decision the same, to the microsecond, and the same
    state at the end, what was given back and where included; refunds come in any order, time
    passes between (the bucket full again, now and then), and the bucket's burst changes."""
    if isinstance(backend, MemoryBackend):
        pytest.skip("the reference itself")
    reference = MemoryBackend(clock=clock)
    rng = random.Random(42)
    buckets = [check("20/s", cost=2, name="bucket"), Check(Policy("bucket", parse_rate("20/s"), 14), ALICE, 2)]
    window = check("30/s", Algorithm.SLIDING_WINDOW, cost=2, name="window")
    open_spends: list[tuple[Any, Any]] = []
    with_holes = 0
    for step in range(500):
        checks = [buckets[(step // 150) % 2], window]  # the burst changes twice
        roll = rng.random()
        if roll < 0.45:
            ours, theirs = backend.decide_to_settle(checks), reference.decide_to_settle(checks)
            assert (ours.verdict, ours.retry_after_us, ours.results) == (
                theirs.verdict,
                theirs.retry_after_us,
                theirs.results,
            )
            assert ours.spent == theirs.spent
            if ours.allowed:
                open_spends.append((ours.spent, theirs.spent))
        elif roll < 0.8 and open_spends:
            mine, its = open_spends.pop(rng.randrange(len(open_spends)))
            change = rng.choice([-2, -1, 1, 3])
            assert backend.settle([(s, change) for s in mine]) == reference.settle([(s, change) for s in its])
        else:
            clock.advance(rng.choice([0, 20_000, 150_000, 1_500_000]))
        key = buckets[0].key(backend.prefix)
        value = backend.client.get(key)
        refunded, holes = reference._given_back.get(key, (0.0, ()))
        if value is not None and len(value) > 25:
            stored = [struct.unpack_from("<dd", value, 25 + 16 * n) for n in range((len(value) - 25) // 16)]
            assert struct.unpack_from("<d", value, 16)[0] == refunded, step
            assert stored == list(holes), step
            with_holes += bool(holes)
    assert with_holes > 20  # the holes were there to compare
    assert _state(backend, buckets[0]) == _state(reference, buckets[0])


def test_a_spend_held_long_is_given_back_whole_after_many_refunds_above_it(backend: Any) -> None:
    """One request in flight while 200 others are admitted and given back above it (their holes
    touch, and are kept as one): its own refund, last, still finds its whole spend unpaid."""
    c = check("10/m")
    held = admit(backend, [c]).spent[0]
    for _ in range(200):
        backend.settle([(admit(backend, [c]).spent[0], -1)])
    backend.settle([(held, -1)])
    assert admitted_in_a_row(backend, [c]) == 10


def test_more_holes_than_kept_give_back_less_never_more(backend: Any) -> None:
    """A limit of 200 a minute, spends given back and kept in turn: 100 holes apart, more than a
    bucket keeps (64). What comes back is less than was given back, never more."""
    c = check("200/m")
    kept, returned = [], []
    for n in range(200):
        spent = admit(backend, [c]).spent[0]
        (returned if n % 2 else kept).append(spent)
    for spent in reversed(returned):  # highest first: each a hole of its own, 100 in all
        backend.settle([(spent, -1)])
    # 100 were given back; a bucket that forgot 36 of its holes gives the refunds behind them
    # less: fewer than 100 come back, never more.
    back = admitted_in_a_row(backend, [c], 300)
    assert 60 <= back < 100


def test_the_usage_row_is_corrected_where_its_request_was_counted(backend: Any, clock: FakeClock) -> None:
    """On a cluster, a request is counted in the hash of its first check's slot: its usage follows
    there, though the check settled is another subject's, in another slot."""
    first, other = (
        check("100/s", name="mine"),
        Check(check("100/s", name="theirs").policy, Subject("ip", "198.51.100.9"), 1),
    )
    usage = usage_for(ALICE, None, "free", "export", 1)
    clock.now = usage.minute * 60_000_000 + 1_000_000
    spent = admit(backend, [first, other], usage=usage).spent
    assert [s.check for s in spent] == [first, other]
    backend.settle([(spent[1], 4)], usage, 4, counted_by=first)
    counts: dict[str, int] = {}
    for minute_counts in backend.peek_usage([usage.minute], 100).counts.values():
        for name, n in minute_counts.items():
            counts[name] = counts.get(name, 0) + n
    assert counts[usage.field + "a"] + counts[usage.field + "x"] == 5
