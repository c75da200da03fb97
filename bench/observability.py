"""``python -m bench.observability``: what the metrics and every policy's headers add to a decision.

Two measurements, side by side in one run, on a private ``redis-server`` (never the shared one):

1. The 4-dimension throttle end to end, as ``python -m bench`` times it, in interleaved rounds:
   as before issue 15 (``METRICS`` off, ``HEADER_POLICIES: "closest"``) and observed (``METRICS``
   on in prometheus-client's multiprocess mode, every policy in ``RateLimit-Policy``). The p50s
   and their difference, per round and overall: on Redis, then on the ``memory`` backend. Both
   settings send Redis the same script call, so the memory backend's rounds time the same added
   work without the round trip, whose noise on a VM is several times the 5 µs being looked for.
   With ``--split``, the memory backend's rounds also time each change alone.
2. The added steps alone, on a real 4-check decision, in tight loops: ``rate_limit_headers`` with
   every policy (and with ``pk``) minus with the closest only; the metrics' record of a decision.

Target (issue 15): metrics and multi-policy headers add at most 5 µs per decision, end to end.
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

from .support.redis_server import RedisServer

TARGET_US = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=_positive, help="interleaved rounds on Redis (default 12; quick 4)")
    parser.add_argument(
        "--iterations", type=_positive, help="decisions per setting per round (default 3000; quick 1000)"
    )
    parser.add_argument(
        "--memory-rounds", type=_positive, help="interleaved rounds on the memory backend (default 96; quick 16)"
    )
    parser.add_argument(
        "--memory-iterations", type=_positive, help="decisions per setting per memory round (default 500)"
    )
    parser.add_argument(
        "--split", action="store_true", help="on the memory backend, also the metrics alone and the headers alone"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (the defaults marked quick)")
    args = parser.parse_args(argv)
    # What is given wins; the rest is the default, or the quick one.
    defaults = {
        "rounds": (12, 4),
        "iterations": (3000, 1000),
        "memory_rounds": (96, 16),
        "memory_iterations": (500, 500),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    directory = tempfile.mkdtemp(prefix="ratelimits-bench-metrics-")
    # Before prometheus-client is imported: the values go to files, as in a gunicorn worker.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    server = RedisServer()
    try:
        server.start()
        return run(args, server)
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def run(args: argparse.Namespace, server: RedisServer) -> int:
    redis_url = f"redis://127.0.0.1:{server.port}/0"
    from .settings import configure, ratelimits_settings

    configure(redis_url, f"redis://127.0.0.1:{server.port}/1")

    from . import scenarios as sc

    requests = sc.build_requests()
    view = sc.BenchView()
    call = sc.ratelimits_throttle(requests, view)
    base = ratelimits_settings(redis_url, dimensions=4)
    on_redis = rounds(call, len(requests), variants(base), args.rounds, args.iterations)
    print()
    # Many short rounds: the VM's speed moves by 2x within minutes, and the settings of a round
    # are timed about 0.1 s apart (each warms for 1,124 calls first), so the move mostly cancels.
    memory = variants({**base, "BACKEND": "memory"}, split=args.split)
    on_memory = rounds(call, len(requests), memory, args.memory_rounds, args.memory_iterations)
    steps = added_steps(redis_url, requests, view)
    total = steps["headers_all"] + steps["metrics_record"]
    ping = ping_us(server)
    print(
        f"the added steps alone: every policy's headers {steps['headers_all']:+.2f} µs "
        f"(with pk {steps['headers_pk']:+.2f} µs), the metrics' record {steps['metrics_record']:.2f} µs; "
        f"together {total:.2f} µs"
    )
    # This VM's speed moves by 2x within minutes: the steps against a bare PING of the same run say
    # what they cost where a PING takes what it took in earlier runs.
    print(f"a bare PING p50 in this run: {ping:.1f} µs; the steps are {total / ping:.3f} of it")
    end_to_end = on_memory["observed"]
    print(
        f"end to end without the round trip (the memory backend): {end_to_end:+.1f} µs, "
        f"target <= {TARGET_US:g} µs: {'met' if end_to_end <= TARGET_US else 'MISSED'}; "
        f"on Redis {on_redis['observed']:+.1f} µs (with the round trip's noise: see the middle half of its rounds)"
    )
    return 0


def variants(base: dict[str, Any], *, split: bool = False) -> dict[str, dict[str, Any]]:
    """RATELIMITS as before issue 15 (first: what the others are compared with) and observed;
    with ``split``, also each of the two changes alone."""

    def setting(policies: str, metrics: bool) -> dict[str, Any]:
        return {**base, "HEADERS": {**base.get("HEADERS", {}), "POLICIES": policies}, "METRICS": metrics}

    configs = {"before": setting("closest", False)}
    if split:
        configs["metrics"] = setting("closest", True)
        configs["headers"] = setting("all", False)
    configs["observed"] = setting("all", True)
    return configs


def rounds(
    call: Any, subjects: int, configs: dict[str, dict[str, Any]], count: int, iterations: int
) -> dict[str, float]:
    """``count`` rounds of the throttle under each of ``configs``, in an order reversed every other
    round; prints each round and a summary, and returns each config's median p50 difference from
    the first config's, in µs."""
    from django.test import override_settings

    from .runner import timed_block

    backend = next(iter(configs.values()))["BACKEND"]

    def block(config: dict[str, Any], offset: int) -> float:
        with override_settings(RATELIMITS=config):
            # Untimed: the settings' objects built, the connection warm, and every subject's checks
            # and header parts made once (a server's callers come back: its memos are warm).
            warm = subjects + 100
            for i in range(warm):
                call(offset + i)
            samples, _ = timed_block(call, offset + warm, iterations)
        return statistics.median(samples) / 1000

    names = list(configs)
    baseline = names[0]
    p50s: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(count):
        order = names if round_number % 2 == 0 else names[::-1]
        p50 = {name: block(configs[name], round_number * 10_000) for name in order}
        for name in names:
            p50s[name].append(p50[name])
        timed = ", ".join(f"{name} {p50[name]:.1f} µs" for name in names)
        print(f"{backend} round {round_number + 1}: {timed}")

    medians: dict[str, float] = {}
    for name in names[1:]:
        differences = [b - a for a, b in zip(p50s[baseline], p50s[name], strict=True)]
        medians[name] = difference = statistics.median(differences)
        # Inclusive: the quartiles of the rounds themselves, never beyond them (a few rounds).
        low, _, high = statistics.quantiles(differences, n=4, method="inclusive") if count > 1 else (difference,) * 3
        print(
            f"throttle p50 on {backend}, 4 dimensions, median of {count} rounds x {iterations}: "
            f"{baseline} {statistics.median(p50s[baseline]):.1f} µs, {name} {statistics.median(p50s[name]):.1f} µs; "
            f"difference median {difference:+.1f} µs (middle half of the rounds {low:+.1f} to {high:+.1f}, "
            f"all {min(differences):+.1f} to {max(differences):+.1f})"
        )
    return medians


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
        "closest": {"HEADERS": {"POLICIES": "closest"}},
        "all": {"HEADERS": {"POLICIES": "all"}},
        "pk": {"HEADERS": {"POLICIES": "all", "PARTITION_KEY": True}},
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
