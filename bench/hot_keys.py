"""``python -m bench.hot_keys``: what hot, flooded, cold and long-tail keys cost, on the central path and the local one.

Four worker processes decide through a limiter each against a private ``redis-server`` (a free
loopback port, stopped by PID) in five scenarios, each for a few seconds, once asking the store
every time (``central``) and once with the local fast path as the package ships it (``default``:
the exact denial cache and token leases, :mod:`ratelimits.engine.local`), side by side in one run:

- ``flood``: one key limited to 100/s (burst 100), asked as fast as 4 processes x 2 threads can
  (far beyond 20x its limit);
- ``hot``: one key limited to 1,000/s (burst 100), offered 90 % of its rate, paced;
- ``hot4``: one caller's requests of four dimensions (its tier at 1,000/s, burst 100, its user,
  its organisation and the endpoint, each roomier), offered 90 % of the tier's rate, paced;
- ``cold``: 10,000 subjects, each asked about once a second, paced;
- ``tail``: a long tail, 2,000 requests a second of four dimensions from 10,000 callers (500
  organisations, 4 endpoints), the k-th busiest caller making a share ∝ 1 / k^1.1 (Zipf), paced,
  every limit roomy enough that nothing is refused: what leases cost and save where most callers
  are cold.

With ``--cluster`` the store is a private Redis Cluster (3 masters, 3 replicas) instead: a
request's four dimensions are four slot groups there, one script call each when the store
decides it, and the figures are summed over the masters.

For each it prints the decisions made, those admitted against ``burst + rate x elapsed`` of the
callers' own limit (Redis ``TIME`` around the run; any excess is over-admission) and as a share of
those offered, Redis script calls, Redis CPU and the workers' own CPU per decision, and the
decision latency (p50/p99). Then the p50 of the decisions answered from memory against a bare PING
measured in the same run. Targets of issues 12 and 28 are printed beside the figures.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.support.django_settings")
django.setup()

import redis  # noqa: E402  (after django.setup)

from ratelimits.backends.cluster import ClusterBackend  # noqa: E402
from ratelimits.backends.redis import RedisBackend, make_client  # noqa: E402
from ratelimits.conf import LocalPathSettings  # noqa: E402
from ratelimits.engine.breaker import CircuitBreaker  # noqa: E402
from ratelimits.engine.limiter import Limiter, build_limiter  # noqa: E402
from ratelimits.identity import Subject, SubjectKind  # noqa: E402
from ratelimits.policies.values import Check, Policy  # noqa: E402
from ratelimits.rates import parse_rate  # noqa: E402
from ratelimits.redis_url import parse_redis_url  # noqa: E402

from .stats import percentile  # noqa: E402
from .support.redis_cluster import Cluster  # noqa: E402
from .support.redis_server import RedisServer  # noqa: E402

PROCESSES = 4
START_TIMEOUT_S = 60.0
#: The modes each scenario runs in: every decision asked of the store (denials not remembered, no
#: leases: the local path off), the exact denial cache alone (leases off: the default of 0.1), and
#: the local path as the package ships it (``LocalPathSettings()``: the denial cache, and leases of
#: requests a worker makes often).
MODES = {
    "central": LocalPathSettings(denials=False, leases=False),
    "denials": LocalPathSettings(leases=False),
    "default": LocalPathSettings(),
}
#: The long tail's skew: the k-th most active of its callers makes a share of requests ∝ 1 / k^1.1.
ZIPF_S = 1.1


@dataclass(frozen=True)
class Scenario:
    name: str
    #: The policies every request meets, one check each: the first is the caller's own, on the
    #: caller; the others' subjects are the caller's user, its organisation (one per ``orgs``
    #: callers) and one of ``endpoints`` endpoints, in that order.
    policies: tuple[Policy, ...]
    #: Threads per process, and each thread's pace (decisions a second; 0: as fast as it can).
    threads: int
    pace: float
    subjects: int
    #: Issue 12's ceiling on Redis script calls per decision for this scenario (None: no regression).
    calls_target: float | None
    #: Callers drawn uniformly in turn (False), or by a Zipf law (True).
    zipf: bool = False
    orgs: int = 20
    endpoints: int = 4


def _policy(name: str, rate: str, burst: int) -> Policy:
    return Policy(name, parse_rate(rate), burst)


#: Four dimensions as a request of the demo meets them: the caller's tier on its API key, its
#: user, its organisation and the endpoint, each roomier than the one before.
FOUR = (
    _policy("tier", "1000/s", 100),
    _policy("user", "2000/s", 200),
    _policy("org", "5000/s", 500),
    _policy("endpoint", "100000/s", 10_000),
)
#: The long tail's: a caller's tier roomy enough that the busiest caller (about a sixth of all
#: requests) is never refused, so that the rows compare leases, not denials.
TAIL = (
    _policy("tier", "1000/s", 1000),
    _policy("user", "2000/s", 2000),
    _policy("org", "5000/s", 5000),
    _policy("endpoint", "100000/s", 10_000),
)

SCENARIOS = [
    Scenario("flood", (_policy("flooded", "100/s", 100),), 2, 0.0, 1, 0.05),
    Scenario("hot", (_policy("hot", "1000/s", 100),), 1, 900 / PROCESSES, 1, 0.10),
    Scenario("hot4", FOUR, 1, 900 / PROCESSES, 1, 0.10),
    Scenario("cold", (_policy("cold", "10/s", 10),), 1, 10_000 / PROCESSES, 10_000, None),
    Scenario("tail", TAIL, 1, 2_000 / PROCESSES, 10_000, None, zipf=True, orgs=500),
]


class Store:
    """What the workers decide against: one private ``redis-server``, or a private cluster (``cluster``)."""

    def __init__(self, cluster: bool) -> None:
        self._cluster = Cluster() if cluster else None
        self._server = None if cluster else RedisServer()

    def __enter__(self) -> Store:
        if self._cluster is not None:
            self._cluster.start()
        else:
            assert self._server is not None
            self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cluster is not None:
            self._cluster.stop()
        elif self._server is not None:
            self._server.stop()

    @property
    def url(self) -> str:
        """The workers' URL: the server's, or the cluster's (``redis+cluster://``)."""
        return self._cluster.url if self._cluster is not None else self.servers[0].url

    @property
    def servers(self) -> list[RedisServer]:
        """The servers that decide: the one, or the cluster's masters (whose figures are summed)."""
        if self._cluster is not None:
            return self._cluster.masters()
        assert self._server is not None
        return [self._server]


