"""Decisions on a real Redis Cluster: slot groups, concurrent calls, refunds, redirects, per-slot stamps and usage.

Every test runs against six redis-server processes in cluster mode (3 masters, 3 replicas) that
the suite starts on free loopback ports and stops by PID (``tests/support/redis_cluster.py``).
The session's cluster is flushed before each test; tests that kill nodes or move slots start a
cluster of their own.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ratelimits import engine
from ratelimits.algorithms import RATE_ALGORITHMS, Algorithm
from ratelimits.backends import LeaseSupport, get_backend, layout
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import DECIDE, deadline_of, make_client, read_state, with_deadline
from ratelimits.choices import FailMode
from ratelimits.conf import LocalPathSettings
from ratelimits.counters import Usage
from ratelimits.decisions import Verdict
from ratelimits.engine import get_limiter
from ratelimits.engine.breaker import BreakerState, CircuitBreaker
from ratelimits.engine.limiter import Limiter, LocalLimiter, build_limiter
from ratelimits.engine.local import LEASE
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy
from ratelimits.policies.values import Scope
from ratelimits.rates import parse_rate
from ratelimits.redis_url import parse_redis_url

from .support.clock import FakeClock
from .support.redis_cluster import Cluster
from .support.redis_server import free_port
from .support.settings import merged
from .test_contract import assert_same_decision, policy

CALLER = Subject("api_key", "cluster-caller")
IP = Subject("ip", "198.51.100.7")
ORG = Subject("org", "cluster-org")
ENDPOINT = Subject("endpoint", "POST /v1/charges")


def cluster_backend(cluster: Cluster, clock: FakeClock | None = None, timeout: float = 2.0) -> ClusterBackend:
    return ClusterBackend(make_client(cluster.url, timeout, timeout), clock=clock)  # type: ignore[arg-type]


def node_of(client: redis.RedisCluster, key: str) -> str:
    return str(client.get_node_from_key(key).name)


def spread(subjects: Sequence[Subject], client: redis.RedisCluster, name: str = "p") -> list[Subject]:
    """Subjects whose keys live on as many different masters as there are (one per master)."""
    seen: dict[str, Subject] = {}
    for subject in subjects:
        seen.setdefault(node_of(client, Check(policy("1/s", name=name), subject).key("rl")), subject)
    return list(seen.values())


def many_subjects(n: int) -> list[Subject]:
    return [Subject("api_key", f"spread-{i}") for i in range(n)]


def script_calls(cluster: Cluster) -> int:
    """Script calls (FCALL, EVALSHA and EVAL) the masters have run, from INFO commandstats."""
    total = 0
    for server in cluster.masters():
        client = server.client()
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        total += sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("fcall", "evalsha", "eval"))
    return total


# -- configuration ------------------------------------------------------------------------------


def test_a_cluster_url_names_its_startup_nodes_and_credentials() -> None:
    target = parse_redis_url("redis+cluster://lim:p%40ss@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002")
    assert target.cluster and target.addresses == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    assert (target.username, target.password) == ("lim", "p@ss")
    assert parse_redis_url("rediss+cluster://10.0.0.1:7000").cluster
    assert not parse_redis_url("redis://10.0.0.1:7000").cluster


def test_a_cluster_url_gives_the_cluster_backend_and_decides(
    settings: Any, redis_cluster: Cluster, cluster_client: Any
) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": redis_cluster.url}})
    engine.reset()
    try:
        assert isinstance(get_backend(), ClusterBackend)
        check = Check(policy("2/m"), CALLER)
        decisions = [get_limiter().decide([check]) for _ in range(3)]
        assert [d.allowed for d in decisions] == [True, True, False]
        assert not any(d.degraded for d in decisions)
    finally:
        engine.reset()


def test_a_prebuilt_cluster_client_is_taken(settings: Any, redis_cluster: Cluster, cluster_client: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"CLIENT": cluster_client}})
    engine.reset()
    try:
        backend = get_backend()
        assert isinstance(backend, ClusterBackend) and backend.client is cluster_client
        assert get_limiter().decide([Check(policy("2/m"), CALLER)]).allowed
    finally:
        engine.reset()


def test_an_unreachable_cluster_degrades_by_fail_mode_instead_of_failing_start_up(settings: Any) -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": url}})
    engine.reset()
    try:
        backend = get_backend()  # made without reaching the cluster
        with pytest.raises(BackendUnavailable):
            backend.decide([Check(policy("2/m"), CALLER)])
        decision = get_limiter().decide([Check(policy("2/m"), CALLER)])
        assert decision.allowed and decision.degraded  # fails open, as the policy says
    finally:
        engine.reset()


# -- the contract across slots ------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS, ids=[a.value for a in RATE_ALGORITHMS])
def test_memory_and_the_cluster_agree_on_random_traffic_across_slots(
    redis_cluster: Cluster, cluster_client: Any, algorithm: Algorithm
) -> None:
    """Four subjects on up to three masters per request: all or nothing, to the microsecond.

    A request denied by one slot group is refunded in the others at once (the clock stands
    still meanwhile), so the state is exactly as if nothing had been consumed: the cluster and
    the in-process reference decide alike. Whole-microsecond rates, where a refund is exact.
    """
    rng = random.Random(f"cluster-{algorithm.value}")
    memory_clock, cluster_clock = FakeClock(), FakeClock()
    memory = MemoryBackend(clock=memory_clock)
    remote = cluster_backend(redis_cluster, cluster_clock)
    policies = [
        policy("8/s", burst=12, algorithm=algorithm, name="a"),
        policy("50/10s", algorithm=algorithm, name="b"),
        policy("5/s", algorithm=algorithm, name="c"),
    ]
    subjects = [CALLER, IP, ORG, ENDPOINT]
    assert len({node_of(cluster_client, Check(policies[0], s).key("rl")) for s in subjects}) >= 2
    split = 0
    for _ in range(400):
        step = rng.choice([0, 0, 1_000, 37_000, 140_001, 900_000])
        memory_clock.advance(step)
        cluster_clock.advance(step)
        checks = [
            Check(rng.choice(policies), s, cost=rng.randint(1, 3)) for s in rng.sample(subjects, rng.randint(2, 4))
        ]
        consume = rng.random() > 0.1
        ours, theirs = memory.decide(checks, consume=consume), remote.decide(checks, consume=consume)
        assert_same_decision(ours, theirs)
        split += not theirs.allowed and any(r.allowed for r in theirs.results)
    assert split > 20, f"only {split} requests were denied by one group and admitted by another"


def test_every_cluster_key_has_a_ttl_and_no_raw_identity(redis_cluster: Cluster, cluster_client: Any) -> None:
    remote = cluster_backend(redis_cluster)
    subject = Subject("ip", "203.0.113.9")
    usage = Usage(int(time.time() // 60), "k|digest|||t|ep|", 1, "k|*|||t|ep|")
    for algorithm in RATE_ALGORITHMS:
        remote.decide([Check(policy("5/10m", algorithm=algorithm, name=f"p-{algorithm.value}"), subject)], usage=usage)
    remote.publish_version(3)
    keys = [key for key in cluster_client.scan_iter(count=1000)]
    assert len(keys) == 3 + 1 + layout.REDIS_CLUSTER_HASH_SLOTS  # states, one usage hash, a stamp per slot
    for key in keys[:: max(len(keys) // 500, 1)] + [k for k in keys if b"#policy-version" not in k]:
        assert cluster_client.pttl(key) > 0
        assert b"203.0.113.9" not in key
        assert key.count(b"{") == 1 and key.count(b"}") == 1


# -- slot groups --------------------------------------------------------------------------------


def four_dimensions(client: redis.RedisCluster) -> list[Check]:
    """The caller's rate and quota (one slot), its IP, its organisation and the endpoint-wide limit."""
    return [
        Check(policy("100/s", name="tier-rate"), CALLER),
        Check(policy("100000/d", algorithm=Algorithm.FIXED_WINDOW, name="tier-quota"), CALLER),
        Check(policy("1000/s", name="ip"), IP),
        Check(policy("10000/s", name="org"), ORG),
        Check(policy("50000/s", name="endpoint-wide"), ENDPOINT),
    ]


