"""The local fast path on a real Redis: the exact denial cache, its invalidation, refusal before
authentication, and token leases.

The exactness replay drives two limiters through the same random traffic on one fake clock (the
store in app-clock mode, the local path's deadlines on the same clock): one remembers denials,
the other asks the store every time. They must admit exactly the same requests.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.conf import LocalPathSettings
from ratelimits.engine.breaker import CircuitBreaker
from ratelimits.engine.limiter import Limiter, build_limiter
from ratelimits.engine.local import DENIAL, LEASE, LEASE_AFTER, RETURN_BATCH_S
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies.values import Check, Policy
from ratelimits.rates import parse_rate

from .factories import ApiKeyFactory
from .support.clock import FakeClock
from .support.redis_server import RedisServer, script_calls
from .support.settings import merged

US = 1_000_000
#: How long a test waits for a message on the invalidation channel to arrive (a bounded poll).
DELIVERY_S = 5.0


def wait_for(condition: Callable[[], bool], timeout: float = DELIVERY_S) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes (a bounded wait for a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return condition()


def limiter_on(
    server: RedisServer, *, prefix: str, local: LocalPathSettings | None, clock: FakeClock | None = None
) -> Limiter:
    """A limiter on ``server`` as ``_build`` makes one, with or without the local path."""
    backend = RedisBackend(make_client(server.url, 2.0, 2.0), prefix=prefix, clock=clock)
    breaker = CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=1.0)
    seconds = (lambda: clock() / US) if clock is not None else time.monotonic
    settings = local if local is not None else LocalPathSettings(denials=False, leases=False)
    limiter = build_limiter(backend, breaker, settings, usage_cap=100, clock=seconds)
    if local is not None:
        assert limiter.local_path is not None and limiter.local_path.trusted(), "subscribed before the first request"
    return limiter


def check(name: str, rate: str, burst: int, algorithm: Algorithm, subject: str, cost: int = 1) -> Check:
    return Check(Policy(name, parse_rate(rate), burst, algorithm), Subject(SubjectKind.API_KEY, subject), cost)


# -- the exactness replay ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_denial_cache_never_refuses_what_the_store_would_admit(
    redis_server: RedisServer, redis_client: redis.Redis, seed: int
) -> None:
    """Random traffic (several policies of every rate algorithm, costs 1-4, several checks a request)
    replayed against a limiter that remembers denials and one that asks the store every time."""
    clock = FakeClock()
    # The denial cache alone: a lease's tokens are the worker's, which the store then lacks (bounded
    # under-admission, another property: test_leases_* below).
    cached = limiter_on(redis_server, prefix="cached", local=LocalPathSettings(leases=False), clock=clock)
    central = limiter_on(redis_server, prefix="central", local=None, clock=clock)
    rng = random.Random(seed)
    policies = [
        ("bucket", "10/s", 5, Algorithm.TOKEN_BUCKET),
        ("slow-bucket", "3/s", 8, Algorithm.TOKEN_BUCKET),
        ("sliding", "12/s", 12, Algorithm.SLIDING_WINDOW),
        ("fixed", "8/500ms", 8, Algorithm.FIXED_WINDOW),
    ]
    subjects = ["alice", "bob"]
    same = alone = local_refusals = 0
    for step in range(3000):
        clock.advance(rng.choice([0, 0, 1, 500, 5_000, 20_000, 60_000, 150_000]))
        chosen = rng.sample(policies, rng.choice([1, 1, 2, 3]))
        cost = rng.choice([1, 1, 1, 2, 4])
        subject = rng.choice(subjects)
        checks = [check(*p, subject=subject, cost=min(cost, p[2])) for p in chosen]
        mine, truth = cached.decide(checks), central.decide(checks)
        assert mine.allowed == truth.allowed, (step, mine, truth)
        if mine.local == DENIAL:
            local_refusals += 1
            # It never advises a retry later than the store would (the longest wait it remembers).
            # (Within 2 us: deadlines are float seconds, here of a clock near 1.7e9 s.)
            assert mine.retry_after_us <= truth.retry_after_us + 2, (step, mine, truth)
            if len(checks) == 1:  # with one limit, the very wait the store gives
                alone += 1
                assert abs(mine.retry_after_us - truth.retry_after_us) <= 2, (step, mine, truth)
            same += abs(mine.retry_after_us - truth.retry_after_us) <= 2
    # The cache was really exercised. A request over two limits is advised the longest wait this
    # worker remembers: the store's, unless another limit it has not been refused by yet is spent too.
    assert local_refusals > 300 and alone > 100, (local_refusals, alone)
    assert cached.local_path is not None and cached.local_path.counts["denial_hits"] == local_refusals
    print(f"\nseed {seed}: {local_refusals} of 3000 refused from memory, none wrongly; {same} advised the store's wait")


def test_slots_and_cheaper_requests_are_never_refused_from_memory(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    clock = FakeClock()
    limiter = limiter_on(redis_server, prefix="slots", local=LocalPathSettings(), clock=clock)
    costly = check("p", "10/s", 10, Algorithm.TOKEN_BUCKET, "carol", cost=8)
    cheap = check("p", "10/s", 10, Algorithm.TOKEN_BUCKET, "carol", cost=1)
    assert limiter.decide([costly]).allowed
    denied = limiter.decide([costly])
    assert not denied.allowed and denied.local is None  # the store's denial...
    assert limiter.decide([costly]).local == DENIAL  # ...remembered for its cost
    assert limiter.decide([cheap]).allowed  # a cheaper request still fits: asked, and admitted
    slots = Check(Policy("c", parse_rate("1/s"), 1, Algorithm.CONCURRENCY), Subject(SubjectKind.API_KEY, "carol"))
    held = limiter.decide([slots])
    assert held.allowed
    for _ in range(3):
        refused = limiter.decide([slots])
        assert not refused.allowed and refused.local is None  # a slot frees early: always asked
    limiter.release(held)
    assert limiter.decide([slots]).allowed


def test_the_memory_is_bounded(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    clock = FakeClock()
    limiter = limiter_on(redis_server, prefix="bounded", local=LocalPathSettings(max_entries=100), clock=clock)
    path = limiter.local_path
    assert path is not None
    for i in range(1000):
        spent = check("b", "1/h", 1, Algorithm.TOKEN_BUCKET, f"s{i}")
        limiter.decide([spent])
        assert not limiter.decide([spent]).allowed
        assert len(path._denials) <= 100
    assert len(path._denials) >= 90  # evicted a tenth at a time, the oldest first


# -- invalidation ---------------------------------------------------------------------------------


def test_a_reset_or_a_new_version_anywhere_empties_every_process_memory(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Two limiters with backends of their own (two processes' worth) on one Redis."""
    worker = limiter_on(redis_server, prefix="shared", local=LocalPathSettings())
    admin = limiter_on(redis_server, prefix="shared", local=None)
    spent = check("r", "1/h", 1, Algorithm.TOKEN_BUCKET, "dave")
    assert worker.decide([spent]).allowed
    assert not worker.decide([spent]).allowed
    assert worker.decide([spent]).local == DENIAL
    admin.backend.clear([spent])  # an admin's reset, in another process
    path = worker.local_path
    assert path is not None
    assert wait_for(lambda: not path._denials), "the reset never reached the other process"
    assert worker.decide([spent]).allowed  # asked again, and the reset bucket admits it

    assert worker.decide([spent]).local is None
    assert worker.decide([spent]).local == DENIAL
    admin.backend.publish_version(7)  # a policy change, published by another process
    assert wait_for(lambda: not path._denials), "the new version never reached the other process"
    assert worker.decide([spent]).local is None  # asked the store: denied by it, and remembered again