def limiter_for(url: str, mode: str) -> Limiter:
    """A worker's limiter, as ``ratelimits.engine.limiter`` builds one, with the local path of ``mode``."""
    breaker = CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=2.0)
    client = make_client(url, 1.0, 1.0)
    backend = ClusterBackend(client) if parse_redis_url(url).cluster else RedisBackend(client)  # type: ignore[arg-type]
    return build_limiter(backend, breaker, MODES[mode], usage_cap=100)


def requests_of(scenario: Scenario) -> list[list[Check]]:
    """Each caller's request: one check per policy of the scenario."""
    requests = []
    for i in range(scenario.subjects):
        subjects = (
            Subject(SubjectKind.API_KEY, f"{scenario.name}-{i}"),
            Subject(SubjectKind.USER, f"{scenario.name}-u{i}"),
            Subject(SubjectKind.ORG, f"{scenario.name}-o{i % scenario.orgs}"),
            Subject(SubjectKind.ENDPOINT, f"{scenario.name}-e{i % scenario.endpoints}"),
        )
        requests.append([Check(policy, subject) for policy, subject in zip(scenario.policies, subjects, strict=False)])
    return requests


def order_of(scenario: Scenario, offset: int, count: int) -> list[int]:
    """The callers a thread asks for, in order: in turn from ``offset``, or drawn by the Zipf law (seeded)."""
    if not scenario.zipf:
        return [(offset + n) % scenario.subjects for n in range(count)]
    weights = [1 / (k + 1) ** ZIPF_S for k in range(scenario.subjects)]
    return random.Random(offset).choices(
        range(scenario.subjects), cum_weights=list(itertools.accumulate(weights)), k=count
    )


