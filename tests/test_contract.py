"""One contract, every backend: memory, Redis and Redis Cluster must decide identically, on the sync
path and on the async one (``adecide``, ``redis.asyncio`` on one Redis); and so must the backend
docs/backends.md shows, which implements the core contract only (``custom``)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from ratelimits.algorithms import RATE_ALGORITHMS, Algorithm
from ratelimits.backends import CAPABILITIES, Backend
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.choices import FailMode
from ratelimits.decisions import Decision, Verdict
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy
from ratelimits.policies.values import concurrency_policy
from ratelimits.rates import parse_rate

from .support.aio import AsyncDriven, event_loop_thread
from .support.clock import FakeClock
from .support.documented_backend import DictBackend
from .support.redis_cluster import Cluster
from .support.redis_server import RedisServer

ALICE = Subject("api_key", "alice")
BOB = Subject("api_key", "bob")


def policy(
    rate: str, burst: int | None = None, algorithm: Algorithm = Algorithm.TOKEN_BUCKET, name: str = "p"
) -> Policy:
    parsed = parse_rate(rate)
    return Policy(name, parsed, burst or parsed.limit, algorithm)


ALGORITHMS = list(RATE_ALGORITHMS)


def test_the_documented_backend_implements_the_core_only() -> None:
    """What the custom variant stands for: a Backend with none of the capabilities."""
    assert issubclass(DictBackend, Backend)
    assert [capability for capability in CAPABILITIES if issubclass(DictBackend, capability)] == []


@pytest.fixture(
    params=["memory", "redis", "cluster", "custom", "memory-async", "redis-async", "cluster-async", "custom-async"]
)
def backend(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[Any]:
    """Each backend (the suite's fixture of that name), its decisions made sync or awaited on one event loop."""
    store, _, mode = request.param.partition("-")
    if store == "memory":
        sync: Any = MemoryBackend(clock=clock)
    elif store == "custom":
        sync = DictBackend(clock=clock)
    elif store == "cluster":
        cluster: Cluster = request.getfixturevalue("redis_cluster")
        request.getfixturevalue("cluster_client")  # flushed
        sync = ClusterBackend(make_client(cluster.url, 2.0, 2.0), clock=clock)  # type: ignore[arg-type]
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        request.getfixturevalue("redis_client")  # flushed
        sync = RedisBackend(make_client(server.url, 2.0, 2.0), clock=clock)
    if not mode:
        yield sync
        return
    with event_loop_thread() as loop:
        yield AsyncDriven(sync, loop)


def assert_same_decision(ours: Decision, theirs: Decision) -> None:
    """The same verdict and wait, and per check the same result, to the microsecond."""
    assert ours.verdict == theirs.verdict
    assert ours.retry_after_us == theirs.retry_after_us
    assert [(r.allowed, r.remaining, r.reset_us, r.retry_us) for r in ours.results] == [
        (r.allowed, r.remaining, r.reset_us, r.retry_us) for r in theirs.results
    ]


def test_bucket_admits_burst_then_denies_with_exact_wait(backend: Any) -> None:
    check = Check(policy("10/s"), ALICE)
    decisions = [backend.decide([check]) for _ in range(11)]
    assert [d.allowed for d in decisions] == [True] * 10 + [False]
    assert [d.results[0].remaining for d in decisions[:10]] == list(range(9, -1, -1))
    denied = decisions[-1]
    assert denied.verdict is Verdict.LIMITED
    assert denied.retry_after_us == 100_000
    assert denied.violated[0].policy_name == "p"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_retry_at_returned_time_is_admitted_and_earlier_is_not(
    backend: Any, clock: FakeClock, algorithm: Algorithm
) -> None:
    check = Check(policy("5/s", algorithm=algorithm), ALICE)
    clock.advance(123_457)  # somewhere inside a window
    while backend.decide([check]).allowed:
        clock.advance(1_000)
    denied = backend.decide([check])
    assert not denied.allowed and denied.retry_after_us > 0
    start = clock.now
    clock.now = start + denied.retry_after_ms * 1000 - 1_000  # a millisecond early
    assert not backend.decide([check]).allowed
    clock.now = start + denied.retry_after_ms * 1000  # the time the 429 named
    assert backend.decide([check]).allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exact_microsecond_wait(backend: Any, clock: FakeClock, algorithm: Algorithm) -> None:
    check = Check(policy("3/s", algorithm=algorithm), ALICE)
    clock.advance(777_777)
    for _ in range(3):
        assert backend.decide([check]).allowed
    denied = backend.decide([check])
    wait = denied.retry_after_us
    start = clock.now
    clock.now = start + wait - 1
    assert not backend.decide([check]).allowed
    clock.now = start + wait
    assert backend.decide([check]).allowed


def test_all_or_nothing_denied_request_consumes_nothing(backend: Any) -> None:
    roomy = Check(policy("100/s", name="roomy"), ALICE)
    tight = Check(policy("1/s", name="tight"), ALICE)
    assert backend.decide([roomy, tight]).allowed
    before = backend.decide([roomy], consume=False).results[0].remaining
    for _ in range(5):
        denied = backend.decide([roomy, tight])
        assert not denied.allowed
        assert [r.policy_name for r in denied.violated] == ["tight"]
    after = backend.decide([roomy], consume=False).results[0].remaining
    assert after == before


def test_strictest_wins_and_retry_is_the_longest_wait(backend: Any) -> None:
    fast = Check(policy("10/s", burst=1, name="fast"), ALICE)
    slow = Check(policy("1/m", name="slow"), ALICE)
    assert backend.decide([fast, slow]).allowed
    denied = backend.decide([fast, slow])
    assert {r.policy_name for r in denied.violated} == {"fast", "slow"}
    assert denied.retry_after_us == 60_000_000
    assert denied.closest is not None and denied.closest.policy_name == "slow"


def test_cost_weights(backend: Any) -> None:
    check = Check(policy("20/s"), ALICE, cost=10)
    assert [backend.decide([check]).allowed for _ in range(3)] == [True, True, False]


def test_cost_above_capacity_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="exceeds its capacity"):
        Check(policy("5/s"), ALICE, cost=6)


