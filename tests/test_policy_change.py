"""A policy change reads the stored state in the new terms, by the share already used.

The finding: Acme's override was ``1/m`` with a burst of 2, spent (``Retry-After: 60``). The
operator raised it to ``2/s`` with a burst of 5, and the next request was told to wait 109 s on
Redis (113 s on the memory backend): the arrival time the strict policy left was read under the
new emission interval. Now a state records the terms it was written in (a bucket's capacity, a
window's limit and period), and a changed policy keeps the share of it already used.

The properties, on the memory backend, a Redis server and a Redis Cluster alike, over random
policies, random traffic before the change and random changes:

- raising a limit: the next wait is no longer than before the change, and no longer than the new
  policy's wait for the share already spent;
- lowering one: what is admitted from the change on stays within the new burst and the new rate
  times the time since;
- the backends agree to the microsecond through any sequence of changes (and so, with no change,
  nothing moves: the replays in ``test_bounds`` and ``test_local_path`` still agree).
"""

from __future__ import annotations

import itertools
import math
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import Override, Tier
from ratelimits.policies import Check, Policy
from ratelimits.rates import Rate

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.clock import FakeClock
from .support.redis_cluster import Cluster
from .support.redis_server import RedisServer

SECOND = 1_000_000
START = 1_700_000_000_000_000
PERIODS = [SECOND, 10 * SECOND, 60 * SECOND, 3600 * SECOND]
#: Every example a subject of its own: the backends keep their state between examples.
_subjects = itertools.count()
EXAMPLES = hypothesis_settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def subject() -> Subject:
    return Subject(SubjectKind.API_KEY, f"ApiKey:{next(_subjects)}")


def example(clock: FakeClock) -> Subject:
    """A property's example: a subject of its own, and the clock where every example starts.

    The backends and the clock outlive examples; starting each at the same moment makes an example
    replay exactly (Hypothesis replays a failure to shrink it), whatever ran before it.
    """
    clock.now = START
    return subject()


@st.composite
def policies(draw: st.DrawFn, algorithm: Algorithm = Algorithm.TOKEN_BUCKET) -> Policy:
    limit = draw(st.integers(1, 40))
    burst = draw(st.integers(1, 40)) if algorithm is Algorithm.TOKEN_BUCKET else limit
    return Policy("p", Rate(limit, draw(st.sampled_from(PERIODS))), burst, algorithm)


#: Traffic before the change: (microseconds to wait, requests to try).
traffic = st.lists(st.tuples(st.integers(0, 90 * SECOND), st.integers(0, 8)), min_size=1, max_size=6)


def drive(backend: Any, clock: FakeClock, check: Check, steps: list[tuple[int, int]]) -> None:
    for wait, requests in steps:
        clock.advance(wait)
        for _ in range(requests):
            backend.decide([check])


def wait_for(backend: Any, check: Check) -> int:
    """How long ``check``'s next request would wait now (0: it would pass), consuming nothing."""
    return backend.decide([check], consume=False).results[0].retry_us


def rate_per_us(policy: Policy) -> float:
    return policy.rate.limit / policy.rate.period_us


def raised(old: Policy, new: Policy) -> bool:
    return rate_per_us(new) >= rate_per_us(old) and new.burst >= old.burst


# -- the finding ----------------------------------------------------------------------------------


def test_raising_a_spent_override_shortens_the_wait_to_the_new_rates(backend: Any, clock: FakeClock) -> None:
    """The finding's numbers: 1/m burst 2, spent; raised to 2/s burst 5, the next request waits
    what a spent 2/s bucket waits (0.5 s), not 109 s."""
    who = subject()
    strict = Check(Policy("override", Rate(1, 60 * SECOND), 2), who)
    assert [backend.decide([strict]).allowed for _ in range(3)] == [True, True, False]
    assert wait_for(backend, strict) == 60 * SECOND
    loose = Check(Policy("override", Rate(2, SECOND), 5), who)
    assert wait_for(backend, loose) == SECOND // 2  # the whole burst spent, in the new terms
    told = backend.decide([loose]).results[0]  # refused: the bucket in the new terms is kept
    assert not told.allowed and told.retry_us == SECOND // 2
    clock.advance(told.retry_us - 1)
    assert not backend.decide([loose]).allowed  # not a microsecond early: it drains at the new rate
    clock.advance(1)
    assert backend.decide([loose]).allowed


