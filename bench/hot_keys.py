"""``python -m bench.hot_keys``: what hot, flooded and cold keys cost, on the central path and the local one.

Four worker processes decide through a limiter each against a private ``redis-server`` (a free
loopback port, stopped by PID) in three scenarios, each for a few seconds, once asking the store
every time (``central``) and once with the local fast path (``local``: the exact denial cache and
token leases, :mod:`ratelimits.engine.local`), side by side in one run:

- ``flood``: one key limited to 100/s (burst 100), asked as fast as 4 processes x 2 threads can
  (far beyond 20x its limit);
- ``hot``: one key limited to 1,000/s (burst 100), offered 90 % of its rate, paced;
- ``cold``: 10,000 subjects, each asked about once a second, paced.

For each it prints the decisions made, those admitted against ``burst + rate x elapsed`` (Redis
``TIME`` around the run; any excess is over-admission) and as a share of those offered, Redis
script calls, Redis CPU and the workers' own CPU per decision, and the decision latency (p50/p99). Then the p50 of the
decisions answered from memory against a bare PING measured in the same run. Targets of issue 12
are printed beside the figures.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

import redis  # noqa: E402  (after django.setup)

from ratelimits.backends.redis import RedisBackend, make_client  # noqa: E402
from ratelimits.conf import LocalPathSettings  # noqa: E402
from ratelimits.engine.breaker import CircuitBreaker  # noqa: E402
from ratelimits.engine.limiter import Limiter, build_limiter  # noqa: E402
from ratelimits.identity import Subject, SubjectKind  # noqa: E402
from ratelimits.policies.values import Check, Policy  # noqa: E402
from ratelimits.rates import parse_rate  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

from .stats import percentile  # noqa: E402

PROCESSES = 4
START_TIMEOUT_S = 60.0
#: The local path as the bench runs it: denials remembered, and leases of up to a quarter of a burst.
LOCAL = LocalPathSettings(leases=True, lease_share=0.25)
MODES = ("central", "local")


@dataclass(frozen=True)
class Scenario:
    name: str
    policy: Policy
    #: Threads per process, and each thread's pace (decisions a second; 0: as fast as it can).
    threads: int
    pace: float
    subjects: int
    #: Issue 12's ceiling on Redis script calls per decision for this scenario (None: no regression).
    calls_target: float | None


SCENARIOS = [
    Scenario("flood", Policy("flooded", parse_rate("100/s"), 100), 2, 0.0, 1, 0.05),
    Scenario("hot", Policy("hot", parse_rate("1000/s"), 100), 1, 900 / PROCESSES, 1, 0.10),
    Scenario("cold", Policy("cold", parse_rate("10/s"), 10), 1, 10_000 / PROCESSES, 10_000, None),
]


def limiter_for(url: str, mode: str) -> Limiter:
    """A worker's limiter, as ``ratelimits.engine.limiter`` builds one: with the local path, or without."""
    breaker = CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=2.0)
    settings = LOCAL if mode == "local" else LocalPathSettings(denials=False)
    return build_limiter(RedisBackend(make_client(url, 1.0, 1.0)), breaker, settings, usage_cap=100)


def _thread(
    scenario: Scenario,
    limiter: Limiter,
    checks: list[Check],
    offset: int,
    seconds: float,
    go: Any,
    out: list[tuple[int, int, bool]],
) -> None:
    limiter.backend.decide(checks[:1], consume=False)  # connected before the start line
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
        check = checks[(offset + n) % len(checks)]
        t0 = time.perf_counter_ns()
        decision = limiter.decide([check])
        out.append((time.perf_counter_ns() - t0, decision.allowed, decision.local is not None))
        limiter.return_leases()  # after the response, as request_finished does
        n += 1