def test_subjects_are_independent(backend: Any) -> None:
    limit = policy("2/s")
    for _ in range(2):
        assert backend.decide([Check(limit, ALICE)]).allowed
    assert not backend.decide([Check(limit, ALICE)]).allowed
    assert backend.decide([Check(limit, BOB)]).allowed


def test_peek_does_not_consume(backend: Any) -> None:
    check = Check(policy("2/s"), ALICE)
    for _ in range(10):
        peek = backend.decide([check], consume=False)
        assert peek.allowed and peek.results[0].remaining == 1
    assert backend.decide([check]).allowed


def test_same_key_twice_in_one_request_cannot_double_spend(backend: Any) -> None:
    check = Check(policy("3/s"), ALICE, cost=2)
    denied = backend.decide([check, check])
    assert not denied.allowed
    assert backend.decide([check]).allowed


def test_bucket_refills_smoothly(backend: Any, clock: FakeClock) -> None:
    check = Check(policy("10/s"), ALICE)
    for _ in range(10):
        backend.decide([check])
    clock.advance(250_000)  # 2.5 tokens back
    assert [backend.decide([check]).allowed for _ in range(3)] == [True, True, False]


def test_sliding_window_weights_previous_window(backend: Any, clock: FakeClock) -> None:
    check = Check(policy("10/s", algorithm=Algorithm.SLIDING_WINDOW), ALICE)
    clock.now = 1_700_000_000_000_000 + 500_000  # mid-window
    for _ in range(10):
        assert backend.decide([check]).allowed
    clock.now = 1_700_000_001_000_000 + 250_000  # 25% into the next window: 7.5 of 10 still count
    assert [backend.decide([check]).allowed for _ in range(3)] == [True, True, False]