def test_memory_is_not_trusted_while_the_channel_is_down_and_the_store_is_up(
    own_redis: RedisServer, settings: Any
) -> None:
    worker = limiter_on(own_redis, prefix="deaf", local=LocalPathSettings())
    spent = check("d", "1/h", 1, Algorithm.TOKEN_BUCKET, "erin")
    worker.decide([spent])
    assert not worker.decide([spent]).allowed
    assert worker.decide([spent]).local == DENIAL
    client = own_redis.client()
    client.client_kill_filter(_type="pubsub")  # the channel drops; decisions still reach the store
    path = worker.local_path
    assert path is not None
    subscription = path._subscription
    assert subscription is not None
    assert wait_for(lambda: not subscription.live)
    refused = worker.decide([spent])
    assert not refused.allowed and refused.local is None  # asked, since a message may have been missed
    assert wait_for(lambda: subscription.live, 10), "the channel was never subscribed again"
    client.close()


# -- through the DRF stack -----------------------------------------------------------------------


@pytest.fixture
def stack(settings: Any, use_redis: RedisServer) -> Iterator[RedisServer]:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"free": {"rate": "5/m"}, "anon": {"rate": "1000/s", "burst": 1000}},
            "POLICIES": {
                "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
                "TIER_FUNC": "project.payments.auth.tier_of",
            },
            "LOCAL_PATH": {"HEADER": True},
        },
    )
    settings.MIDDLEWARE = ["ratelimits.middleware.EarlyRejectionMiddleware", *settings.MIDDLEWARE]
    yield use_redis


