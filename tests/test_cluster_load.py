"""A real Redis Cluster under load: storms, a master killed, slots moved while traffic runs.

Storms run on the session's cluster (4 processes x 8 threads, tests/support/storm.py); the
failover and resharding tests start a cluster of their own, since they change it for good.
Every loop is bounded in count and time; every server is stopped by PID.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis

from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import make_client
from ratelimits.decisions import Decision, Verdict
from ratelimits.engine.breaker import CircuitBreaker
from ratelimits.engine.limiter import Limiter
from ratelimits.identity import Subject
from ratelimits.policies import Check

from .support.redis_cluster import Cluster
from .test_cluster import node_ids, node_of, spread
from .test_concurrency import assert_clean, policy, storm, summary, token_bucket_bound

pytestmark = pytest.mark.slow

CALLER = Subject("api_key", "cluster-storm-caller")
#: How long, after a master is killed, the limiter may take to enforce limits again (seconds):
#: the cluster's node timeout (1 s), the replica's election, and the breaker's cooldown (2 s).
ENFORCED_AGAIN_WITHIN_S = 10.0


# -- storms ---------------------------------------------------------------------------------------


def test_cluster_storm_on_one_key_admits_exactly_the_burst(redis_cluster: Cluster, cluster_client: Any) -> None:
    bucket = policy("100/h", burst=100)
    check = Check(bucket, CALLER)
    report = storm(redis_cluster.url, cluster_client, lambda p, t: [check])
    assert_clean(report)
    bound = token_bucket_bound(bucket, report.elapsed_us)
    print(summary("cluster, one key", report, bound))
    assert len(report.admitted) == bucket.burst == bound


def test_cluster_storm_across_two_slots_is_all_or_nothing_and_never_over_admits(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """A roomy organisation limit on one master, a tight caller limit on another, 1600 attempts at once.

    Every denial (by the tight limit) gives back what the roomy limit consumed. The tight limit
    decides alone: exactly its burst is admitted. The roomy bucket keeps at most what was not
    admitted: what it lost to refunds that could not give everything back (contention) is the
    under-admission, measured here.
    """
    org, caller = spread([Subject("org", f"storm-{i}") for i in range(200)], cluster_client)[:2]  # two masters
    roomy, tight = policy("1000/d", burst=1000, name="roomy"), policy("100/h", burst=100, name="tight")
    checks = [Check(roomy, org), Check(tight, caller)]
    report = storm(redis_cluster.url, cluster_client, lambda p, t: checks)
    assert_clean(report)
    admitted = len(report.admitted)
    print(summary("cluster, two slots: roomy 1000/d + tight 100/h", report, tight.burst))
    assert admitted == tight.burst
    peek = ClusterBackend(make_client(redis_cluster.url, 2.0, 2.0)).decide([checks[0]], consume=False)  # type: ignore[arg-type]
    left = peek.results[0].remaining + 1  # a peek reports "after this one"
    lost = roomy.burst - admitted - left
    print(f"roomy bucket: {left} left of {roomy.burst - admitted} owed; {lost} tokens lost to contended refunds")
    assert left <= roomy.burst - admitted  # never more than what was not admitted: no over-admission
    assert lost <= (len(report.attempts) - admitted) // 10  # refunds gave back at least nine in ten


# -- failover and resharding ----------------------------------------------------------------------


class Traffic:
    """Threads deciding ``checks_for(i)`` through a :class:`Limiter` until stopped (bounded by ``seconds``)."""

    def __init__(self, limiter: Limiter, checks_for: Callable[[int], Sequence[Check]], threads: int, seconds: float):
        self.limiter = limiter
        self.checks_for = checks_for
        self.deadline = time.monotonic() + seconds
        self.stop = threading.Event()
        self.decisions: list[tuple[float, int, Decision]] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, index: int) -> None:
        n = 0
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            try:
                decision = self.limiter.decide(self.checks_for(index * 1_000_000 + n))
            except BaseException as exc:  # a 500 in a real request: the test fails on any
                with self._lock:
                    self.errors.append(exc)
                return
            with self._lock:
                self.decisions.append((time.monotonic(), index * 1_000_000 + n, decision))
            n += 1

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
            assert not thread.is_alive(), "a traffic thread hung"


def limiter_on(cluster: Cluster, timeout: float = 0.25) -> Limiter:
    backend = ClusterBackend(make_client(cluster.url, timeout, timeout))  # type: ignore[arg-type]
    return Limiter(
        backend,
        CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=2.0),
        local=MemoryBackend(),
        local_share=0.5,
    )


@pytest.fixture
def own_cluster() -> Any:
    with Cluster() as cluster:
        yield cluster


def test_a_master_killed_under_load_fails_open_then_limits_are_enforced_again(own_cluster: Cluster) -> None:
    """Zero errors while a master dies; its replica is promoted; the limit holds again within a bound."""
    client = own_cluster.client()
    tight = Check(policy("5/h", 5, name="tight"), Subject("api_key", "failover-caller"))
    victim_name = node_of(client, tight.key("rl"))
    victim = next(s for s in own_cluster.servers if f"127.0.0.1:{s.port}" == victim_name)
    others = [Check(policy("100000/s", 100000, name="wide"), Subject("api_key", f"failover-{i}")) for i in range(50)]
    limiter = limiter_on(own_cluster)
    assert [limiter.decide([tight]).allowed for _ in range(6)] == [True] * 5 + [False]

    with Traffic(limiter, lambda n: [tight, others[n % len(others)]], threads=4, seconds=40) as traffic:
        while len(traffic.decisions) < 200 and not traffic.errors and time.monotonic() < traffic.deadline:
            traffic.stop.wait(0.01)
        victim.kill()
        killed = time.monotonic()
        promoted_after = _wait_promoted(own_cluster, victim_name, killed)
        enforced_after = None
        while time.monotonic() - killed < ENFORCED_AGAIN_WITHIN_S and not traffic.errors:
            recent = [d for at, _, d in traffic.decisions[-50:] if at > killed]
            if len(recent) == 50 and all(not d.degraded and d.verdict is Verdict.LIMITED for d in recent):
                enforced_after = time.monotonic() - killed
                break
            traffic.stop.wait(0.05)
    assert not traffic.errors, traffic.errors[:3]
    after = [d for at, _, d in traffic.decisions if at > killed]
    degraded = [d for d in after if d.degraded]
    assert all(d.allowed for d in degraded)  # fail open, as the policies say
    print(
        f"failover: replica promoted after {promoted_after:.2f} s, limits enforced again after "
        f"{enforced_after} s; {len(degraded)} of {len(after)} decisions since the kill were degraded (fail open)"
    )
    assert enforced_after is not None, f"limits not enforced again within {ENFORCED_AGAIN_WITHIN_S} s"
    assert len(own_cluster.masters()) == 3


def _wait_promoted(cluster: Cluster, dead: str, since: float) -> float:
    """Seconds until another node serves the dead master's slots (bounded)."""
    deadline = since + ENFORCED_AGAIN_WITHIN_S
    while time.monotonic() < deadline:
        live = cluster.live()
        try:
            probe = live[0].client()
            nodes = probe.cluster("nodes")
            probe.close()
        except redis.RedisError:
            continue
        masters = [
            a.split("@")[0] for a, info in nodes.items() if "master" in info["flags"] and "fail" not in info["flags"]
        ]
        if len(masters) == 3 and dead not in masters:
            return time.monotonic() - since
        time.sleep(0.05)  # polling the cluster's own view; nothing to wait on instead
    pytest.fail(f"no replica promoted within {ENFORCED_AGAIN_WITHIN_S} s")