def test_a_four_dimension_request_makes_one_script_call_per_slot_group(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    backend = cluster_backend(redis_cluster)
    checks = four_dimensions(cluster_client)
    slots = {layout.key_slot(c.key("rl").encode()) for c in checks}
    assert len(slots) == 4  # the caller's two policies share its slot
    backend.decide(checks, consume=False)  # connections open, scripts cached
    before = script_calls(redis_cluster)
    for _ in range(10):
        assert backend.decide(checks).allowed
    assert script_calls(redis_cluster) - before == 10 * len(slots)


def test_the_groups_are_sent_concurrently(redis_cluster: Cluster, cluster_client: Any) -> None:
    """With every master holding writes for PAUSE_MS, one decision over three masters waits one pause, not three."""
    pause_ms = 400
    backend = cluster_backend(redis_cluster, timeout=5.0)
    subjects = spread(many_subjects(200), cluster_client)
    assert len(subjects) == 3
    checks = [Check(policy("100/s"), s) for s in subjects]
    backend.decide(checks, consume=False)
    masters = [server.client() for server in redis_cluster.masters()]
    try:
        for client in masters:
            client.execute_command("CLIENT", "PAUSE", pause_ms, "WRITE")
        started = time.monotonic()
        decision = backend.decide(checks)
        elapsed = time.monotonic() - started
    finally:
        for client in masters:
            client.execute_command("CLIENT", "UNPAUSE")
            client.close()
    assert decision.allowed
    assert elapsed < 2 * pause_ms / 1000, f"{elapsed:.3f} s: the three calls waited one after another"


def test_a_cross_slot_denial_gives_back_what_the_other_groups_consumed(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    clock = FakeClock()
    backend = cluster_backend(redis_cluster, clock)
    roomy, tight = policy("10/m", name="roomy"), policy("1/m", name="tight")
    conc = Policy("conc", parse_rate("5/s"), 5, Algorithm.CONCURRENCY)
    subjects = spread(many_subjects(200), cluster_client)
    checks = [Check(roomy, subjects[0]), Check(conc, subjects[1]), Check(tight, subjects[2])]
    assert backend.decide(checks).allowed
    before = backend.decide(checks[:2], consume=False).results
    for _ in range(5):
        denied = backend.decide(checks)
        assert denied.verdict is Verdict.LIMITED and denied.slot is None
    after = backend.decide(checks[:2], consume=False).results
    assert [r.remaining for r in after] == [r.remaining for r in before]  # nothing kept: tokens or slots
    assert cluster_client.zcard(checks[1].key("rl")) == 1  # only the admitted request's slot


def test_a_cross_slot_denial_gives_back_a_global_policys_tokens(redis_cluster: Cluster, cluster_client: Any) -> None:
    """A global bucket's state is tokens (docs/regions.md): the refund puts the request's cost back."""
    clock = FakeClock()
    backend = cluster_backend(redis_cluster, clock)
    shared = Policy("shared", parse_rate("10/m"), 10, scope=Scope.GLOBAL)
    tight = policy("1/m", name="tight")
    subjects = spread(many_subjects(200), cluster_client)
    checks = [Check(shared, subjects[0]), Check(tight, subjects[1])]
    assert backend.decide(checks).allowed
    before = backend.decide(checks[:1], consume=False).results[0].remaining
    for _ in range(5):
        assert backend.decide(checks).verdict is Verdict.LIMITED
    assert backend.decide(checks[:1], consume=False).results[0].remaining == before
    # Its demand was counted in the demand hash of its own slot.
    key = checks[0].key("rl")
    demand = layout.demand_key("rl", clock() // 1_000_000, layout.slot_tag(layout.key_slot(key.encode())))
    assert int(cluster_client.hget(demand, key)) == 6  # the six consuming calls, not the two that only looked


def test_a_refund_corrects_the_usage_the_caller_group_counted(redis_cluster: Cluster, cluster_client: Any) -> None:
    backend = cluster_backend(redis_cluster)
    subjects = spread(many_subjects(200), cluster_client)
    usage = Usage(int(time.time() // 60), "k|caller|||t|ep|", 3, "k|*|||t|ep|")
    checks = [Check(policy("10/m", name="roomy"), subjects[0]), Check(policy("1/m", name="tight"), subjects[1])]
    assert backend.decide(checks, usage=usage).allowed
    assert not backend.decide(checks, usage=usage).allowed
    key = layout.usage_key("rl", usage.minute, layout.slot_tag(layout.key_slot(checks[0].key("rl").encode())))
    counts = {k.decode(): int(v) for k, v in cluster_client.hgetall(key).items()}
    assert counts == {"#": 1, usage.field: 1, usage.field + "a": 1, usage.field + "l": 1, usage.field + "x": 2}


# -- leases -------------------------------------------------------------------------------------


def test_a_lease_takes_each_groups_tokens_and_gives_the_unused_back_per_slot(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """A leasing call over three slot groups takes every check's tokens in its own group; the
    unused ones go back to each bucket, one refund call per slot group, and the buckets hold
    exactly what they would had the lease never been taken."""
    clock = FakeClock()
    backend = cluster_backend(redis_cluster, clock)
    assert isinstance(backend, LeaseSupport)
    subjects = spread(many_subjects(200), cluster_client)
    # The function of the refund script loaded on every master (a first call loads it, then runs again).
    warm = [Check(policy("10/m", name="warm"), subject) for subject in subjects]
    backend.give_back([(grant, grant.tokens) for grant in backend.lease(warm, [1, 1, 1])[1]])
    checks = [Check(policy("10/m", name=f"leased-{n}"), subject) for n, subject in enumerate(subjects)]
    checks.append(Check(policy("20/m", name="leased-3"), subjects[0]))  # the first check's slot group
    decision, grants = backend.lease(checks, [4, 3, 2, 5])
    assert decision.allowed
    # In the order of the checks, as one Redis gives them, though the first group holds the last.
    assert [(g.check, g.tokens) for g in grants] == list(zip(checks, [4, 3, 2, 5], strict=True))
    peek = backend.decide(checks, consume=False).results
    # A look says what would remain after one more request: 9 of an untouched bucket of 10.
    assert [r.remaining for r in peek] == [9 - 1 - 4, 9 - 1 - 3, 9 - 1 - 2, 19 - 1 - 5]
    before = script_calls(redis_cluster)
    assert backend.give_back([(grant, grant.tokens) for grant in grants]) == 4
    assert script_calls(redis_cluster) - before == 3  # one refund per slot group
    assert [r.remaining for r in backend.decide(checks, consume=False).results] == [8, 8, 8, 18]  # the request's own


def test_a_lease_one_group_denies_gives_back_the_others_cost_and_leases(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """All or nothing across slots with leases too: a request one group denies takes nothing in
    the others, neither its cost nor the tokens they took for the worker."""
    clock = FakeClock()
    backend = cluster_backend(redis_cluster, clock)
    subjects = spread(many_subjects(200), cluster_client)
    roomy = [
        Check(policy("10/m", name="roomy"), subjects[0]),
        Check(policy("20/m", name="window", algorithm=Algorithm.FIXED_WINDOW), subjects[1]),
    ]
    tight = Check(policy("1/m", name="tight"), subjects[2])
    assert backend.decide([tight]).allowed
    before = [r.remaining for r in backend.decide(roomy, consume=False).results]
    for _ in range(3):
        decision, grants = backend.lease([*roomy, tight], [5, 5, 0])
        assert decision.verdict is Verdict.LIMITED and grants == []
    assert [r.remaining for r in backend.decide(roomy, consume=False).results] == before == [9, 19]


def test_leases_on_a_cluster_answer_a_hot_request_from_memory(redis_cluster: Cluster, cluster_client: Any) -> None:
    """The local path leases on a cluster: a request made often is answered from its leases, and
    every token a lease took is spent by a request or given back to its bucket."""
    limiter = shared_limiter(redis_cluster)
    path = limiter.local_path
    subjects = spread(many_subjects(200), cluster_client)
    checks = [Check(policy("1/h", 40, name="hot"), subject) for subject in subjects]  # refills nothing meanwhile
    answers = [limiter.decide(checks) for _ in range(60)]
    admitted = sum(d.allowed for d in answers)
    assert admitted <= 40  # the burst at most: what leases spent they took from the buckets
    assert sum(d.local == LEASE for d in answers) >= 20, [d.local for d in answers]
    end_leases(limiter)
    assert not path._expiring and not path.counts.get("tokens_unreturned"), path.counts
    # What no request spent went back: each bucket is short of exactly the requests admitted.
    left = limiter.backend.decide(checks, consume=False).results
    assert [(r.allowed, r.remaining) for r in left] == [(admitted < 40, max(39 - admitted, 0))] * 3, admitted


def shared_limiter(cluster: Cluster) -> LocalLimiter:
    """A worker's limiter on ``cluster``, its leases lasting longer than a test's requests take on a
    busy machine, and given back only when the test says (the listener's tick does not)."""
    backend = cluster_backend(cluster)
    breaker = CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=60.0)
    limiter = build_limiter(backend, breaker, LocalPathSettings(leases=True, lease_ttl=5.0), usage_cap=100)
    assert isinstance(limiter, LocalLimiter)
    limiter.local_path.tick = None
    return limiter


def end_leases(limiter: LocalLimiter) -> None:
    """End every lease of ``limiter`` now, and give back what they hold."""
    for lease in limiter.local_path._expiring:
        lease.expires = 0.0
    limiter.return_leases()


def callers_apart_from(client: redis.RedisCluster, subject: Subject, n: int) -> list[Subject]:
    """``n`` callers whose keys are on another master than ``subject``'s."""
    node = node_of(client, Check(policy("1/h"), subject).key("rl"))
    return [s for s in many_subjects(400) if node_of(client, Check(policy("1/h"), s).key("rl")) != node][:n]


def test_a_shared_bucket_asked_about_often_is_leased_and_its_call_left_out(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """Many callers, each asking once, share an organisation's bucket in a slot of its own: once
    this worker asked about it often, it is leased, and the callers' requests whose organisation's
    part a lease pays are decided with one call (their own slot's); every token the leases took is
    spent by a request or given back."""
    limiter = shared_limiter(redis_cluster)
    org = policy("1/h", 1000, name="org")
    own = policy("1/h", 5, name="caller")
    requests = [[Check(own, caller), Check(org, ORG)] for caller in callers_apart_from(cluster_client, ORG, 40)]
    for checks in requests:
        limiter.backend.decide(checks, consume=False)  # the script's function loaded on each master
    before = script_calls(redis_cluster)
    answers = [limiter.decide(checks) for checks in requests]
    calls = script_calls(redis_cluster) - before
    assert all(d.allowed for d in answers)
    path = limiter.local_path
    # The fourth request leases the organisation's bucket for as many requests as it met (4), the
    # ninth for 9, the nineteenth for 19, the thirty-ninth for 39: 33 of the 40 paid from a lease.
    spared = path.counts["groups_spared"]
    assert spared >= 30, path.counts
    assert calls == len(requests) + (len(requests) - spared), (calls, path.counts)  # the caller's slot, and the rest
    assert [d.results[1].check for d in answers] == [checks[1] for checks in requests]  # every check's result
    # All spent or given back: the organisation's bucket is short of exactly the requests admitted.
    end_leases(limiter)
    assert not path._expiring and not path.counts.get("tokens_unreturned"), path.counts
    left = limiter.backend.decide([requests[0][1]], consume=False).results[0].remaining
    assert left == 1000 - len(requests) - 1  # a look says what one more request would leave


def test_a_request_the_store_refuses_puts_back_what_the_leases_paid(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """All or nothing with a group paid from leases: when the caller's own slot refuses the
    request, the organisation's tokens go back into the lease (no call), and nothing is kept."""
    limiter = shared_limiter(redis_cluster)
    org = policy("1/h", 1000, name="org")
    own = policy("1/h", 1, name="caller")
    callers = callers_apart_from(cluster_client, ORG, 6)
    for caller in callers[:5]:
        assert limiter.decide([Check(own, caller), Check(org, ORG)]).allowed
    path = limiter.local_path
    lease = path._leases[Check(org, ORG).key("rl")]
    held = lease.tokens
    assert held > 0
    spent = Check(own, callers[5])
    assert limiter.backend.decide([spent]).allowed  # spent by another worker: this one remembers no denial
    denied = limiter.decide([spent, Check(org, ORG)])
    assert denied.verdict is Verdict.LIMITED and denied.local is None
    assert [r.allowed for r in denied.results] == [False, True]
    # The fifth request was paid from the lease (the fourth took it), and so was the refused one, then put back.
    assert lease.tokens == held and path.counts["groups_spared"] == 2, path.counts


def test_tokens_put_back_into_a_lease_that_ended_go_back_to_the_bucket(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """A lease that ended while a request it paid part of was with the store: what the request
    paid goes back to the bucket with the next ended leases, not lost."""
    limiter = shared_limiter(redis_cluster)
    org = policy("1/h", 1000, name="org")
    own = policy("1/h", 5, name="caller")
    callers = callers_apart_from(cluster_client, ORG, 6)
    for caller in callers[:5]:  # the fourth leases 4 tokens, the fifth spends one of them
        assert limiter.decide([Check(own, caller), Check(org, ORG)]).allowed
    path = limiter.local_path
    spared = path._spare([Check(own, callers[5]), Check(org, ORG)], ((1,),))
    assert spared is not None and spared.paid == (1,)
    end_leases(limiter)  # the lease ends: the 2 tokens it still holds go back
    path.put_back(spared)  # the store refused: the one it paid comes back after it
    end_leases(limiter)
    assert not path._expiring and path.counts["tokens_returned"] == 3, path.counts
    # 5 requests spent, nothing else: a look says what one more would leave.
    assert limiter.backend.decide([Check(org, ORG)], consume=False).results[0].remaining == 1000 - 5 - 1


@pytest.mark.parametrize("fail_mode", [FailMode.OPEN, FailMode.CLOSED, FailMode.LOCAL])
def test_a_request_decided_without_the_store_keeps_what_the_leases_paid_only_if_admitted(
    redis_cluster: Cluster, cluster_client: Any, fail_mode: FailMode
) -> None:
    """The breaker open, the rest of a request a lease paid part of is decided by its fail mode:
    admitted (open, local), the lease's tokens stay spent; refused (closed), they go back into it.
    Every check is reported either way."""
    limiter = shared_limiter(redis_cluster)
    org = policy("1/h", 1000, name="org")
    own = Policy("caller", parse_rate("1/h"), 5, fail_mode=fail_mode)
    callers = callers_apart_from(cluster_client, ORG, 6)
    for caller in callers[:5]:
        assert limiter.decide([Check(own, caller), Check(org, ORG)]).allowed
    lease = limiter.local_path._leases[Check(org, ORG).key("rl")]
    held = lease.tokens
    assert held > 0
    for _ in range(5):
        limiter.breaker.record_failure()
    assert limiter.breaker.state is BreakerState.OPEN
    decision = limiter.decide([Check(own, callers[5]), Check(org, ORG)])
    assert decision.degraded
    admitted = fail_mode is not FailMode.CLOSED
    assert decision.allowed is admitted
    assert lease.tokens == (held - 1 if admitted else held)
    assert Check(org, ORG) in [r.check for r in decision.results]


# -- refunds never create tokens ------------------------------------------------------------------


def effective(backend: ClusterBackend, client: redis.RedisCluster, check: Check, now: int) -> tuple[float, ...]:
    """The spent capacity the state holds at ``now``: a bucket's arrival time (not before now), a window's counts."""
    raw = client.get(check.key(backend.prefix))
    algorithm = check.policy.algorithm
    if raw is None:
        return (now,) if algorithm is Algorithm.TOKEN_BUCKET else (0.0,)
    state = read_state(algorithm, raw)
    if algorithm is Algorithm.TOKEN_BUCKET:
        return (max(state[0], now),)
    period = check.policy.rate.period_us
    window = now // period
    if algorithm is Algorithm.FIXED_WINDOW:
        return (state[1] if state[0] == window else 0.0,)
    current = state[1] if state[0] == window else 0.0
    previous = state[2] if state[0] == window else state[1] if state[0] == window - 1 else 0.0
    return (current, previous)


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS, ids=[a.value for a in RATE_ALGORITHMS])
@pytest.mark.parametrize("rate", ["8/s", "7/s"], ids=["whole-us", "fractional-us"])
def test_a_refund_never_creates_a_token_that_was_not_consumed(
    redis_cluster: Cluster, cluster_client: Any, algorithm: Algorithm, rate: str
) -> None:
    """Random interleavings of consumes and late refunds, against a twin that never saw the refunded requests.

    World 1 (``ours``) admits requests of which some are refunded later, at random times, with
    other requests and other refunds in between. World 0 (``twin``, another key on the same
    policy) sees only the requests world 1 admitted and never refunded. After every step, world 1
    holds at least as much spent capacity as world 0: a refund only ever gives back what its
    request still held, so world 1 can never admit what world 0 would not.
    """
    rng = random.Random(f"refund-{algorithm.value}-{rate}")
    clock = FakeClock()
    backend = cluster_backend(redis_cluster, clock)
    limit = policy(rate, burst=6, algorithm=algorithm)
    ours, twin = Check(limit, Subject("api_key", "world-1")), Check(limit, Subject("api_key", "world-0"))
    pending: list[Any] = []  # admitted calls of world 1 awaiting their refund
    refunds = 0
    for step in range(500):
        clock.advance(rng.choice([0, 0, 0, 1, 999, 37_000, 140_001, 400_000]))
        if pending and rng.random() < 0.4:
            call, check = pending.pop(rng.randrange(len(pending)))
            assert backend._refund([check], [call], usage=None, slot=None) is None
            refunds += 1
        else:
            cost = rng.randint(1, 3)
            check = Check(limit, ours.subject, cost=cost)
            calls = backend.decide_calls([check], consume=True, usage=None, slot=None, refundable=True)
            backend._run_calls(DECIDE, calls)
            admitted = calls[0].reply[4] == 0
            if admitted and rng.random() < 0.5:
                pending.append((calls[0], check))
            elif admitted:
                assert backend.decide([Check(limit, twin.subject, cost=cost)]).allowed, f"step {step}: twin refused"
        now = clock()
        mine, theirs = effective(backend, cluster_client, ours, now), effective(backend, cluster_client, twin, now)
        assert all(a >= b for a, b in zip(mine, theirs, strict=True)), f"step {step}: {mine} < {theirs}"
    assert refunds > 50


# -- redirects and timeouts ---------------------------------------------------------------------


def node_ids(cluster: Cluster) -> dict[str, str]:
    """``host:port`` -> node id of every master."""
    client = cluster.masters()[0].client()
    try:
        nodes = client.cluster("nodes")
    finally:
        client.close()
    return {address.split("@")[0]: info["node_id"] for address, info in nodes.items() if "master" in info["flags"]}


def move_empty_slot(cluster: Cluster, slot: int, source: str, target: str) -> None:
    """Give ``slot`` (holding no keys) to ``target``, as ``redis-cli --cluster reshard`` does."""
    ids = node_ids(cluster)
    by_address = {f"127.0.0.1:{s.port}": s for s in cluster.masters()}
    source_client, target_client = by_address[source].client(), by_address[target].client()
    try:
        target_client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        source_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        assert source_client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        for client in (target_client, source_client):
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    finally:
        source_client.close()
        target_client.close()


def test_a_moved_slot_is_followed_where_the_reply_says(redis_cluster: Cluster, cluster_client: Any) -> None:
    clock = FakeClock()
    backend = cluster_backend(redis_cluster, clock)
    check = Check(policy("3/m"), Subject("api_key", "mover"))
    slot = layout.key_slot(check.key("rl").encode())
    backend.decide([check], consume=False)  # the backend's slot map now says where the slot was
    source = backend.client.nodes_manager.get_node_from_slot(slot).name
    target = next(name for name in node_ids(redis_cluster) if name != source)
    move_empty_slot(redis_cluster, slot, source, target)
    decision = backend.decide([check])
    assert decision.allowed and decision.results[0].remaining == 2
    assert backend.client.nodes_manager.get_node_from_slot(slot).name == target  # learnt from the MOVED
    assert node_of(redis_cluster.client(), check.key("rl")) == target
    host, port = target.split(":")
    assert redis.Redis(host=host, port=int(port)).exists(check.key("rl"))
    assert backend.decide([check]).results[0].remaining == 1  # decided once each, never twice


#: A read-only script that keeps its node busy for a while (each node runs one command at a time).
BUSY = """
local function now() local t = redis.call('TIME') return t[1] * 1000000 + t[2] end
local start = now()
while now() - start < tonumber(ARGV[1]) * 1000000 do end
return 1
"""


def busy_now(port: int) -> bool:
    """Whether the node has started on a busy script: a PING goes unanswered (a bounded number of tries)."""
    for _ in range(50):
        probe = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.02, retry=Retry(NoBackoff(), 0))
        try:
            probe.ping()
        except redis.TimeoutError:
            return True
        finally:
            probe.close()
    return False


def test_a_timed_out_consume_runs_once_and_is_never_sent_again(redis_cluster: Cluster, cluster_client: Any) -> None:
    """Every master is busy longer than the socket timeout: the call times out, runs late once, and only once."""
    backend = cluster_backend(redis_cluster, timeout=0.1)
    checks = [Check(policy("10/h"), s) for s in spread(many_subjects(200), cluster_client)]
    backend.decide(checks, consume=False)
    masters = redis_cluster.masters()  # asked first: a busy node answers nothing
    busy = [redis.Redis(host="127.0.0.1", port=server.port) for server in masters]
    connections = [client.connection_pool.get_connection() for client in busy]
    for connection in connections:
        connection.send_command("EVAL", BUSY, 0, "0.5")
    for server in masters:
        assert busy_now(server.port), f"node {server.port} never got busy"
    with pytest.raises(BackendUnavailable):
        backend.decide(checks)
    for connection in connections:
        assert connection.read_response() == 1  # each node was busy, and is free again
    peek = cluster_backend(redis_cluster).decide(checks, consume=False)
    assert [r.remaining for r in peek.results] == [8] * len(checks)  # spent once each ("after this one": 8)
    for client, connection in zip(busy, connections, strict=True):
        client.connection_pool.release(connection)
        client.close()


# -- what every request touches, spread over the slots --------------------------------------------


def test_the_policy_version_reaches_every_slot_and_never_goes_back(redis_cluster: Cluster, cluster_client: Any) -> None:
    backend = cluster_backend(redis_cluster)
    assert backend.publish_version(5) == "5"
    assert backend.publish_version(3) == "5"  # a late publisher never lowers it
    copies = [layout.version_key("rl", layout.slot_tag(s)) for s in range(layout.REDIS_CLUSTER_HASH_SLOTS)]
    pipe = cluster_client.pipeline()
    for key in copies:
        pipe.get(key)
    assert set(pipe.execute()) == {b"5"}
    for subject in many_subjects(20):
        assert backend.decide([Check(policy("5/s"), subject)]).policy_version == "5"


def test_usage_is_counted_in_each_callers_slot_and_the_drain_reads_every_shard(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    backend = cluster_backend(redis_cluster)
    minute = int(time.time() // 60)
    callers = many_subjects(30)
    for n, caller in enumerate(callers):
        usage = Usage(minute, f"k|{caller.digest}|||t|ep|", 1, "k|*|||t|ep|")
        for _ in range(n % 3 + 1):
            backend.decide([Check(policy("100/s"), caller), Check(policy("1000/s", name="ip"), IP)], usage=usage)
    batches = backend.claim_usage(minute + 1)
    slots = {layout.key_slot(c.key("rl").encode()) for c in [Check(policy("100/s"), s) for s in callers]}
    assert len(batches) == len(slots) > 10  # one hash per slot that counted a request
    assert {node_of(cluster_client, batch) for batch, _ in batches} == set(node_ids(redis_cluster))
    totals: dict[str, int] = {}
    for batch, batch_minute in batches:
        assert batch_minute == minute
        counts = backend.lease_usage(batch, 30)
        assert counts is not None
        for field, count in counts.items():
            totals[field] = totals.get(field, 0) + count
        backend.finish_usage(batch)
    assert {field: count for field, count in totals.items() if field.endswith("a")} == {
        f"k|{caller.digest}|||t|ep|a": n % 3 + 1 for n, caller in enumerate(callers)
    }
    assert totals["#"] == len(callers)
    assert backend.claim_usage(minute + 1) == []


def test_a_check_one_group_cannot_decide_is_left_to_its_fail_mode_and_the_others_are_charged_once(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    backend = cluster_backend(redis_cluster)
    good_subject, bad_subject = spread(many_subjects(200), cluster_client)[:2]
    good, bad = Check(policy("10/h", name="good"), good_subject), Check(policy("10/h", name="bad"), bad_subject)
    cluster_client.hset(bad.key("rl"), "not", "a bucket")  # a key of another type: that check cannot be decided
    limiter = Limiter(backend, CircuitBreaker(), local=MemoryBackend(), local_share=0.5)
    decision = limiter.decide([good, bad])
    assert decision.allowed and not decision.degraded  # the bad check fails open; the good one was decided
    assert [r.check for r in decision.results] == [good, bad]
    assert backend.decide([good], consume=False).results[0].remaining == 8  # charged once ("after this one": 8)


def decided_then_function_lost(cluster: Cluster, name: str) -> tuple[ClusterBackend, list[Check]]:
    """A backend and twelve checks spread over the masters, each decided once (10/h: 9 left), and
    then every master's copy of the decide Function flushed, as a restart or a promoted replica leaves it."""
    backend = cluster_backend(cluster)
    checks = [Check(policy("10/h", name=f"{name}{i}"), s) for i, s in enumerate(many_subjects(12))]
    assert backend.decide(checks).allowed
    for server in cluster.masters():
        with server.client() as node:
            node.function_flush()
    return backend, checks


def test_a_function_the_nodes_lost_is_loaded_on_each_and_every_call_charged_once(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """After FUNCTION FLUSH (as a restart or a promoted replica leaves a node), each node's calls of
    one round come back "Function not found", every reply is read, the library is loaded on the
    node and the calls sent again: each charged once."""
    backend, checks = decided_then_function_lost(redis_cluster, "lost")
    decision = backend.decide(checks)
    assert decision.allowed and [r.remaining for r in decision.results] == [8] * len(checks)
    assert [r.remaining for r in backend.decide(checks).results] == [7] * len(checks)  # every node in step
    for server in redis_cluster.masters():
        with server.client() as node:
            assert node.function_list(library=DECIDE.function)


def test_a_call_sent_again_after_the_function_was_lost_carries_a_deadline_of_its_new_send(
    redis_cluster: Cluster,
) -> None:
    """A round's calls the nodes did not run (their Function lost) are sent again once it is loaded,
    stamped again: sent first with a deadline long past, they run when sent again."""
    backend, checks = decided_then_function_lost(redis_cluster, "restamp")
    calls = backend.decide_calls(checks, consume=True, usage=None, slot=None)
    for call in calls:
        call.args = with_deadline(call.args, 1)  # long past: as sent first, each would be LATE
    backend._run_calls(DECIDE, calls)
    assert all(call.error is None for call in calls), [call.error for call in calls]
    assert all(deadline_of(call.args) != 1 for call in calls)
    assert [r.remaining for r in backend.decide(checks).results] == [7] * len(checks)  # each charged once


def test_an_error_reply_leaves_its_nodes_connection_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that answers a round's calls with an error (out of memory here) is read to the end: its
    next round's replies are its own, not the errors left unread."""
    monkeypatch.setattr("ratelimits.backends.transport.IDLE_CHECK_S", 3600.0)  # a connection is never asked
    with Cluster(masters=3, replicas=0, config=("--maxmemory-policy", "noeviction")) as cluster:
        backend = cluster_backend(cluster)
        checks = [Check(policy("10/h", name=f"oom{i}"), s) for i, s in enumerate(many_subjects(12))]
        assert backend.decide(checks).allowed
        masters = [server.client() for server in cluster.masters()]
        try:
            for node in masters:
                node.config_set("maxmemory", 1)  # over it: a call that may write is refused
            with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
                backend.decide(checks)
            for node in masters:
                node.config_set("maxmemory", 0)
        finally:
            for node in masters:
                node.close()
        decision = backend.decide(checks)
        assert decision.allowed and [r.remaining for r in decision.results] == [8] * len(checks)


def test_a_cluster_without_functions_is_sent_the_script() -> None:
    """Nodes that refuse FCALL (before Redis 7; renamed away here): every group's call goes by
    EVALSHA from the first refusal on, each charged once."""
    no_functions = ("--rename-command", "FCALL", "", "--rename-command", "FUNCTION", "")
    with Cluster(masters=3, replicas=0, config=no_functions) as cluster:
        backend = cluster_backend(cluster)
        checks = [Check(policy("10/h", name=f"script{i}"), s) for i, s in enumerate(many_subjects(12))]
        remaining = [[r.remaining for r in backend.decide(checks).results] for _ in range(2)]
        assert remaining == [[9] * len(checks), [8] * len(checks)]
        assert backend.functions.enabled is False
        assert script_calls(cluster) >= 2  # by EVALSHA (and EVAL where a node first lacked the script)


def test_calls_pipelined_to_one_node_keep_their_connection(
    redis_cluster: Cluster, cluster_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection taken again within one round is not checked for something to read: its replies are pending.

    Every take of a connection asks whether it holds a stray reply (as if idle longer than
    ``IDLE_CHECK_S``): the 16,384 pipelined calls of a publication still all get their replies.
    """
    monkeypatch.setattr("ratelimits.backends.transport.IDLE_CHECK_S", -1.0)
    backend = cluster_backend(redis_cluster)
    assert backend.publish_version(4) == "4"
    checks = [Check(policy("10/s", name=f"p{i}"), s) for i, s in enumerate(many_subjects(12))]
    assert backend.decide(checks).allowed  # groups on one node share a connection in one round


def test_a_request_another_group_could_not_decide_is_counted_once(redis_cluster: Cluster, cluster_client: Any) -> None:
    """The first group counts the request; when another group fails, that count is taken back and the
    engine counts the request as it finally decides it: once."""
    backend = cluster_backend(redis_cluster)
    caller, other = spread(many_subjects(200), cluster_client)[:2]
    good, bad = Check(policy("10/h", name="good"), caller), Check(policy("10/h", name="bad"), other)
    cluster_client.hset(bad.key("rl"), "not", "a bucket")
    usage = Usage(int(time.time() // 60), "k|caller|||t|ep|", 2, "k|*|||t|ep|")
    limiter = Limiter(backend, CircuitBreaker(), local=MemoryBackend(), local_share=0.5)
    assert limiter.decide([good, bad], usage=usage).allowed
    key = layout.usage_key("rl", usage.minute, layout.slot_tag(layout.key_slot(good.key("rl").encode())))
    counts = {k.decode(): int(v) for k, v in cluster_client.hgetall(key).items()}
    assert counts[usage.field + "a"] == 1 and counts[usage.field + "x"] == 1