def caller(raw: str) -> APIClient:
    client = APIClient(REMOTE_ADDR="198.51.100.40")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def same_refusal(store: Any, memory: Any) -> None:
    """A 429 from memory says what the store's did, with a wait counted down since."""
    assert (store.status_code, memory.status_code) == (429, 429)
    a, b = store.json(), memory.json()
    varies = ("retry_after_ms", "detail", "violations")  # the wait (in the detail too), counted down
    assert {k: v for k, v in a.items() if k not in varies} == {k: v for k, v in b.items() if k not in varies}
    assert [{**v, "retry_after_ms": 0} for v in a["violations"]] == [
        {**v, "retry_after_ms": 0} for v in b["violations"]
    ]
    assert 0 < b["retry_after_ms"] <= a["retry_after_ms"]
    assert abs(int(store["Retry-After"]) - int(memory["Retry-After"])) <= 1
    for name in ("RateLimit-Policy", "X-RateLimit-Limit", "X-RateLimit-Resource", "Content-Type"):
        assert store[name] == memory[name], name


@pytest.mark.django_db
def test_a_refusal_from_memory_is_the_stores_429_and_is_counted(stack: RedisServer) -> None:
    ApiKeyFactory(raw="sk_local_drf", tier="free")
    client = caller("sk_local_drf")
    replies = [client.get("/v1/customers") for _ in range(8)]
    assert [r.status_code for r in replies] == [200] * 5 + [429] * 3
    assert [r.get("X-RateLimit-Local") for r in replies] == [None] * 6 + ["denial"] * 2
    same_refusal(replies[5], replies[6])
    limiter = engine.get_limiter()
    assert limiter.local_path is not None and limiter.local_path.counts["denial_hits"] == 2
    # Usage: the refusals from memory are added to the store's counters, as throttled.
    limiter.flush_usage(now=True)
    usage = redis.Redis.from_url(stack.url)
    try:
        counters = {}
        for key in usage.scan_iter(match="rl:usage:*"):
            counters.update({k.decode(): int(v) for k, v in usage.hgetall(key).items()})
    finally:
        usage.close()
    throttled = sum(v for k, v in counters.items() if k.startswith('["api_key"') and k.endswith("]l"))
    assert throttled == 3, counters  # one refusal by the store, two from memory