def _thread(
    scenario: Scenario,
    limiter: Limiter,
    requests: list[list[Check]],
    offset: int,
    seconds: float,
    go: Any,
    out: list[tuple[int, int, bool]],
) -> None:
    # Drawn before the start line, as many as the thread can ask for (an unpaced one: generously).
    order = order_of(scenario, offset, int((scenario.pace or 20_000) * (seconds + 1)))
    limiter.backend.decide(requests[0][:1], consume=False)  # connected before the start line
    go.wait(START_TIMEOUT_S)
    clock = time.perf_counter
    began = clock()
    interval = 1 / scenario.pace if scenario.pace else 0.0
    n = 0
    while True:
        now = clock()
        if now - began >= seconds:
            break
        if interval:
            due = began + n * interval
            if due > now:
                time.sleep(due - now)  # pacing the offered load (the bench's own schedule)
        checks = requests[order[n % len(order)]]
        t0 = time.perf_counter_ns()
        decision = limiter.decide(checks)
        out.append((time.perf_counter_ns() - t0, decision.allowed, decision.local is not None))
        limiter.return_leases()  # after the response, as request_finished does
        n += 1


def process_main(scenario: Scenario, mode: str, url: str, index: int, seconds: float, go: Any, reports: Any) -> None:
    limiter = limiter_for(url, mode)
    requests = requests_of(scenario)
    outs: list[list[tuple[int, int, bool]]] = [[] for _ in range(scenario.threads)]
    threads = [
        threading.Thread(
            target=_thread,
            args=(scenario, limiter, requests, (index * 7919 + t * 104729), seconds, go, outs[t]),
        )
        for t in range(scenario.threads)
    ]
    cpu = time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(START_TIMEOUT_S + seconds + 30)
    reports.put((time.process_time() - cpu, [sample for out in outs for sample in out]))


def _redis_time_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def _script_calls_and_cpu(clients: list[redis.Redis]) -> tuple[int, float]:
    """Script calls run and CPU seconds used, summed over ``clients``' servers."""
    calls, cpu_s = 0, 0.0
    for client in clients:
        stats = client.info("commandstats")
        calls += sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("fcall", "evalsha", "eval"))
        cpu = client.info("cpu")
        cpu_s += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return calls, cpu_s