def process_main(scenario: Scenario, mode: str, url: str, index: int, seconds: float, go: Any, reports: Any) -> None:
    limiter = limiter_for(url, mode)
    subjects = [Subject(SubjectKind.API_KEY, f"{scenario.name}-{i}") for i in range(scenario.subjects)]
    checks = [Check(scenario.policy, subject) for subject in subjects]
    outs: list[list[tuple[int, int, bool]]] = [[] for _ in range(scenario.threads)]
    threads = [
        threading.Thread(
            target=_thread,
            args=(scenario, limiter, checks, (index * 7919 + t * 104729), seconds, go, outs[t]),
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


def _script_calls_and_cpu(client: redis.Redis) -> tuple[int, float]:
    stats = client.info("commandstats")
    calls = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("fcall", "evalsha", "eval"))
    cpu = client.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def run(scenario: Scenario, mode: str, server: RedisServer, seconds: float) -> dict[str, Any]:
    admin = server.client()
    admin.flushall()
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Barrier(PROCESSES * scenario.threads + 1)
    reports = ctx.Queue()
    children = [
        ctx.Process(target=process_main, args=(scenario, mode, server.url, i, seconds, go, reports), daemon=True)
        for i in range(PROCESSES)
    ]
    for child in children:
        child.start()
    try:
        go.wait(START_TIMEOUT_S)
        began_us = _redis_time_us(admin)
        calls_before, cpu_before = _script_calls_and_cpu(admin)
        reported = [reports.get(timeout=START_TIMEOUT_S + seconds + 60) for _ in children]
        samples = [sample for _, part in reported for sample in part]
        client_cpu_s = sum(cpu for cpu, _ in reported)
        calls_after, cpu_after = _script_calls_and_cpu(admin)
        elapsed_us = _redis_time_us(admin) - began_us
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.terminate()
        admin.close()
    decisions = len(samples)
    admitted = sum(allowed for _, allowed, _ in samples)
    policy = scenario.policy
    bound = (
        scenario.subjects * policy.burst + scenario.subjects * elapsed_us * policy.rate.limit // policy.rate.period_us
    )
    latencies = sorted(ns for ns, _, _ in samples)
    local = sorted(ns for ns, _, answered in samples if answered)
    calls = calls_after - calls_before - PROCESSES * scenario.threads  # less the warm-up peeks
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


def ping_p50_us(server: RedisServer, count: int = 5000) -> float:
    """A bare PING's round trip (p50), on one redis-py connection of this process."""
    client = redis.Redis.from_url(server.url, single_connection_client=True)
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


def local_decisions_p50_us(server: RedisServer, count: int = 5000) -> dict[str, float]:
    """The p50 of a decision answered from memory, a denial and a lease, in this process alone (no other load)."""
    limiter = limiter_for(server.url, "local")
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


def bookkeeping_us(server: RedisServer, count: int = 10_000) -> float:
    """What the local path adds to a decision it cannot answer (a cold key's), its own steps timed alone.

    The cold scenario's end-to-end figures are within this machine's noise of each other; this
    is the overhead itself: looking for a denial and a lease, counting the key's rate, learning
    from the store's answer.
    """
    limiter = limiter_for(server.url, "local")
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
    args = parser.parse_args(argv)
    rows = []
    with RedisServer() as server:
        for scenario in SCENARIOS:
            for mode in MODES:
                print(f"running {scenario.name} ({mode}) for {args.seconds:.0f} s", file=sys.stderr)
                rows.append(run(scenario, mode, server, args.seconds))
        ping = ping_p50_us(server)
        quiet = local_decisions_p50_us(server)
        overhead = bookkeeping_us(server)
    print(
        f"{'scenario':9} {'mode':8} {'decisions':>10} {'admitted':>9} {'share':>6} {'bound':>8} {'over':>5} "
        f"{'calls/dec':>10} {'redis µs':>9} {'client µs':>10} {'p50 µs':>7} {'p99 µs':>7} {'local':>6}  "
        "issue-12 target"
    )
    for row in rows:
        target = row["calls_target"]
        goal = f"≤ {target} calls/decision" if target is not None else "no regression"
        if row["scenario"] == "hot":
            goal += ", ≥ 95 % admitted"
        print(
            f"{row['scenario']:9} {row['mode']:8} {row['decisions']:>10,} {row['admitted']:>9,} "
            f"{row['admitted_share']:>6.1%} {row['bound']:>8,} {row['over_admitted']:>5} "
            f"{row['script_calls_per_decision']:>10.3f} {row['redis_cpu_us_per_decision']:>9.1f} "
            f"{row['client_cpu_us_per_decision']:>10.1f} "
            f"{row['p50_us']:>7.1f} {row['p99_us']:>7.1f} {row['local_share']:>6.1%}  {goal}"
        )
    print(
        f"\nthe local path's own steps for a decision it cannot answer (cold keys): {overhead:.2f} µs, "
        f"{overhead / ping:.3f}x a PING"
    )
    print(f"bare PING p50 {ping:.1f} µs; a decision answered from memory, in one quiet process:")
    for name, p50 in quiet.items():
        print(f"  {name:7} p50 {p50:6.2f} µs = {p50 / ping:.3f}x a PING (target ≤ 0.3x)")
    for row in rows:
        if row["mode"] == "local" and row["local_p50_us"] is not None:
            print(f"  under the {row['scenario']} scenario's load (4 processes, 2 cores): p50 {row['local_p50_us']} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