def test_lowering_a_limit_keeps_the_share_spent(backend: Any, clock: FakeClock) -> None:
    """Half of 10/s burst 10 spent; lowered to 2/s burst 4: half of the new burst is left, not all of it."""
    who = subject()
    wide = Check(Policy("p", Rate(10, SECOND), 10), who)
    assert all(backend.decide([wide]).allowed for _ in range(5))
    narrow = Check(Policy("p", Rate(2, SECOND), 4), who)
    assert [backend.decide([narrow]).allowed for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize("algorithm", [Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW])
def test_a_window_keeps_the_share_used_through_a_change(backend: Any, clock: FakeClock, algorithm: Algorithm) -> None:
    """3 of 10 used this minute; the limit raised to 100: 30 used; lowered to 5: 2 used (rounded up), 3 left."""
    who = subject()
    clock.advance(-clock.now % (60 * SECOND))  # the start of a minute: nothing slides out meanwhile
    ten = Check(Policy("p", Rate(10, 60 * SECOND), 10, algorithm), who)
    assert all(backend.decide([ten]).allowed for _ in range(3))
    hundred = Check(Policy("p", Rate(100, 60 * SECOND), 100, algorithm), who)
    assert backend.decide([hundred], consume=False).results[0].remaining == 69  # after this request's 1
    five = Check(Policy("p", Rate(5, 60 * SECOND), 5, algorithm), who)
    assert [backend.decide([five]).allowed for _ in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("algorithm", [Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW])
def test_a_longer_window_takes_the_count_not_the_share(backend: Any, clock: FakeClock, algorithm: Algorithm) -> None:
    """10 of 10 a minute used, 5m10s into the hour; raised to 1000 an hour: 10 of those used, not the
    whole hour's (which would lock the caller out for 54 minutes, where the old terms said 50 s)."""
    who = subject()
    clock.advance(-clock.now % (3600 * SECOND) + 310 * SECOND)
    minute = Check(Policy("p", Rate(10, 60 * SECOND), 10, algorithm), who)
    assert all(backend.decide([minute]).allowed for _ in range(10))
    assert 0 < wait_for(backend, minute) <= 60 * SECOND
    hour = Check(Policy("p", Rate(1000, 3600 * SECOND), 1000, algorithm), who)
    assert backend.decide([hour]).allowed
    assert backend.decide([hour], consume=False).results[0].remaining == 1000 - 10 - 1 - 1


# -- the properties -------------------------------------------------------------------------------


@EXAMPLES
@given(old=policies(), new=policies(), before=traffic, cost=st.integers(1, 3))
def test_raising_a_bucket_never_lengthens_the_wait(
    backend: Any, clock: FakeClock, old: Policy, new: Policy, before: list[tuple[int, int]], cost: int
) -> None:
    if not raised(old, new):
        old, new = new, old  # every pair is ordered one way or the other, unless they cross
    if not raised(old, new) or cost > old.burst:
        return
    who = example(clock)
    drive(backend, clock, Check(old, who), before)
    before_change = backend.decide([Check(old, who, cost)], consume=False).results[0]
    after = wait_for(backend, Check(new, who, cost))
    # Exact in real numbers. In doubles, an arrival time near 2026 has a resolution of 0.25 us,
    # which the conversion scales by the ratio of the capacities, and a wait is rounded up.
    capacity, new_capacity = old.burst * old.rate.interval_us, new.burst * new.rate.interval_us
    rounding = 1 + math.ceil(0.25 * max(new_capacity / capacity, 1))
    assert after <= before_change.retry_us + rounding
    # The new policy's wait for the share of the burst already spent (reset: until the bucket is full).
    spent = min(before_change.reset_us / capacity, 1)
    assert after <= max(math.ceil(spent * new_capacity + cost * new.rate.interval_us - new_capacity) + rounding, 0)


@EXAMPLES
@given(
    old=policies(),
    new=policies(),
    before=traffic,
    after=st.lists(st.tuples(st.integers(0, 5 * SECOND), st.integers(0, 50)), min_size=1, max_size=8),
)
def test_a_changed_bucket_admits_no_more_than_the_new_burst_and_rate(
    backend: Any,
    clock: FakeClock,
    old: Policy,
    new: Policy,
    before: list[tuple[int, int]],
    after: list[tuple[int, int]],
) -> None:
    """Whatever the change (lowered, raised, or crossing): from it on, the new terms bound what passes."""
    who = example(clock)
    drive(backend, clock, Check(old, who), before)
    check = Check(new, who)
    changed_at, admitted = clock.now, 0
    for wait, requests in after:
        clock.advance(wait)
        admitted += sum(backend.decide([check]).allowed for _ in range(requests))
        assert admitted <= new.burst + (clock.now - changed_at) * rate_per_us(new) + 1e-9


@EXAMPLES
@given(
    algorithm=st.sampled_from([Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW]),
    data=st.data(),
    before=traffic,
)
def test_raising_a_window_limit_never_refuses_what_the_old_terms_admitted(
    backend: Any, clock: FakeClock, algorithm: Algorithm, data: st.DataObject, before: list[tuple[int, int]]
) -> None:
    """The same window, a higher limit: a request the old terms would admit, the new ones admit."""
    old = data.draw(policies(algorithm))
    new = Policy("p", Rate(data.draw(st.integers(old.rate.limit, 80)), old.rate.period_us), 1, algorithm)
    who = example(clock)
    drive(backend, clock, Check(old, who), before)
    if wait_for(backend, Check(old, who)) == 0:
        assert wait_for(backend, Check(new, who)) == 0


@EXAMPLES
@given(
    algorithm=st.sampled_from([Algorithm.FIXED_WINDOW, Algorithm.SLIDING_WINDOW]),
    data=st.data(),
    before=traffic,
)
def test_a_changed_window_admits_no_more_than_the_new_limit_in_a_window(
    backend: Any, clock: FakeClock, algorithm: Algorithm, data: st.DataObject, before: list[tuple[int, int]]
) -> None:
    old, new = data.draw(policies(algorithm)), data.draw(policies(algorithm))
    who = example(clock)
    drive(backend, clock, Check(old, who), before)
    check, period = Check(new, who), new.rate.period_us
    window, admitted = clock.now // period, 0
    for _ in range(3 * new.rate.limit):  # a storm within the change's window, in the new terms
        admitted += backend.decide([check]).allowed
    assert clock.now // period == window and admitted <= new.rate.limit


@EXAMPLES
@given(
    algorithm=st.sampled_from([Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW]),
    data=st.data(),
    steps=st.lists(st.tuples(st.integers(0, 20 * SECOND), st.integers(0, 6), st.booleans()), min_size=2, max_size=12),
)
def test_the_script_and_the_memory_backend_agree_through_any_changes(
    redis_server: RedisServer,
    redis_cluster: Cluster,
    algorithm: Algorithm,
    data: st.DataObject,
    steps: list[tuple[int, int, bool]],
) -> None:
    """Random traffic under a policy that changes at random steps: every answer to the microsecond."""
    clock = FakeClock()
    backends = [
        MemoryBackend(clock=clock),
        RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock),
        ClusterBackend(make_client(redis_cluster.url, 2.0, 2.0), clock=clock),  # type: ignore[arg-type]
    ]
    who, policy = subject(), data.draw(policies(algorithm))
    for wait, requests, change in steps:
        clock.advance(wait)
        if change:
            policy = data.draw(policies(algorithm))
        check = Check(policy, who)
        for _ in range(requests):
            answers = [backend.decide([check]).results for backend in backends]
            assert answers[1] == answers[0] and answers[2] == answers[0]


# -- what was spent in the old terms is not given back in the new ones -----------------------------


def test_a_lease_taken_before_a_change_gives_nothing_back_after_it(redis_server: RedisServer) -> None:
    """Tokens taken under 1/m burst 10 are not refunded into the bucket 2/s burst 5 converted:
    given back in the new terms, a minute's worth of old spend would empty the new bucket's debt."""
    clock = FakeClock()
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock)
    who = subject()
    old = Check(Policy("p", Rate(1, 60 * SECOND), 10), who)
    decision, grants = backend.lease([old], [6])
    assert decision.allowed and grants[0].tokens == 6
    new = Check(Policy("p", Rate(2, SECOND), 5), who)
    assert backend.decide([new]).allowed  # the state is written in the new terms
    spent = backend.decide([new], consume=False).results[0].reset_us
    assert backend.give_back([(grants[0], 6)]) == 0
    assert backend.decide([new], consume=False).results[0].reset_us == spent  # nothing came back
    # In the same terms, a refund still gives back what time has not refilled.
    clock.advance(3 * SECOND)
    _, again = backend.lease([new], [1])
    assert again[0].tokens == 1 and backend.give_back([(again[0], 1)]) == 1