def run(scenario: Scenario, mode: str, store: Store, seconds: float) -> dict[str, Any]:
    admins = [server.client() for server in store.servers]
    for admin in admins:
        admin.flushall()
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Barrier(PROCESSES * scenario.threads + 1)
    reports = ctx.Queue()
    children = [
        ctx.Process(target=process_main, args=(scenario, mode, store.url, i, seconds, go, reports), daemon=True)
        for i in range(PROCESSES)
    ]
    for child in children:
        child.start()
    try:
        go.wait(START_TIMEOUT_S)
        began_us = _redis_time_us(admins[0])
        calls_before, cpu_before = _script_calls_and_cpu(admins)
        reported = [reports.get(timeout=START_TIMEOUT_S + seconds + 60) for _ in children]
        samples = [sample for _, part in reported for sample in part]
        client_cpu_s = sum(cpu for cpu, _ in reported)
        calls_after, cpu_after = _script_calls_and_cpu(admins)
        elapsed_us = _redis_time_us(admins[0]) - began_us
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.terminate()
        for admin in admins:
            admin.close()
    decisions = len(samples)
    admitted = sum(allowed for _, allowed, _ in samples)
    policy = scenario.policies[0]  # the bound of the callers' own limit (with one caller, the one that binds)
    bound = (
        scenario.subjects * policy.burst + scenario.subjects * elapsed_us * policy.rate.limit // policy.rate.period_us
    )
    latencies = sorted(ns for ns, _, _ in samples)
    local = sorted(ns for ns, _, answered in samples if answered)
    # Less the warm-up peeks (one call each: a peek of the first check, on one node).
    calls = calls_after - calls_before - PROCESSES * scenario.threads
    return {
        "scenario": scenario.name,
        "mode": mode,
        "decisions": decisions,
        "admitted": admitted,
        "admitted_share": round(admitted / decisions, 4) if decisions else 0.0,
        "local_share": round(len(local) / decisions, 4) if decisions else 0.0,
        "local_p50_us": round(percentile(local, 50) / 1000, 2) if local else None,
        "bound": bound,
        "over_admitted": max(admitted - bound, 0),
        "script_calls_per_decision": round(calls / decisions, 3),
        "redis_cpu_us_per_decision": round((cpu_after - cpu_before) * 1e6 / decisions, 1),
        # The workers' own CPU (their Python, the client's packing and parsing) per decision.
        "client_cpu_us_per_decision": round(client_cpu_s * 1e6 / decisions, 1),
        "p50_us": round(percentile(latencies, 50) / 1000, 1),
        "p99_us": round(percentile(latencies, 99) / 1000, 1),
        "calls_target": scenario.calls_target,
    }


def ping_p50_us(store: Store, count: int = 5000) -> float:
    """A bare PING's round trip (p50), on one redis-py connection of this process (to a master, on a cluster)."""
    client = redis.Redis.from_url(store.servers[0].url, single_connection_client=True)
    try:
        client.ping()
        samples = []
        for _ in range(count):
            t0 = time.perf_counter_ns()
            client.ping()
            samples.append(time.perf_counter_ns() - t0)
    finally:
        client.close()
    return percentile(sorted(samples), 50) / 1000


def local_decisions_p50_us(store: Store, count: int = 5000) -> dict[str, float]:
    """The p50 of a decision answered from memory, a denial and a lease, in this process alone (no other load)."""
    limiter = limiter_for(store.url, "default")
    refused = Check(Policy("spent", parse_rate("1/h"), 1), Subject(SubjectKind.API_KEY, "p50-denial"))
    limiter.decide([refused])
    leased = Check(Policy("roomy", parse_rate("1000000/s"), 1_000_000), Subject(SubjectKind.API_KEY, "p50-lease"))
    figures = {}
    for name, check in (("denial", refused), ("lease", leased)):
        samples = []
        while len(samples) < count:
            t0 = time.perf_counter_ns()
            decision = limiter.decide([check])
            elapsed = time.perf_counter_ns() - t0
            if decision.local is not None:
                samples.append(elapsed)
            else:
                limiter.return_leases()  # a store call (a new lease), not counted: off the sample
        figures[name] = percentile(sorted(samples), 50) / 1000
    return figures