@pytest.mark.django_db
def test_a_refused_credential_is_answered_before_authentication(stack: RedisServer) -> None:
    ApiKeyFactory(raw="sk_local_early", tier="free")
    client = caller("sk_local_early")
    replies = [client.get("/v1/customers") for _ in range(6)]
    assert [r.status_code for r in replies] == [200] * 5 + [429]
    with CaptureQueriesContext(connection) as queries:
        early = client.get("/v1/customers")
    assert early.status_code == 429 and early["X-RateLimit-Local"] == "denial"
    assert len(queries) == 0, [q["sql"] for q in queries]  # no API key looked up, no session read
    same_refusal(replies[-1], early)
    # Another endpoint the key was never refused on takes the normal path.
    with CaptureQueriesContext(connection) as queries:
        other = client.get("/v1/charges")
    assert other.status_code == 429 and len(queries) > 0  # authenticated, then refused by the tier
    # Unknown and invalid credentials are never refused early: the normal path gives their 401.
    assert caller("sk_nobody_knows").get("/v1/customers").status_code == 401
    assert caller("sk_local_early_revoked").get("/v1/customers").status_code == 401


@pytest.mark.django_db
def test_the_worker_shedder_sheds_before_authentication(settings: Any, stack: RedisServer) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"SHEDDING": {"WORKER_CAPACITY": 1, "THRESHOLDS": {"low": 1}}})
    settings.RATELIMITS["ENDPOINTS"] = {"ping": {"priority": "low"}}
    engine.reset()
    anonymous = APIClient(REMOTE_ADDR="198.51.100.41")
    assert anonymous.get("/t/ping").status_code == 200  # the path, limited once
    shedder = engine.get_worker_shedder()
    assert shedder is not None and shedder.admit(engine.get_policy_source().endpoint_rule("x", "GET").priority)
    try:
        with CaptureQueriesContext(connection) as queries:
            shed = caller("sk_unknown_but_shed").get("/t/ping")
        assert shed.status_code == 503 and shed.json()["status"] == 503
        assert int(shed["Retry-After"]) >= 1
        assert len(queries) == 0
    finally:
        shedder.finish()
    assert anonymous.get("/t/ping").status_code == 200
    # A path the engine never limited is never shed before authentication (an exempt view, the admin).
    assert shedder.admit(engine.get_policy_source().endpoint_rule("x", "GET").priority)
    try:
        assert caller("sk_unknown_but_shed").get("/admin/login/").status_code == 200
    finally:
        shedder.finish()


# -- leases ---------------------------------------------------------------------------------------


def test_leases_spend_tokens_taken_from_the_store_and_give_back_the_rest(own_redis: RedisServer) -> None:
    limiter = limiter_on(own_redis, prefix="lease", local=LocalPathSettings(leases=True, lease_share=0.25))
    hot = check("hot", "1000/s", 200, Algorithm.TOKEN_BUCKET, "frank")
    client = own_redis.client()
    client.config_resetstat()
    admitted = 0
    start = due = time.monotonic()
    decisions = []
    for _ in range(1200):  # 800 a second (80% of the rate) for 1.5 s: paced, not synchronised
        # A loop that fell behind (a loaded machine) does not catch up in a burst: the next send is
        # due one interval after this one, so the offered rate never goes over 800 a second.
        time.sleep(max(due - time.monotonic(), 0))
        due = max(due, time.monotonic()) + 1 / 800
        decision = limiter.decide([hot])
        decisions.append(decision)
        admitted += decision.allowed
        limiter.return_leases()
    elapsed = time.monotonic() - start
    calls = script_calls(own_redis)
    path = limiter.local_path
    assert path is not None
    leased = [d for d in decisions if d.local == LEASE]
    assert len(leased) > 0.8 * len(decisions), path.counts
    assert calls < 0.1 * len(decisions), (calls, path.counts)
    # Every leased token was taken from the store first: no more admitted than the bucket allows.
    assert admitted <= 200 + 1000 * elapsed + 1
    # What a lease's response says is left: the bucket's remaining when it was taken, plus the lease's.
    assert all(0 <= d.results[0].remaining <= 200 for d in leased)
    assert admitted == len(decisions)  # under its rate, nothing is refused
    # Stop with tokens in hand (a lease may have run out with the last request: one more takes one).
    while not any(lease.tokens for lease in path._expiring):
        assert limiter.decide([hot]).allowed
    # The leases run out (0.5 s) and what is unused goes back to the bucket.
    deadline = time.monotonic() + 3
    while path._expiring and time.monotonic() < deadline:
        limiter.return_leases()
        time.sleep(0.01)
    assert not path._expiring
    counts = dict(path.counts)
    assert counts["tokens_returned"] + counts.get("tokens_unreturned", 0) > 0, counts
    # Every token leased was spent by a request answered from a lease, given back, or dropped (a
    # re-subscription of the channel, under load, empties memory).
    spent_or_back = counts["lease_hits"] + counts["tokens_returned"]
    lost = counts.get("tokens_unreturned", 0) + counts.get("tokens_dropped", 0)
    assert counts["tokens_leased"] == spent_or_back + lost
    print(f"\nleases: {len(decisions)} decisions, {calls} script calls, {admitted} admitted; {counts}")
    client.close()