def test_fixed_window_resets_at_boundary(backend: Any, clock: FakeClock) -> None:
    check = Check(policy("2/s", algorithm=Algorithm.FIXED_WINDOW), ALICE)
    clock.now = 1_700_000_000_999_000
    assert [backend.decide([check]).allowed for _ in range(3)] == [True, True, False]
    assert backend.decide([check]).retry_after_us == 1_000
    clock.now = 1_700_000_001_000_000
    assert backend.decide([check]).allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_changed_policy_reads_its_state_in_the_new_terms(
    backend: Any, clock: FakeClock, algorithm: Algorithm
) -> None:
    """A limit lowered under a caller who spent it: each store reads the old state in the new terms,
    keeps that reading through a denial (the first request after the change is denied), and names
    the same wait as the reference (memory)."""
    reference = MemoryBackend(clock=clock)
    before, after = policy("10/s", algorithm=algorithm), policy("1/s", burst=5, algorithm=algorithm)
    for store in (backend, reference):
        assert all(store.decide([Check(before, ALICE)]).allowed for _ in range(10))
    seen = []
    for step_us in (10_000, 190_000, 600_000, 400_000, 1_000_000, 3_000_000):
        clock.advance(step_us)
        ours, theirs = backend.decide([Check(after, ALICE)]), reference.decide([Check(after, ALICE)])
        assert_same_decision(ours, theirs)
        seen.append(theirs.allowed)
    assert False in seen and True in seen  # the change denied some, and let the caller back in


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_memory_and_redis_agree_on_random_traffic(redis_server: Any, redis_client: Any, algorithm: Algorithm) -> None:
    """The reference and the Lua script decide the same thing, to the microsecond."""
    rng = random.Random(f"contract-{algorithm.value}")
    memory_clock, redis_clock = FakeClock(), FakeClock()
    memory = MemoryBackend(clock=memory_clock)
    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=redis_clock)
    policies = [policy("7/s", burst=12, algorithm=algorithm, name="a"), policy("50/13s", algorithm=algorithm, name="b")]
    for _ in range(400):
        step = rng.choice([0, 0, 1_000, 37_000, 140_001, 900_000])
        memory_clock.advance(step)
        redis_clock.advance(step)
        subject = rng.choice([ALICE, BOB])
        checks = [Check(p, subject, cost=rng.randint(1, 3)) for p in policies]
        consume = rng.random() > 0.1
        ours, theirs = memory.decide(checks, consume=consume), remote.decide(checks, consume=consume)
        assert_same_decision(ours, theirs)


def test_every_redis_key_has_a_ttl_and_no_raw_identity(redis_server: Any, redis_client: Any) -> None:
    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    subject = Subject("ip", "203.0.113.9")
    for algorithm in ALGORITHMS:
        remote.decide([Check(policy("5/10m", algorithm=algorithm, name=f"p-{algorithm.value}"), subject)])
    keys = redis_client.keys("*")
    assert len(keys) == 3
    for key in keys:
        assert redis_client.pttl(key) > 0
        assert b"203.0.113.9" not in key
        assert key.count(b"{") == 1 and key.count(b"}") == 1


def test_redis_clock_mode_uses_server_time(redis_server: Any, redis_client: Any) -> None:
    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    decision = remote.decide([Check(policy("1/s"), ALICE)])
    seconds, micros = redis_client.time()
    assert abs(seconds * 1_000_000 + micros - decision.now_us) < 5_000_000


def test_script_cache_loss_is_transparent(redis_server: Any, redis_client: Any) -> None:
    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    check = Check(policy("3/s"), ALICE)
    assert remote.decide([check]).allowed
    redis_client.script_flush()
    assert remote.decide([check]).results[0].remaining == 1
    assert remote.decide([check]).allowed
    assert not remote.decide([check]).allowed