def bookkeeping_us(store: Store, count: int = 10_000) -> float:
    """What the local path adds to a decision it cannot answer (a cold key's), its own steps timed alone.

    The cold scenario's end-to-end figures are within this machine's noise of each other; this
    is the overhead itself: looking for a denial and a lease, counting the request's resolution, learning
    from the store's answer.
    """
    limiter = limiter_for(store.url, "default")
    local = limiter.local_path
    assert local is not None
    checks = [
        Check(Policy("cold", parse_rate("10/s"), 10), Subject(SubjectKind.API_KEY, f"b{i}")) for i in range(count)
    ]
    answer = limiter.decide(checks[:1])
    passes = []
    for _ in range(2):  # the second pass is timed: the first grows the process's dicts
        t0 = time.perf_counter_ns()
        for check in checks:
            one = [check]
            local.refuse(one)
            local.spend(one)
            local.wants(one)
            local.learn(answer, 0.0, local.generation)
        passes.append((time.perf_counter_ns() - t0) / count / 1000)
    return passes[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_keys", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="each scenario's length (default 3)")
    names = [scenario.name for scenario in SCENARIOS]
    parser.add_argument("--scenarios", nargs="+", choices=names, default=names, help="which to run (default: all)")
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="in which modes (default: all)"
    )
    parser.add_argument(
        "--cluster", action="store_true", help="decide on a private Redis Cluster (3 masters) instead of one Redis"
    )
    args = parser.parse_args(argv)
    rows = []
    with Store(args.cluster) as store:
        for scenario in SCENARIOS:
            if scenario.name not in args.scenarios:
                continue
            for mode in args.modes:
                print(f"running {scenario.name} ({mode}) for {args.seconds:.0f} s", file=sys.stderr)
                rows.append(run(scenario, mode, store, args.seconds))
        ping = ping_p50_us(store)
        quiet = local_decisions_p50_us(store)
        overhead = bookkeeping_us(store)
    if args.cluster:
        print("on a Redis Cluster of 3 masters: script calls and Redis CPU summed over the masters")
    print(
        f"{'scenario':9} {'mode':8} {'decisions':>10} {'admitted':>9} {'share':>6} {'bound':>8} {'over':>5} "
        f"{'calls/dec':>10} {'redis µs':>9} {'client µs':>10} {'p50 µs':>7} {'p99 µs':>7} {'local':>6}  "
        "target (issues 12, 28)"
    )
    for row in rows:
        target = row["calls_target"]
        goal = f"≤ {target} calls/decision" if target is not None else "no regression"
        if row["scenario"] in ("hot", "hot4"):
            goal += ", ≥ 95 % admitted"
        print(
            f"{row['scenario']:9} {row['mode']:8} {row['decisions']:>10,} {row['admitted']:>9,} "
            f"{row['admitted_share']:>6.1%} {row['bound']:>8,} {row['over_admitted']:>5} "
            f"{row['script_calls_per_decision']:>10.3f} {row['redis_cpu_us_per_decision']:>9.1f} "
            f"{row['client_cpu_us_per_decision']:>10.1f} "
            f"{row['p50_us']:>7.1f} {row['p99_us']:>7.1f} {row['local_share']:>6.1%}  {goal}"
        )
    central = {row["scenario"]: row for row in rows if row["mode"] == "central"}
    print("\nthe local path as shipped (default) over the central path, per decision (issue 28: no worse on the tail):")
    for row in rows:
        base = central.get(row["scenario"])
        if row["mode"] != "default" or base is None:
            continue
        worker = row["client_cpu_us_per_decision"] / base["client_cpu_us_per_decision"]
        store = row["redis_cpu_us_per_decision"] / max(base["redis_cpu_us_per_decision"], 0.1)
        calls = row["script_calls_per_decision"] / base["script_calls_per_decision"]
        print(f"  {row['scenario']:6} worker CPU {worker:5.2f}x, Redis CPU {store:5.2f}x, script calls {calls:5.2f}x")
    print(
        f"\nthe local path's own steps for a decision it cannot answer (cold keys): {overhead:.2f} µs, "
        f"{overhead / ping:.3f}x a PING"
    )
    print(f"bare PING p50 {ping:.1f} µs; a decision answered from memory, in one quiet process:")
    for name, p50 in quiet.items():
        print(f"  {name:7} p50 {p50:6.2f} µs = {p50 / ping:.3f}x a PING (target ≤ 0.3x)")
    for row in rows:
        if row["mode"] != "central" and row["local_p50_us"] is not None:
            print(
                f"  under the {row['scenario']} scenario's load ({row['mode']}; 4 processes, 2 cores): "
                f"p50 {row['local_p50_us']} µs"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