# -- the finding, through the whole stack -----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_findings_override_raised_by_an_operator_lets_the_caller_in_within_a_second(
    settings: Any, request: pytest.FixtureRequest, store: str
) -> None:
    """Acme's override ``1/m`` burst 2, spent, raised to ``2/s`` burst 5 with no Reset: the next
    429 names a wait of at most a second (it named 109 s on Redis, 113 s in memory)."""
    Tier.objects.create(name="metered", rate="100/s", burst=100)
    key = ApiKeyFactory(raw="sk_change_acme", tier="metered")
    override = Override.objects.create(
        subject_kind="api_key",
        subject_id=f"ApiKey:{key.pk}",
        rate="1/m",
        burst=2,
        reason="incident 7",
        expires_at=timezone.now() + timedelta(days=1),
    )
    config: dict[str, Any] = {"POLICIES": {"SOURCE": "database", "TIER_FUNC": "project.payments.auth.tier_of"}}
    if store == "redis":
        server: RedisServer = request.getfixturevalue("own_redis")
        config |= {"BACKEND": "redis", "REDIS": {"URL": server.url}}
    settings.RATELIMITS = config
    engine.reset()
    acme = client_for("sk_change_acme", "198.51.100.7")
    responses = [acme.get("/v1/customers") for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert 59 <= int(responses[2]["Retry-After"]) <= 60
    override.rate, override.burst = "2/s", 5
    override.save()
    refused = acme.get("/v1/customers")
    assert refused.status_code == 429 and int(refused["Retry-After"]) <= 1
    assert 0 < refused.json()["violations"][0]["retry_after_ms"] <= 500
