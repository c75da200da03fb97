"""``python -m bench.hot_keys``: what hot and flooded keys cost the central path, in Redis script calls.

The baseline for the local fast path (issue 12): today every decision is one script call, the ones
certain to be refused included. Four worker processes decide against a private ``redis-server``
(a free loopback port, stopped by PID) in three scenarios, each for a few seconds:

- ``flood``: one key limited to 100/s (burst 100), asked as fast as 4 processes x 2 threads can;
- ``hot``: one key limited to 1,000/s (burst 100), offered 90 % of its rate, paced;
- ``cold``: 10,000 subjects, each asked about once a second, paced.

For each it prints the decisions made, those admitted against ``burst + rate x elapsed`` (Redis
``TIME`` around the run; any excess is over-admission), Redis script calls and Redis CPU per
decision, and the decision latency (p50/p99). Targets of issue 12 are printed beside the figures.
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
from ratelimits.identity import Subject, SubjectKind  # noqa: E402
from ratelimits.policies.values import Check, Policy  # noqa: E402
from ratelimits.rates import parse_rate  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

from .stats import percentile  # noqa: E402

PROCESSES = 4
START_TIMEOUT_S = 60.0


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


def _thread(
    scenario: Scenario, checks: list[Check], offset: int, seconds: float, go: Any, out: list[tuple[int, int]]
) -> None:
    backend = RedisBackend(make_client(os.environ["BENCH_REDIS_URL"], 1.0, 1.0))
    backend.decide(checks[:1], consume=False)  # connected before the start line
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
        allowed = backend.decide([check]).allowed
        out.append((time.perf_counter_ns() - t0, allowed))
        n += 1


def process_main(scenario: Scenario, url: str, index: int, seconds: float, go: Any, reports: Any) -> None:
    os.environ["BENCH_REDIS_URL"] = url
    subjects = [Subject(SubjectKind.API_KEY, f"{scenario.name}-{i}") for i in range(scenario.subjects)]
    checks = [Check(scenario.policy, subject) for subject in subjects]
    outs: list[list[tuple[int, int]]] = [[] for _ in range(scenario.threads)]
    threads = [
        threading.Thread(target=_thread, args=(scenario, checks, (index * 7919 + t * 104729), seconds, go, outs[t]))
        for t in range(scenario.threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(START_TIMEOUT_S + seconds + 30)
    reports.put([sample for out in outs for sample in out])


def _redis_time_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def _script_calls_and_cpu(client: redis.Redis) -> tuple[int, float]:
    stats = client.info("commandstats")
    calls = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))
    cpu = client.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def run(scenario: Scenario, server: RedisServer, seconds: float) -> dict[str, Any]:
    admin = server.client()
    admin.flushall()
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Barrier(PROCESSES * scenario.threads + 1)
    reports = ctx.Queue()
    children = [
        ctx.Process(target=process_main, args=(scenario, server.url, i, seconds, go, reports), daemon=True)
        for i in range(PROCESSES)
    ]
    for child in children:
        child.start()
    try:
        go.wait(START_TIMEOUT_S)
        began_us = _redis_time_us(admin)
        calls_before, cpu_before = _script_calls_and_cpu(admin)
        samples = [sample for _ in children for sample in reports.get(timeout=START_TIMEOUT_S + seconds + 60)]
        calls_after, cpu_after = _script_calls_and_cpu(admin)
        elapsed_us = _redis_time_us(admin) - began_us
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.terminate()
        admin.close()
    decisions = len(samples)
    admitted = sum(allowed for _, allowed in samples)
    policy = scenario.policy
    bound = (
        scenario.subjects * policy.burst + scenario.subjects * elapsed_us * policy.rate.limit // policy.rate.period_us
    )
    latencies = sorted(ns for ns, _ in samples)
    calls = calls_after - calls_before - PROCESSES * scenario.threads  # less the warm-up peeks
    return {
        "scenario": scenario.name,
        "decisions": decisions,
        "admitted": admitted,
        "bound": bound,
        "over_admitted": max(admitted - bound, 0),
        "script_calls_per_decision": round(calls / decisions, 3),
        "redis_cpu_us_per_decision": round((cpu_after - cpu_before) * 1e6 / decisions, 1),
        "p50_us": round(percentile(latencies, 50) / 1000, 1),
        "p99_us": round(percentile(latencies, 99) / 1000, 1),
        "calls_target": scenario.calls_target,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_keys", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="each scenario's length (default 3)")
    args = parser.parse_args(argv)
    rows = []
    with RedisServer() as server:
        for scenario in SCENARIOS:
            print(f"running {scenario.name} for {args.seconds:.0f} s", file=sys.stderr)
            rows.append(run(scenario, server, args.seconds))
    print(f"{'scenario':9} {'decisions':>10} {'admitted':>9} {'bound':>8} {'over':>5} {'calls/dec':>10} "
          f"{'cpu µs/dec':>11} {'p50 µs':>7} {'p99 µs':>7}  issue-12 target")  # fmt: skip
    for row in rows:
        target = row["calls_target"]
        goal = f"≤ {target} calls/decision" if target is not None else "no regression"
        print(
            f"{row['scenario']:9} {row['decisions']:>10,} {row['admitted']:>9,} {row['bound']:>8,} "
            f"{row['over_admitted']:>5} {row['script_calls_per_decision']:>10.3f} "
            f"{row['redis_cpu_us_per_decision']:>11.1f} {row['p50_us']:>7.1f} {row['p99_us']:>7.1f}  {goal}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
