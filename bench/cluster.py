"""``python -m bench.cluster``: a decision on a Redis Cluster beside one on a single Redis, and how it spreads.

Starts a private ``redis-server`` with a replica (as a Sentinel deployment has) and a private
six-node cluster (3 masters, 3 replicas; see ``bench/support/redis_cluster.py``) on free loopback
ports, and stops them all by PID. In interleaved rounds it times, one decision at a time on one
thread:

- PING on each topology's client, the floor of any call;
- ``decide`` of one check (the caller's tier rate: one slot group);
- ``decide`` of four dimensions (the caller's tier rate and quota, its IP, its organisation and a
  16-shard endpoint-wide limit: four slot groups on a cluster, sent at once);
- the anchor for those: an Envoy-style pipeline (``INCRBY`` and ``PEXPIRE`` of a fixed window's
  counter per descriptor, the same five keys' slots, one pipeline; on the cluster, redis-py's
  cluster pipeline, one per master it touches), as issue 28 measures the cluster's Redis CPU
  against.

Requests come from a mixed population: 10,000 callers, 2,000 client IPs, 500 organisations and 4
endpoints. For each row it reports client p50/p99, and Redis CPU per decision (``INFO cpu`` of
every master, user + system) in all and per node. Then the spread of script calls over the three
masters for the four-dimension workload: the busiest master's share against the mean (target
<= 1.5). Figures are written to ``bench/results/cluster.json`` too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.support.django_settings")
django.setup()

import redis  # noqa: E402  (after django.setup)

from ratelimits.algorithms import Algorithm  # noqa: E402
from ratelimits.backends.cluster import ClusterBackend  # noqa: E402
from ratelimits.backends.redis import RedisBackend, make_client  # noqa: E402
from ratelimits.identity import Subject, SubjectKind  # noqa: E402
from ratelimits.policies.values import Check, Policy, check_for  # noqa: E402
from ratelimits.rates import parse_rate  # noqa: E402

from .stats import percentile  # noqa: E402
from .support.redis_cluster import Cluster  # noqa: E402
from .support.redis_server import RedisServer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CALLERS, IPS, ORGS, ENDPOINTS = 10_000, 2_000, 500, 4
#: The busiest master's script calls against the mean, for the four-dimension workload.
SPREAD_TARGET = 1.5
#: The row whose script calls per master are counted.
SPREAD_ROW = "cluster: decide, 4 dimensions (4 slot groups)"

TIER = Policy("tier:bench", parse_rate("1000000/s"), 1_000_000)
QUOTA = Policy("tier:bench:quota", parse_rate("1000000000/d"), 1_000_000_000, Algorithm.FIXED_WINDOW)
IP = Policy("ip", parse_rate("1000000/s"), 1_000_000)
ORG = Policy("org", parse_rate("1000000/s"), 1_000_000)
ENDPOINT_WIDE = Policy("endpoint-all:bench", parse_rate("16000000/s"), 16_000_000, shards=16)


def requests(n: int) -> list[tuple[list[Check], list[Check]]]:
    """``n`` requests of the mixed population: (one check, four dimensions), digests computed beforehand."""
    made = []
    for i in range(n):
        caller = Subject(SubjectKind.API_KEY, f"caller-{i % CALLERS}")
        ip = Subject(SubjectKind.IP, f"10.{(i * 7) % IPS // 250}.{(i * 7) % IPS % 250}.1")
        org = Subject(SubjectKind.ORG, f"org-{(i * 13) % ORGS}")
        endpoint = Subject(SubjectKind.ENDPOINT, f"POST /v1/endpoint-{i % ENDPOINTS}")
        one = [Check(TIER, caller)]
        four = [
            Check(TIER, caller),
            Check(QUOTA, caller),
            Check(IP, ip),
            Check(ORG, org),
            check_for(ENDPOINT_WIDE, endpoint, 1),
        ]
        for check in four:
            check.key("rl")
        made.append((one, four))
    return made


class Row:
    """One timed scenario: its call, the servers whose CPU it is charged, and what it measured."""

    def __init__(self, label: str, call: Callable[[int], None], servers: Sequence[redis.Redis]) -> None:
        self.label = label
        self.call = call
        self.servers = servers
        self.samples: list[int] = []
        self.cpu_us = [0.0] * len(servers)

    def block(self, start: int, n: int) -> None:
        gc.collect()
        before = [_cpu_s(s) for s in self.servers]
        clock = time.perf_counter_ns
        call = self.call
        for i in range(start, start + n):
            t0 = clock()
            call(i)
            self.samples.append(clock() - t0)
        for k, server in enumerate(self.servers):
            self.cpu_us[k] += (_cpu_s(server) - before[k]) * 1e6

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.samples)
        n = len(ordered)
        return {
            "decisions": n,
            "p50_us": round(percentile(ordered, 50) / 1000, 1),
            "p99_us": round(percentile(ordered, 99) / 1000, 1),
            "redis_cpu_us_per_decision": round(sum(self.cpu_us) / n, 1),
            "redis_cpu_us_per_decision_per_node": [round(c / n, 1) for c in self.cpu_us],
        }


def _wait_in_sync(replica: RedisServer) -> None:
    client = replica.client()
    try:
        replica.service.wait_until(
            lambda: client.info("replication").get("master_link_status") == "up", 30, "replica in sync"
        )
    finally:
        client.close()


def _cpu_s(server: redis.Redis) -> float:
    info = server.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _script_calls(server: redis.Redis) -> int:
    stats = server.info("commandstats")
    # The decide script is a Function the groups FCALL (EVALSHA where a node refuses Functions).
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("fcall", "evalsha", "eval"))


def decide(backend: RedisBackend, lists: Sequence[list[Check]]) -> Callable[[int], None]:
    mask = len(lists) - 1
    run = backend.decide

    def call(i: int) -> None:
        if not run(lists[i & mask]).allowed:
            raise AssertionError("a bench decision was denied")

    return call


def envoy_style(client: Any, lists: Sequence[list[Check]]) -> Callable[[int], None]:
    """Envoy's ratelimit service as its Redis sees it: per descriptor, ``INCRBY`` and ``PEXPIRE``
    of this second's counter, all in one pipeline (inexact fixed windows, no script)."""
    mask = len(lists) - 1
    keys = [[check.key("envoy") for check in checks] for checks in lists]

    def call(i: int) -> None:
        second = int(time.time())
        pipe = client.pipeline(transaction=False)
        for key in keys[i & mask]:
            counter = f"{key}:{second}"
            pipe.incrby(counter, 1)
            pipe.pexpire(counter, 1000)
        pipe.execute()

    return call