def _decide_in_child(backend: RedisBackend, check: Check, out: Any) -> None:
    out.put([backend.decide([check]).results[0].remaining for _ in range(3)])


# The suite's idle daemon threads (metrics flushers, store threads) are about when it forks, as they
# may be in a preloading server's master; the child uses only the backend, whose fork it tests.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_redis_connection_is_not_shared_across_fork(redis_server: Any, redis_client: Any) -> None:
    """A child forked after the parent decided gets its own connection: no crossed replies."""
    import multiprocessing

    remote = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    check = Check(policy("100/h"), ALICE)
    assert remote.decide([check]).results[0].remaining == 99
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_decide_in_child, args=(remote, check, out))
    child.start()
    remaining = out.get(timeout=30)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert remaining == [98, 97, 96]
    assert remote.decide([check]).results[0].remaining == 95


def test_clear_forgets_a_subjects_state(backend: Any) -> None:
    check = Check(policy("1/m"), ALICE)
    other = Check(policy("1/m"), BOB)
    assert backend.decide([check]).allowed and backend.decide([other]).allowed
    assert not backend.decide([check]).allowed
    backend.clear([check])
    assert backend.decide([check]).allowed
    assert not backend.decide([other]).allowed


def test_memory_backend_forgets_idle_subjects(clock: FakeClock) -> None:
    """Expired state is swept, so memory stays bounded by active subjects."""
    memory = MemoryBackend(clock=clock)
    memory.SWEEP_EVERY = 100
    limit = policy("10/s")
    for n in range(99):
        memory.decide([Check(limit, Subject("ip", f"192.0.2.{n}"))])
    assert len(memory._state) == 99
    clock.advance(limit.state_ttl_ms * 1000 + 1)
    memory.decide([Check(limit, ALICE)])  # the 100th write triggers a sweep
    assert len(memory._state) == 1


def test_shadow_checks_report_but_never_deny(backend: Any) -> None:
    enforced = Check(policy("10/s", name="enforced"), ALICE)
    shadow = Check(Policy("trial", parse_rate("1/m"), 1, shadow=True), ALICE)
    first = backend.decide([enforced, shadow])
    assert first.allowed and not first.shadow_violated
    second = backend.decide([enforced, shadow])
    assert second.allowed
    assert [r.policy_name for r in second.shadow_violated] == ["trial"]
    assert second.violated == () and second.closest is not None and second.closest.policy_name == "enforced"
    # The enforced policy was charged for both requests, the shadow one only while it allowed.
    assert backend.decide([enforced], consume=False).results[0].remaining == 7


def test_a_renewed_slot_outlives_its_lease_and_a_lapsed_one_stays_gone(backend: Any, clock: FakeClock) -> None:
    """The heartbeat's renewal (ratelimits/engine/heartbeat.py), in every store alike."""
    check = Check(concurrency_policy("c", 1, fail_mode=FailMode.OPEN), ALICE)
    lease = check.policy.rate.period_us  # SHEDDING['SLOT_LEASE']
    held = backend.decide([check])
    assert held.allowed and held.slot is not None
    clock.advance(lease - 1_000)
    assert backend.renew({held.slot: held.slot_keys}, lease) == 1
    clock.advance(lease - 1_000)  # past the lease it was taken for, inside the renewed one
    assert not backend.decide([check]).allowed
    clock.advance(2_000)  # the renewed lease is over: its worker beat no more
    assert backend.renew({held.slot: held.slot_keys}, lease) == 0  # lapsed: not brought back
    again = backend.decide([check])
    assert again.allowed
    assert backend.renew({again.slot: again.slot_keys}, lease) == 1
    assert backend.release(again.slot, again.slot_keys) == 1
    assert backend.renew({again.slot: again.slot_keys}, lease) == 0  # released: not brought back
