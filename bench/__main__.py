"""``python -m bench``: PING vs ratelimits vs DRF's throttles, side by side, on a private Redis.

Starts its own ``redis-server`` on a free loopback port (never the shared one on 6379), runs
every scenario in interleaved rounds, prints a table and the target ratios, writes the same to
``bench/results/latest.json`` and stops the server by PID. See bench/README.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from .support.redis_server import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
#: Network round trips (µs) for the modelled DRF/ratelimits ratio (same host, same AZ, cross-AZ).
MODEL_RTTS_US = (100, 250, 500)

#: Each target: the figure's key in ``targets``, how it must compare, and its label.
TARGETS = {
    "ratelimits_1dim_p50_over_ping_p50": ("<=", 1.5, "1-dim p50 / PING p50"),
    "ratelimits_4dim_p50_over_ping_p50": ("<=", 1.8, "4-dim p50 / PING p50"),
    "ratelimits_4dim_p99_us": ("<", 1000.0, "4-dim p99 (µs)"),
    "drf_stack_p50_over_ratelimits_4dim_p50": (">=", 2.0, "DRF stack p50 / 4-dim p50"),
    "decide_4_p50_over_ping_p50": ("<=", 1.3, "decide(4) p50 / PING p50"),
    "redis_us_per_4dim_decision": ("<=", 12.0, "Redis µs per 4-dim decision"),
    "redis_us_per_1dim_decision": ("<=", 6.0, "Redis µs per 1-dim decision"),
    "throttle_plumbing_p50_us": ("<=", 15.0, "plumbing p50 µs"),
    "extra_per_dimension_p50_us": ("<=", 4.0, "each extra dimension µs"),
    "redis_cpu_4dim_over_ping": ("<=", 2.0, "Redis CPU, 4-dim / PING"),
    "redis_cpu_4dim_over_envoy_4": ("<=", 1.3, "Redis CPU, 4-dim / Envoy-style 4"),
    "memory_per_idle_subject_bytes": ("<=", 128.0, "bytes per idle subject"),
}
#: The anchors (bench/scenarios.py): each row's p50 and server CPU are printed over PING's.
ANCHORS = ("envoy_1", "envoy_4", "limits_fixed_1", "lua_bucket_1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~10 s run (smaller budget, shorter warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--iterations", type=int, default=None, help="decisions per scenario per round (default: fit the budget)"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds of timed work to aim for (default 55, quick 5)"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "latest.json", help="where to write the results")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="afterwards, cProfile N four-dimension decisions"
    )
    parser.add_argument(
        "--cpu",
        type=int,
        default=None,
        metavar="N",
        help="pin this process and its redis-server to CPU N (steadier on small VMs; default: unpinned)",
    )
    parser.add_argument(
        "--server-cpu",
        type=int,
        default=None,
        metavar="M",
        help="with --cpu N: pin redis-server to CPU M instead (its CPU then excludes the client's cache traffic)",
    )
    args = parser.parse_args(argv)
    if args.server_cpu is not None and args.cpu is None:
        parser.error("--server-cpu needs --cpu")
    if args.server_cpu is not None and args.server_cpu not in os.sched_getaffinity(0):
        parser.error(f"--server-cpu {args.server_cpu} is not one of the CPUs this process may use")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        parser.error(f"--cpu {args.cpu} is not one of the CPUs this process may use: {sorted(os.sched_getaffinity(0))}")
    if args.budget is None:
        args.budget = 5.0 if args.quick else 55.0
    args.warmup_s = 0.25 if args.quick else 1.0
    args.deadline_s = 15.0 if args.quick else 85.0
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    names = ("Django", "djangorestframework", "django-redis", "redis", "hiredis")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def source_version() -> dict[str, Any]:
    """The commit measured, and whether ``ratelimits/`` differed from it (read-only git calls)."""
    root = Path(__file__).resolve().parent.parent

    def git(*command: str) -> str | None:
        try:
            done = subprocess.run(["git", *command], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "ratelimits")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "ratelimits_modified": None if status is None else bool(status),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.started_at = datetime.now(UTC).isoformat(timespec="seconds")
    args.source = source_version()  # before ratelimits (and its Lua script) is imported
    started = time.monotonic()
    if shutil.which("redis-server") is None:
        log("redis-server is not on PATH; install Redis 7 to run the benchmark")
        return 2
    server = RedisServer()  # never on port 6379, the shared Redis
    try:
        server.start()
        pid = server.pid
        log(f"private redis-server pid {pid} on 127.0.0.1:{server.port}")
        if args.cpu is not None:
            server_cpu = args.cpu if args.server_cpu is None else args.server_cpu
            os.sched_setaffinity(pid, {server_cpu})
            os.sched_setaffinity(0, {args.cpu})
            log(f"pinned this process to CPU {args.cpu} and redis-server pid {pid} to CPU {server_cpu}")
        return run(args, server, started)
    finally:
        # RedisServer.stop signals only the process (group) it started: SIGTERM, then SIGKILL after 10 s.
        stopped = server.pid if server.running else None
        server.stop()
        if stopped is not None:
            log(f"stopped redis-server pid {stopped}")


def run(args: argparse.Namespace, server: RedisServer, started: float) -> int:
    redis_url = f"redis://127.0.0.1:{server.port}/0"
    cache_url = f"redis://127.0.0.1:{server.port}/1"

    from .settings import configure

    configure(redis_url, cache_url)

    from redis.connection import DefaultParser

    from . import scenarios as sc
    from .runner import run_rounds, warm

    admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    server_info: dict[str, Any] = admin.info("server")
    load_before = os.getloadavg()

    try:
        scenarios = sc.build(redis_url)
        log(f"warm-up: {args.warmup_s:g}s per scenario")
        estimates = {}
        for scenario in scenarios:
            estimates[scenario.key] = warm(scenario, args.warmup_s, 500)
            log(f"  {scenario.key}: ~{estimates[scenario.key]:.0f} µs/decision")
        per_index_s = sum(estimates.values()) / 1e6
        if args.iterations is None:
            iterations = int(args.budget / (args.rounds * per_index_s))
            iterations = max(500, min(iterations, 50_000))
        else:
            iterations = args.iterations
        block_warmup = max(50, iterations // 50)
        round_s = per_index_s * (iterations + block_warmup)
        log(f"timing: {args.rounds} rounds x {iterations} decisions per scenario (~{round_s:.1f}s per round)")
        series, rounds_done = run_rounds(
            scenarios,
            admin,
            rounds=args.rounds,
            iterations=iterations,
            block_warmup=block_warmup,
            deadline=started + args.deadline_s - round_s,
            log=log,
        )
    except sc.Invalid as exc:
        log(f"INVALID RUN: {exc}")
        return 2

    sanity = {
        # Every call raises on a denial or a degraded (fail-open) answer, so reaching here means none.
        "denied_decisions": 0,
        "degraded_decisions": 0,
        "ratelimits_keys_db0": admin.dbsize(),
        "drf_cache_keys_db1": redis.Redis(host="127.0.0.1", port=server.port, db=1).dbsize(),
        # Sampled right after the last DRF block: how long its per-user timestamp lists were.
        "drf_mean_user_history_length": next(
            s.observations.get("mean_user_history_length") for s in scenarios if s.key == "drf_stack"
        ),
    }
    from .memory import memory_per_subject

    memory = memory_per_subject(server.port, admin)
    report = build_report(args, scenarios, series, rounds_done, iterations, block_warmup, estimates, memory)
    report["meta"].update(
        {
            "redis_server": f"Redis {server_info.get('redis_version')} on 127.0.0.1:{server.port} (private, loopback)",
            "redis_parser": DefaultParser.__name__,
            "pinned_cpu": args.cpu,
            "server_cpu": args.cpu if args.server_cpu is None else args.server_cpu,
            "load_average_before": [round(v, 2) for v in load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
            "duration_s": round(time.monotonic() - started, 1),
        }
    )
    report["sanity"] = sanity
    print(render(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.json}")
    if args.profile:
        profile(scenarios, args.profile, args.json.parent / "profile-4dim.txt")
    return 0


def build_report(
    args: argparse.Namespace,
    scenarios: list[Any],
    series: dict[str, Any],
    rounds_done: int,
    iterations: int,
    block_warmup: int,
    estimates: dict[str, float],
    memory: dict[str, Any],
) -> dict[str, Any]:
    results = {}
    for scenario in scenarios:
        results[scenario.key] = {"label": scenario.label, **series[scenario.key].summary(), **scenario.notes}
    ping, one, four, drf, decide = (
        results[k] for k in ("ping", "ratelimits_1dim", "ratelimits_4dim", "drf_stack", "decide_4")
    )
    noop, floor = results["floor_noop"], results["floor_4"]
    values = {
        "ratelimits_1dim_p50_over_ping_p50": round(one["p50_us"] / ping["p50_us"], 2),
        "ratelimits_4dim_p50_over_ping_p50": round(four["p50_us"] / ping["p50_us"], 2),
        "ratelimits_4dim_p99_us": four["p99_us"],
        "drf_stack_p50_over_ratelimits_4dim_p50": round(drf["p50_us"] / four["p50_us"], 2),
        "decide_4_p50_over_ping_p50": round(decide["p50_us"] / ping["p50_us"], 2),
        "redis_us_per_4dim_decision": four["redis_us_per_decision"],
        "redis_us_per_1dim_decision": one["redis_us_per_decision"],
        "throttle_plumbing_p50_us": round(four["p50_us"] - decide["p50_us"], 1),
        "extra_per_dimension_p50_us": round((four["p50_us"] - one["p50_us"]) / 3, 1),
        "redis_cpu_4dim_over_ping": round(four["redis_cpu_us_per_decision"] / ping["redis_cpu_us_per_decision"], 2),
        "redis_cpu_4dim_over_envoy_4": round(
            four["redis_cpu_us_per_decision"] / results["envoy_4"]["redis_cpu_us_per_decision"], 2
        ),
        "memory_per_idle_subject_bytes": memory["state_bytes"],
    }
    ratios: dict[str, Any] = {}
    for name, (op, target, label) in TARGETS.items():
        value = values[name]
        met = {"<=": value <= target, "<": value < target, ">=": value >= target}[op]
        ratios[name] = {"label": label, "value": value, "target": f"{op} {target:g}", "met": met}
    info = {
        "usage_on_over_off_p50": round(four["p50_us"] / results["ratelimits_4dim_no_usage"]["p50_us"], 2),
        "usage_worker_over_script_p50": round(results["ratelimits_4dim_worker_usage"]["p50_us"] / four["p50_us"], 2),
        "redis_cpu_usage_worker_over_script": round(
            results["ratelimits_4dim_worker_usage"]["redis_cpu_us_per_decision"] / four["redis_cpu_us_per_decision"], 2
        ),
        "drf_stack_throughput_over_ratelimits_4dim": round(drf["throughput_per_s"] / four["throughput_per_s"], 2),
        # The distance to the physical limit: the script's own Lua is what it costs beyond the floor.
        "redis_us_4dim_over_floor": round(four["redis_us_per_decision"] - floor["redis_us_per_decision"], 1),
        "redis_us_floor_4": floor["redis_us_per_decision"],
        "redis_us_noop": noop["redis_us_per_decision"],
        "redis_cpu_us_4dim": four["redis_cpu_us_per_decision"],
        "redis_cpu_us_ping": ping["redis_cpu_us_per_decision"],
        "memory": memory,
        # The same decisions by EVALSHA, as to a store without Redis Functions.
        "redis_cpu_decide_4_script_over_function": round(
            results["decide_4_script"]["redis_cpu_us_per_decision"] / decide["redis_cpu_us_per_decision"], 2
        ),
        "anchors_over_ping": {
            key: {
                "p50": round(results[key]["p50_us"] / ping["p50_us"], 2),
                "redis_cpu": round(results[key]["redis_cpu_us_per_decision"] / ping["redis_cpu_us_per_decision"], 2),
            }
            for key in ANCHORS
        },
    }
    # Not measured: what the DRF/4-dim ratio becomes if every round trip cost ``rtt`` instead of
    # this machine's loopback PING (DRF makes 4 round trips per decision, ratelimits 1).
    for rtt in MODEL_RTTS_US:
        extra = rtt - ping["p50_us"]
        info[f"model_drf_over_4dim_at_{rtt}us_rtt"] = round((drf["p50_us"] + 4 * extra) / (four["p50_us"] + extra), 2)
    return {
        "meta": {
            "started_at": args.started_at,
            "argv": sys.argv[1:],
            "quick": args.quick,
            "rounds": rounds_done,
            "rounds_requested": args.rounds,
            "decisions_per_scenario_per_round": iterations,
            "untimed_warmup_per_block": block_warmup,
            "warmup_estimate_us": {k: round(v, 1) for k, v in estimates.items()},
            "machine": {
                "cpus": os.cpu_count(),
                "cpu_model": cpu_model(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "versions": versions(),
            "source": args.source,
        },
        "scenarios": results,
        "targets": ratios,
        "derived": info,
    }


def render(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"ratelimits benchmark: {meta['rounds']} rounds x {meta['decisions_per_scenario_per_round']} decisions "
        f"per scenario, single thread, {meta['redis_server']}",
        f"commit {meta['source']['commit']}"
        + (" (ratelimits/ modified)" if meta["source"]["ratelimits_modified"] else "")
        + f", {meta['machine']['cpus']} CPUs ({meta['machine']['cpu_model']}), Python {meta['machine']['python']}, "
        f"parser {meta['redis_parser']}, "
        + (
            "unpinned"
            if meta["pinned_cpu"] is None
            else f"client and server pinned to CPU {meta['pinned_cpu']}"
            if meta["server_cpu"] == meta["pinned_cpu"]
            else f"client pinned to CPU {meta['pinned_cpu']}, server to CPU {meta['server_cpu']}"
        )
        + f", load {meta['load_average_before']} -> {meta['load_average_after']}",
        "",
    ]
    header = (
        f"{'#':<2} {'scenario':<42} {'p50 µs':>8} {'p90 µs':>8} {'p99 µs':>8} {'p99.9 µs':>9} {'max µs':>9} "
        f"{'decisions/s':>11} {'redis µs':>9} {'cpu µs':>7} {'cmds':>5}  round p50s µs"
    )
    lines += [header, "-" * len(header)]
    for n, (_, row) in enumerate(report["scenarios"].items(), 1):
        rounds = row["round_p50_us"]
        lines.append(
            f"{n:<2} {row['label']:<42} {row['p50_us']:>8.1f} {row['p90_us']:>8.1f} {row['p99_us']:>8.1f} "
            f"{row['p99_9_us']:>9.1f} {row['max_us']:>9.1f} {row['throughput_per_s']:>11,} "
            f"{row['redis_us_per_decision']:>9.1f} {row['redis_cpu_us_per_decision']:>7.1f} "
            f"{row['redis_calls_per_decision']:>5.2f}  {min(rounds):.1f}-{max(rounds):.1f}"
        )
    lines.append("")
    for row in report["targets"].values():
        verdict = "met" if row["met"] else "MISSED"
        lines.append(f"{row['label']:<30} {row['value']:>8}   target {row['target']:<8} {verdict}")
    derived = report["derived"]
    memory = derived["memory"]
    lines += [
        "",
        f"usage counting on / off p50   {derived['usage_on_over_off_p50']:>8}",
        f"usage by worker / script p50  {derived['usage_worker_over_script_p50']:>8}   "
        f"server CPU {derived['redis_cpu_usage_worker_over_script']} x (USAGE['FLUSH_EVERY'] '1s' over the default)",
        f"decide(4) CPU, script / FCALL {derived['redis_cpu_decide_4_script_over_function']:>8}   "
        "server CPU of the same decisions by EVALSHA over FCALL",
        *(
            f"{report['scenarios'][key]['label'][8:]:<42} p50 {ratio['p50']:>5} x PING, "
            f"server CPU {ratio['redis_cpu']:>5} x PING's"
            for key, ratio in derived["anchors_over_ping"].items()
        ),
        f"Redis µs, 4-dim over floor    {derived['redis_us_4dim_over_floor']:>8}   "
        f"the script's own Lua (floor {derived['redis_us_floor_4']} µs, no-op EVALSHA {derived['redis_us_noop']} µs; "
        "the floors are sent by EVALSHA)",
        f"server CPU µs, 4-dim / PING   {derived['redis_cpu_us_4dim']:>8}   {derived['redis_cpu_us_ping']} for a PING "
        "(INFO cpu, user + sys)",
        f"usage row bytes per subject   {memory['usage_row_bytes']:>8}   until the minute is drained "
        f"({memory['subjects']:,} callers, {memory['policy']})",
        f"DRF / 4-dim throughput        {derived['drf_stack_throughput_over_ratelimits_4dim']:>8}",
        "model, not measured: DRF p50 / 4-dim p50 if a round trip took "
        + ", ".join(f"{rtt} µs: {derived[f'model_drf_over_4dim_at_{rtt}us_rtt']}" for rtt in MODEL_RTTS_US)
        + " (DRF 4 round trips, ratelimits 1)",
    ]
    return "\n".join(lines)


def profile(scenarios: list[Any], count: int, path: Path) -> None:
    """cProfile ``count`` four-dimension throttle decisions; write the top functions to ``path``."""
    scenario = next(s for s in scenarios if s.key == "ratelimits_4dim")
    call = scenario.call
    profiler = cProfile.Profile()
    with scenario.active():
        profiler.enable()
        for i in range(count):
            call(i)
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    path.write_text(out.getvalue())
    log(f"wrote {path} ({count} decisions profiled)")


if __name__ == "__main__":
    raise SystemExit(main())