def ping(client: Any) -> Callable[[int], None]:
    def call(i: int) -> None:
        client.ping()

    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=4000, help="decisions per row per round")
    parser.add_argument("--json", type=Path, default=RESULTS / "cluster.json")
    parser.add_argument(
        "--cpu",
        type=int,
        default=0,
        help="pin the bench and every redis-server to this CPU (default 0; -1: no pinning). On a small VM a "
        "wake-up across cores costs more than the work: pinned, both topologies pay the same",
    )
    args = parser.parse_args(argv)
    population = requests(1 << 14)  # a power of two: the calls index it with a mask
    with (
        RedisServer() as single,
        Cluster() as cluster,
        RedisServer(config=("--replicaof", "127.0.0.1", str(single.port))) as replica,
    ):
        _wait_in_sync(replica)
        if args.cpu >= 0:
            for pid in [single.pid, replica.pid, *(s.pid for s in cluster.servers), 0]:
                os.sched_setaffinity(pid, {args.cpu})
        single_admin = single.client()
        masters = [redis.Redis(host="127.0.0.1", port=s.port) for s in cluster.masters()]
        one_node = RedisBackend(make_client(single.url, 1.0, 1.0))  # type: ignore[arg-type]
        on_cluster = ClusterBackend(make_client(cluster.url, 1.0, 1.0))  # type: ignore[arg-type]
        ones, fours = [p[0] for p in population], [p[1] for p in population]
        first_master = masters[0]
        rows = [
            Row("single: PING", ping(one_node.client), [single_admin]),
            Row("single: decide, 1 check", decide(one_node, ones), [single_admin]),
            Row("single: decide, 4 dimensions", decide(one_node, fours), [single_admin]),
            Row("single: Envoy-style, the same 5 keys", envoy_style(one_node.client, fours), [single_admin]),
            Row("cluster: PING (one master)", ping(first_master), masters),
            Row("cluster: decide, 1 check", decide(on_cluster, ones), masters),
            Row("cluster: Envoy-style, the same 5 keys", envoy_style(on_cluster.client, fours), masters),
            Row(SPREAD_ROW, decide(on_cluster, fours), masters),
        ]
        for row in rows:  # warm: connections, script caches, the slot map
            for i in range(2000):
                row.call(i)
        offset = 2000
        spread_calls = [0] * len(masters)
        for r in range(args.rounds):
            order = rows[r % len(rows) :] + rows[: r % len(rows)]
            for row in order:
                before = [_script_calls(m) for m in masters] if row.label == SPREAD_ROW else None
                row.block(offset, args.iterations)
                if before is not None:
                    for k, master in enumerate(masters):
                        spread_calls[k] += _script_calls(master) - before[k]
            offset += args.iterations
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        summaries = {row.label: row.summary() for row in rows}
        mean = sum(spread_calls) / len(spread_calls)
        spread = max(spread_calls) / mean
        report = {
            "rows": summaries,
            "script_calls_per_master_4dim": spread_calls,
            "busiest_master_over_mean": round(spread, 3),
            "groups_per_4dim_decision": round(sum(spread_calls) / (args.rounds * args.iterations), 2),
        }
        for client in (single_admin, *masters):
            client.close()
    print(f"{'row':48} {'p50 µs':>8} {'p99 µs':>8} {'redis cpu µs':>13}  per node")
    for label, s in summaries.items():
        per_node = " ".join(f"{v:5.1f}" for v in s["redis_cpu_us_per_decision_per_node"])
        print(f"{label:48} {s['p50_us']:8.1f} {s['p99_us']:8.1f} {s['redis_cpu_us_per_decision']:13.1f}  {per_node}")
    single4, cluster4 = (
        summaries["single: decide, 4 dimensions"],
        summaries[SPREAD_ROW],
    )
    print(
        f"\ncluster / single, 4 dimensions: p50 {cluster4['p50_us'] / single4['p50_us']:.2f}x, "
        f"Redis CPU {cluster4['redis_cpu_us_per_decision'] / single4['redis_cpu_us_per_decision']:.2f}x"
    )
    envoy_single, envoy_cluster = (
        summaries["single: Envoy-style, the same 5 keys"],
        summaries["cluster: Envoy-style, the same 5 keys"],
    )
    report["redis_cpu_4dim_over_envoy"] = {
        "single": round(single4["redis_cpu_us_per_decision"] / envoy_single["redis_cpu_us_per_decision"], 2),
        "cluster": round(cluster4["redis_cpu_us_per_decision"] / envoy_cluster["redis_cpu_us_per_decision"], 2),
    }
    print(
        "Redis CPU per 4-dimension decision over the Envoy-style pipeline's: "
        f"single {report['redis_cpu_4dim_over_envoy']['single']:.2f}x, "
        f"cluster {report['redis_cpu_4dim_over_envoy']['cluster']:.2f}x (issue 28's target on the cluster: <= 1.5)"
    )
    print(f"script calls per 4-dimension decision: {report['groups_per_4dim_decision']}")
    print(f"script calls per master (4 dimensions): {spread_calls}")
    verdict = "met" if spread <= SPREAD_TARGET else "MISSED"
    print(f"busiest master / mean: {spread:.3f}   target <= {SPREAD_TARGET}   {verdict}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