def test_a_request_a_lease_does_not_cover_whole_is_the_stores_and_leaves_the_lease_as_it_is(
    own_redis: RedisServer,
) -> None:
    """All or nothing, as the store decides: a request one check of which no lease covers goes to
    the store whole (the store spends the leased check too), and its lease is neither spent nor
    put back; a lease is taken for a request this worker makes often, not for each busy check."""
    clock = FakeClock()  # frozen: one lease-length throughout
    limiter = limiter_on(
        own_redis, prefix="partial", local=LocalPathSettings(leases=True, lease_share=0.5), clock=clock
    )
    hot = check("hot", "1000/s", 100, Algorithm.TOKEN_BUCKET, "gina")
    for _ in range(LEASE_AFTER):
        limiter.decide([hot])  # leased by the last of them
    path = limiter.local_path
    assert path is not None and path.counts["leases"] == 1
    lease = path._leases[hot.key("partial")]
    tokens = lease.tokens
    assert tokens == LEASE_AFTER  # as many requests as this worker made of it so far
    client = own_redis.client()
    stored = client.get(hot.key("partial"))
    window = check("w", "1/h", 1, Algorithm.FIXED_WINDOW, "gina")
    first = limiter.decide([hot, window])
    assert first.allowed and first.local is None  # the window asked the store, for both checks
    assert lease.tokens == tokens  # the lease was not spent: the store spent the bucket
    assert client.get(hot.key("partial")) != stored
    second = limiter.decide([hot, window])
    assert not second.allowed and second.local is None  # the window denies
    assert lease.tokens == tokens
    # A request of the hot check alone is still answered from its lease.
    assert limiter.decide([hot]).local == LEASE and lease.tokens == tokens - 1
    # Two requests of [hot, window] are not a request made often: nothing more was leased.
    assert path.counts["leases"] == 1
    client.close()


