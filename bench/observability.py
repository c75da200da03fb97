"""``python -m bench.observability``: what the metrics and every policy's headers add to a decision.

Two measurements, side by side in one run, on a private ``redis-server`` (never the shared one):

1. The 4-dimension throttle end to end, as ``python -m bench`` times it, in interleaved rounds:
   as before issue 15 (``METRICS`` off, ``HEADER_POLICIES: "closest"``) and observed (``METRICS``
   on in prometheus-client's multiprocess mode, every policy in ``RateLimit-Policy``). The p50s
   and their difference, per round and overall.
2. The added steps alone, on a real 4-check decision, in tight loops: ``rate_limit_headers`` with
   every policy (and with ``pk``) minus with the closest only; the metrics' record of a decision.
   These carry none of the round trip's noise.

Target (issue 15): metrics and multi-policy headers add at most 5 µs per decision.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import timeit
from typing import Any

from tests.support.redis_server import RedisServer

TARGET_US = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds (default 12)")
    parser.add_argument("--iterations", type=int, default=3000, help="decisions per scenario per round")
    parser.add_argument("--quick", action="store_true", help="4 rounds of 1,000")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.iterations = 4, 1000
    directory = tempfile.mkdtemp(prefix="ratelimits-bench-metrics-")
    # Before prometheus-client is imported: the values go to files, as in a gunicorn worker.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    server = RedisServer()
    try:
        server.start()
        return run(args, server)
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, server: RedisServer) -> int:
    redis_url = f"redis://127.0.0.1:{server.port}/0"
    from .settings import configure, ratelimits_settings

    configure(redis_url, f"redis://127.0.0.1:{server.port}/1")
    from django.test import override_settings

    from . import scenarios as sc

    requests = sc.build_requests()
    view = sc.BenchView()
    base = ratelimits_settings(redis_url, dimensions=4)
    before = {**base, "HEADER_POLICIES": "closest", "METRICS": False}
    observed = {**base, "HEADER_POLICIES": "all", "METRICS": True}
    call = sc.ratelimits_throttle(requests, view)

    def block(config: dict[str, Any], offset: int) -> float:
        with override_settings(RATELIMITS=config):
            # Untimed: the settings' objects built, the connection warm, and every subject's checks
            # and header parts made once (a server's callers come back: its memos are warm).
            warm = len(requests) + 100
            for i in range(warm):
                call(offset + i)
            samples = []
            clock = time.perf_counter_ns
            for i in range(args.iterations):
                t0 = clock()
                call(offset + warm + i)
                samples.append(clock() - t0)
        return statistics.median(samples) / 1000

    rows: list[tuple[float, float]] = []
    for round_number in range(args.rounds):
        order = [("before", before), ("observed", observed)]
        if round_number % 2:
            order.reverse()
        p50 = {name: block(config, round_number * 10_000) for name, config in order}
        rows.append((p50["before"], p50["observed"]))
        print(f"round {round_number + 1}: before {p50['before']:.1f} µs, observed {p50['observed']:.1f} µs")

    befores, observeds = zip(*rows, strict=True)
    differences = [b - a for a, b in rows]
    print(
        f"\nthrottle p50, 4 dimensions, median of {args.rounds} rounds x {args.iterations}: "
        f"before {statistics.median(befores):.1f} µs, observed {statistics.median(observeds):.1f} µs; "
        f"difference median {statistics.median(differences):+.1f} µs "
        f"(rounds {min(differences):+.1f} to {max(differences):+.1f})"
    )
    steps = added_steps(redis_url, requests, view)
    total = steps["headers_all"] + steps["metrics_record"]
    ping = ping_us(server)
    print(
        f"the added steps alone: every policy's headers +{steps['headers_all']:.2f} µs "
        f"(with pk +{steps['headers_pk']:.2f} µs), the metrics' record {steps['metrics_record']:.2f} µs; "
        f"together {total:.2f} µs, target <= {TARGET_US:g} µs: {'met' if total <= TARGET_US else 'MISSED'}"
    )
    # This VM's speed moves by 2x within minutes: the steps against a bare PING of the same run say
    # what they cost where a PING takes what it took in earlier runs.
    print(f"a bare PING p50 in this run: {ping:.1f} µs; the steps are {total / ping:.3f} of it")
    return 0


def ping_us(server: RedisServer, count: int = 5000) -> float:
    """The p50 of a bare PING on the limiter's kind of client, in µs."""
    from ratelimits.backends.redis import make_client

    client = make_client(f"redis://127.0.0.1:{server.port}/0", 1.0, 1.0)
    clock = time.perf_counter_ns
    samples = []
    for _ in range(count):
        t0 = clock()
        client.ping()
        samples.append(clock() - t0)
    return statistics.median(samples) / 1000


def added_steps(redis_url: str, requests: list[Any], view: Any) -> dict[str, float]:
    """µs each added step costs on one real decision: the best of several runs of 20,000 each."""
    from django.test import override_settings

    from ratelimits.engine import evaluate
    from ratelimits.engine.evaluation import _record
    from ratelimits.headers import rate_limit_headers
    from ratelimits.metrics import get_recorder

    from .settings import SCOPE, ratelimits_settings

    base = ratelimits_settings(redis_url, dimensions=4)
    request = requests[0]
    with override_settings(RATELIMITS={**base, "METRICS": True}):
        _, decision = evaluate(request, endpoint=SCOPE, auth=request.auth, user=request.user)
        assert len(decision.results) == 4, decision
        recorder = get_recorder()
        assert recorder is not None

        def record() -> None:
            _record(recorder, request, SCOPE, decision, 0.0001, decision.shadow_violated)

        metrics_record = best(record)
    figures = {"metrics_record": metrics_record}
    variants = {
        "closest": {"HEADER_POLICIES": "closest"},
        "all": {"HEADER_POLICIES": "all"},
        "pk": {"HEADER_POLICIES": "all", "HEADER_PARTITION_KEY": True},
    }
    timed = dict.fromkeys(variants, float("inf"))
    for _ in range(9):  # interleaved: the VM's speed moves, and moves all three alike
        for name, options in variants.items():
            with override_settings(RATELIMITS={**base, **options}):
                timed[name] = min(timed[name], best(lambda: rate_limit_headers(decision), repeat=1))
    figures["headers_all"] = timed["all"] - timed["closest"]
    figures["headers_pk"] = timed["pk"] - timed["closest"]
    return figures


def best(step: Any, number: int = 20_000, repeat: int = 7) -> float:
    return min(timeit.repeat(step, number=number, repeat=repeat)) / number * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