def test_moving_slots_under_traffic_gives_no_errors_and_no_over_admission(own_cluster: Cluster) -> None:
    """``redis-cli --cluster reshard`` moves 2000 slots while 4 threads decide for 60 subjects."""
    subjects = [Subject("api_key", f"reshard-{i}") for i in range(60)]
    bucket = policy("20/h", 20, name="reshard")
    limiter = limiter_on(own_cluster, timeout=1.0)
    ids = node_ids(own_cluster)
    source, target = sorted(ids)[:2]
    with Traffic(limiter, lambda n: [Check(bucket, subjects[n % len(subjects)])], threads=4, seconds=60) as traffic:
        while len(traffic.decisions) < 200 and not traffic.errors and time.monotonic() < traffic.deadline:
            traffic.stop.wait(0.01)
        started = time.monotonic()
        moved = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                source,
                "--cluster-from",
                ids[source],
                "--cluster-to",
                ids[target],
                "--cluster-slots",
                "2000",
                "--cluster-yes",
                "--cluster-pipeline",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=45,
        )
        took = time.monotonic() - started
    assert moved.returncode == 0, moved.stdout[-2000:] + moved.stderr[-2000:]
    assert not traffic.errors, traffic.errors[:3]
    during = [d for at, _, d in traffic.decisions if started <= at <= started + took]
    admitted = Counter(d.results[0].check.subject for _, _, d in traffic.decisions if d.allowed and not d.degraded)
    degraded = sum(d.degraded for _, _, d in traffic.decisions)
    print(
        f"resharding: 2000 slots moved in {took:.1f} s under {len(during)} decisions; "
        f"{degraded} degraded of {len(traffic.decisions)}; most admitted for one subject {max(admitted.values())}"
    )
    assert len(during) > 100
    assert max(admitted.values()) <= bucket.burst  # a 20/h bucket never gives more than 20 within the test
    assert degraded == 0