def test_a_request_made_often_is_leased_whole_each_check_for_as_many_requests(own_redis: RedisServer) -> None:
    """A lease follows the requests a worker makes of one resolution: none before the
    ``LEASE_AFTER``-th in a lease-length; then each check that many requests' worth (its cost
    each), so that they run out together, with one call; never a request with a check that cannot
    be leased (a sliding window's count weighs on the next window)."""
    clock = FakeClock()  # frozen: every request in one lease-length, no lease ends
    limiter = limiter_on(own_redis, prefix="often", local=LocalPathSettings(leases=True, lease_share=0.25), clock=clock)
    path = limiter.local_path
    assert path is not None
    tier = check("tier", "1000/s", 100, Algorithm.TOKEN_BUCKET, "ida")  # a lease pays for 25 requests at most
    org = check("org", "5000/s", 400, Algorithm.TOKEN_BUCKET, "ida-org", cost=2)  # ... for 50
    request = [tier, org]
    for _ in range(LEASE_AFTER - 1):
        assert limiter.decide(request).local is None
    assert path.counts["leases"] == 0  # a request made rarely is not worth a lease
    assert limiter.decide(request).local is None  # the LEASE_AFTER-th: decided by the store, and leased
    leases = [path._leases[c.key("often")] for c in request]
    assert [lease.tokens for lease in leases] == [LEASE_AFTER * 1, LEASE_AFTER * 2]
    for _ in range(LEASE_AFTER):
        assert limiter.decide(request).local == LEASE
    assert [lease.tokens for lease in leases] == [0, 0]  # run out together
    calls = script_calls(own_redis)
    seen = 2 * LEASE_AFTER
    assert limiter.decide(request).local is None  # one call for both, leasing more: as many as were made
    assert script_calls(own_redis) == calls + 1
    assert [path._leases[c.key("often")].tokens for c in request] == [seen + 1, 2 * (seen + 1)]
    # The least roomy check bounds every check's lease: the tier's quarter of 100 is 25 requests.
    sizes = set()
    for _ in range(100):
        clock.advance(2_000)  # 2 ms a request, half the tier's rate: its bucket never runs dry
        if limiter.decide(request).local is None:
            sizes.add(tuple(path._leases[c.key("often")].tokens for c in request))
    assert max(sizes) == (25, 50) and all(org == 2 * tier for tier, org in sizes), sizes

    sliding = check("s", "1000/s", 100, Algorithm.SLIDING_WINDOW, "ida")
    leased = path.counts["leases"]
    assert all(limiter.decide([tier, sliding]).local is None for _ in range(3 * LEASE_AFTER))
    assert path.counts["leases"] == leased  # never leased: the request could never be answered whole


def test_one_bucket_named_twice_in_a_request_spends_its_lease_once_for_both(own_redis: RedisServer) -> None:
    """Two checks of one state key (a tier and an endpoint rule naming the same policy on the
    caller) spend one lease: a request is answered from it only if it holds both costs."""
    clock = FakeClock()
    limiter = limiter_on(own_redis, prefix="twice", local=LocalPathSettings(leases=True, lease_share=0.25), clock=clock)
    path = limiter.local_path
    assert path is not None
    bucket = check("b", "1000/s", 100, Algorithm.TOKEN_BUCKET, "max")
    for _ in range(LEASE_AFTER):
        limiter.decide([bucket])
    lease = path._leases[bucket.key("twice")]
    assert lease.tokens == LEASE_AFTER
    twice = [bucket, check("b", "1000/s", 100, Algorithm.TOKEN_BUCKET, "max")]  # the same key, another object
    for _ in range(LEASE_AFTER // 2):
        assert limiter.decide(twice).local == LEASE
    assert lease.tokens == 0
    lease.tokens = 1  # one token left: not enough for both checks
    assert limiter.decide(twice).local is None  # the store's, whole
    assert lease.tokens == 1  # nothing taken from the lease, nothing over-spent


def test_leases_that_end_together_go_back_in_one_call(own_redis: RedisServer) -> None:
    """Unused tokens go back once the first lease to end has been over ``RETURN_BATCH_S``, with
    every lease that ended meanwhile: one call, not one per lease."""
    clock = FakeClock()
    limiter = limiter_on(own_redis, prefix="batch", local=LocalPathSettings(leases=True, lease_share=0.25), clock=clock)
    path = limiter.local_path
    assert path is not None
    warm = [check("w", "1000/s", 100, Algorithm.TOKEN_BUCKET, "lee")]
    for _ in range(LEASE_AFTER):  # one lease made and given back first: the refund script is loaded
        limiter.decide(warm)
    clock.advance(int((0.5 + RETURN_BATCH_S) * US))
    limiter.return_leases()
    assert path.counts["tokens_returned"] == LEASE_AFTER
    # Buckets that refill slowly (1 a second): what is given back shows in them.
    first = [check("a", "1/s", 100, Algorithm.TOKEN_BUCKET, "jo")]
    second = [check("b", "1/s", 100, Algorithm.TOKEN_BUCKET, "kim")]
    # And one the same requests spend at the same moments, asking the store every time.
    central = limiter_on(own_redis, prefix="batch", local=None, clock=clock)
    reference = [check("a", "1/s", 100, Algorithm.TOKEN_BUCKET, "reference")]
    for _ in range(LEASE_AFTER):
        limiter.decide(first)
        central.decide(reference)
    clock.advance(50_000)  # the second lease is taken 50 ms later: it ends 50 ms later
    for _ in range(LEASE_AFTER):
        limiter.decide(second)
    assert path.counts["leases"] == 3 and path.counts["tokens_leased"] == 3 * LEASE_AFTER
    client = own_redis.client()
    client.config_resetstat()
    clock.advance(int((0.5 - 0.05 + RETURN_BATCH_S / 2) * US))  # the first ended RETURN_BATCH_S / 2 ago
    limiter.return_leases()
    assert path.counts["tokens_returned"] == LEASE_AFTER and len(path._expiring) == 2
    clock.advance(int(RETURN_BATCH_S / 2 * US) + 1_000)  # ... RETURN_BATCH_S and 1 ms ago; the second 51 ms ago
    limiter.return_leases()
    assert path.counts["tokens_returned"] == 3 * LEASE_AFTER and not path._expiring
    assert script_calls(own_redis) == 1  # both in one call
    # Given back: the bucket holds what it would had the leased tokens never been taken (it is far
    # from refilled: without them back, it would hold LEASE_AFTER fewer).
    given_back = limiter.decide(first, consume=False).results[0]
    spent_alike = central.decide(reference, consume=False).results[0]
    assert given_back.remaining == spent_alike.remaining < 100 - 2
    # A worker that goes quiet gives back too: the listener's thread does, once a second.
    for _ in range(LEASE_AFTER):
        limiter.decide(second)
    held, returned = sum(lease.tokens for lease in path._expiring), path.counts["tokens_returned"]
    assert held > 0
    clock.advance(int((0.5 + RETURN_BATCH_S) * US) + 1_000)
    path.on_tick()  # what the listener's thread calls each second
    assert not path._expiring and path.counts["tokens_returned"] == returned + held
    client.close()


# -- faults ---------------------------------------------------------------------------------------


#: The store's timeout in the fault test (the calls that open the breaker wait it out).
STORE_TIMEOUT_S = 0.5


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_tokens_in_hand_and_denials_outlast_a_store_that_is_down(own_redis: RedisServer, fault: str) -> None:
    """Redis killed (or paused) while a lease and a denial are held: the lease's tokens are spent, the
    denial keeps refusing until its end, and neither waits on the store; the rest go by fail mode."""
    # A store timeout long enough that a decision which waited on the paused store cannot pass for one
    # that did not (below), and leases that outlive the calls which open the breaker meanwhile.
    backend = RedisBackend(make_client(own_redis.url, STORE_TIMEOUT_S, STORE_TIMEOUT_S), prefix="rl")
    breaker = CircuitBreaker(window=4, min_calls=2, failure_rate=0.5, cooldown=30.0)
    limiter = build_limiter(
        backend, breaker, LocalPathSettings(leases=True, lease_share=0.5, lease_ttl=5.0), usage_cap=100
    )
    path = limiter.local_path
    assert path is not None
    hot = check("hot", "100/s", 200, Algorithm.TOKEN_BUCKET, "hank")
    spent = check("spent", "1/h", 1, Algorithm.TOKEN_BUCKET, "hank")
    other = check("other", "100/s", 100, Algorithm.TOKEN_BUCKET, "ivy")
    for _ in range(12):  # leases grow with the rate seen: 2 tokens, then 5, then 12 or so
        assert limiter.decide([hot]).allowed
    assert limiter.decide([spent]).allowed and not limiter.decide([spent]).allowed
    held = path._leases[hot.key("rl")].tokens
    assert held >= 3, path.counts

    own_redis.kill() if fault == "kill" else own_redis.pause()
    try:
        for _ in range(2):  # what no lease covers meets the dead store: it opens the breaker...
            assert limiter.decide([other]).degraded
        assert limiter.breaker.state == "open"
        timed = []
        for _ in range(held):  # ...while the lease is spent, with no wait on the store
            started = time.perf_counter()
            decision = limiter.decide([hot])
            timed.append(time.perf_counter() - started)
            assert decision.allowed and decision.local == LEASE and not decision.degraded
        started = time.perf_counter()
        refused = limiter.decide([spent])
        timed.append(time.perf_counter() - started)
        assert not refused.allowed and refused.local == DENIAL  # the store would refuse it too
        after = limiter.decide([hot])  # the lease is spent: the policy's fail mode (open) decides
        assert after.allowed and after.degraded
        # None of them waited for the store: one that did takes at least its timeout (paused: nothing
        # answers), 0.5 s; these take tens of microseconds, and a loaded machine's scheduling delays
        # are milliseconds. Half the timeout keeps both sides far apart.
        assert max(timed) < STORE_TIMEOUT_S / 2, timed
    finally:
        if fault == "pause":
            own_redis.resume()
    limiter.return_leases()  # nothing to give back, and the breaker is open: no call is made
    print(f"\n{fault}: {held} leased tokens spent with the store down, slowest decision {max(timed) * 1e6:.0f} us")


def test_a_retry_at_the_advised_time_is_admitted_and_one_clearly_earlier_is_not(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Retry-After stays honest with the local path on: the wait is the time the bucket refills in,
    counted from the store's answer (so never short), whether the refusal came from it or from memory."""
    limiter = limiter_on(redis_server, prefix="honest", local=LocalPathSettings(leases=True))
    spent = check("honest", "20/s", 2, Algorithm.TOKEN_BUCKET, "judy")
    answered, early_checked = set(), 0
    for _ in range(6):
        while limiter.decide([spent]).allowed:  # spend the bucket (a lease may take part of it)
            pass
        refused = limiter.decide([spent])
        assert not refused.allowed
        answered.add(refused.local)
        at = time.monotonic()
        wait = refused.retry_after_us / US
        time.sleep(wait / 2)  # clearly earlier: the bucket cannot have refilled yet
        asked = time.monotonic()
        too_early = limiter.decide([spent])
        if asked < at + 0.8 * wait:  # unless this thread overslept (a loaded machine): then not asked early
            assert not too_early.allowed
            early_checked += 1
        elif too_early.allowed:
            continue  # overslept past the refill: that request took the token the next one would have
        time.sleep(max(at + wait - time.monotonic(), 0))  # the advised moment
        assert limiter.decide([spent]).allowed
    assert early_checked >= 3, early_checked
    assert DENIAL in answered  # the refusals were, at least once, answered from memory


def test_on_a_cluster_denials_are_remembered_and_forgotten_on_a_change(
    redis_cluster: Any, cluster_client: redis.RedisCluster
) -> None:
    """A Redis Cluster carries the channel too (a PUBLISH reaches every node)."""

    def worker() -> Limiter:
        backend = ClusterBackend(make_client(redis_cluster.url, 2.0, 2.0))  # type: ignore[arg-type]
        breaker = CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=1.0)
        return build_limiter(backend, breaker, LocalPathSettings(leases=True), usage_cap=100)

    one, other = worker(), worker()
    spent = check("c", "1/h", 1, Algorithm.TOKEN_BUCKET, "kim")
    assert one.decide([spent]).allowed and not one.decide([spent]).allowed
    assert one.decide([spent]).local == DENIAL
    other.backend.publish_version(3)
    path = one.local_path
    assert path is not None
    assert wait_for(lambda: not path._denials), "the change never reached the other process"
    assert one.decide([spent]).local is None
