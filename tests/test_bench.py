"""The benchmark runs end to end and reports every figure it promises (never how fast: see bench/)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(module: str, *args: str, timeout: float) -> str:
    """``python -m module args`` from the repository's root, which must succeed; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_a_short_benchmark_run_reports_every_row_target_and_floor(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    stdout = run_bench("bench", "--quick", "--rounds", "1", "--iterations", "300", "--json", str(out), timeout=120)
    report = json.loads(out.read_text())
    rows = report["scenarios"]
    assert set(rows) == {
        "ping",
        "ratelimits_1dim",
        "ratelimits_4dim",
        "ratelimits_4dim_no_usage",
        "ratelimits_4dim_worker_usage",
        "drf_stack",
        "decide_4",
        "decide_4_script",
        "decide_4_settling",
        "settle_4_refund",
        "envoy_1",
        "envoy_4",
        "limits_fixed_1",
        "lua_bucket_1",
        "floor_noop",
        "floor_4",
    }
    # One call each (an Envoy-style pipeline: two commands a descriptor, in one round trip), and the
    # floor ran the same inner commands as a four-check decision.
    pipelined = {"envoy_1": 2, "envoy_4": 8, "settle_4_refund": 2}  # a settlement: one more call
    assert {key: row["redis_calls_per_decision"] for key, row in rows.items() if key != "drf_stack"} == {
        key: pipelined.get(key, 1) for key in rows if key != "drf_stack"
    }
    inner = {command: round(n) for command, n in rows["floor_4"]["script_commands_per_decision"].items()}
    assert inner == {"time": 1, "mget": 1, "set": 4, "hincrby": 1}
    assert all(row["redis_cpu_us_per_decision"] > 0 for row in rows.values())
    assert set(report["targets"]) >= {
        "redis_us_per_4dim_decision",
        "redis_us_per_1dim_decision",
        "decide_4_p50_over_ping_p50",
        "throttle_plumbing_p50_us",
        "extra_per_dimension_p50_us",
        "memory_per_idle_subject_bytes",
        "ratelimits_1dim_p50_over_ping_p50",
        "redis_cpu_4dim_over_ping",
        "redis_cpu_4dim_over_envoy_4",
    }
    assert all(isinstance(target["met"], bool) for target in report["targets"].values())
    assert set(report["derived"]["anchors_over_ping"]) == {"envoy_1", "envoy_4", "limits_fixed_1", "lua_bucket_1"}
    memory = report["derived"]["memory"]
    assert memory["state_keys"] == memory["subjects"]  # one key per caller, none expired mid-measurement
    assert memory["state_bytes"] > 0 and memory["usage_row_bytes"] > 0
    assert "target" in stdout and "floor: no-op EVALSHA" in stdout


@pytest.mark.slow
def test_the_instruction_count_reports_every_scenario_and_part(tmp_path: Path) -> None:
    out = tmp_path / "instructions.json"
    stdout = run_bench("bench.instructions", "--calls", "200", "--json", str(out), timeout=600)
    report = json.loads(out.read_text())
    rows = report["scenarios"]
    assert {"ping", "ratelimits_4dim", "decide_4", "decide_4_script", "envoy_4", "lua_bucket_1"} <= set(rows)
    assert all(row["instructions"] > 0 for row in rows.values())
    assert rows["ping"]["over_ping"] == 1.0 and rows["envoy_4"]["over_envoy_4"] == 1.0
    # Each part adds a line to the one before: a script that does more runs more instructions.
    cumulative = [report["parts"][label] for label in report["parts"] if label.startswith(("a call", "+ "))]
    assert len(cumulative) == 7 and cumulative == sorted(cumulative)
    assert "Where a 4-dimension decision's instructions go" in stdout


@pytest.mark.slow
def test_the_plumbing_benchmark_takes_each_part_out_of_every_call(tmp_path: Path) -> None:
    out = tmp_path / "plumbing.json"
    stdout = run_bench("bench.plumbing", "--calls", "300", "--rounds", "1", "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    parts = {
        "identity",
        "policy resolution",
        "usage row",
        "limiter (breaker, local path)",
        "backend (call made, stamped, reply read)",
        "headers",
    }
    assert set(report["part_us"]) == parts
    # Each replacement stood in for its part on every call (a patch that missed would read as free).
    assert report["replaced_calls_per_call"] == dict.fromkeys(parts, 1.0)
    assert all(value > 0 for value in report["us_per_call"].values())
    assert "Plumbing (throttle minus decide, both replayed)" in stdout


@pytest.mark.slow
def test_the_observability_benchmark_reports_both_ways_and_the_added_steps() -> None:
    out = run_bench(
        "bench.observability", "--rounds", "2", "--iterations", "300", "--memory-rounds", "2", "--split", timeout=180
    )
    assert "redis round 2: before" in out
    [memory_round] = [line for line in out.splitlines() if line.startswith("memory round 2: ")]
    assert all(f"{name} " in memory_round for name in ("before", "metrics", "headers", "observed"))
    summaries = [line for line in out.splitlines() if line.startswith("throttle p50 on ")]
    assert [line.split(";")[0].split(", ")[-1].split()[0] for line in summaries] == [
        "observed",
        "metrics",
        "headers",
        "observed",
    ]
    for line in summaries:
        # The middle half of the rounds lies within all of them.
        numbers = re.search(r"middle half of the rounds (\S+) to (\S+), all (\S+) to (\S+)\)", line)
        assert numbers is not None, line
        low, high, least, most = (float(n) for n in numbers.groups())
        assert least <= low <= high <= most, line
    assert "end to end without the round trip (the memory backend)" in out
    assert "the added steps alone: every policy's headers" in out and "the metrics' record" in out
    assert "a bare PING p50 in this run" in out


@pytest.mark.slow
def test_the_hot_keys_benchmark_compares_every_mode_on_the_long_tail() -> None:
    """The four-dimension and long-tail scenarios run in every mode, each with its ratio to the central path."""
    stdout = run_bench(
        "bench.hot_keys",
        "--seconds",
        "0.5",
        "--scenarios",
        "hot4",
        "tail",
        "--modes",
        "central",
        "default",
        timeout=300,
    )
    for scenario in ("hot4", "tail"):
        for mode in ("central", "default"):
            assert re.search(rf"^{scenario} +{mode} +[\d,]+ ", stdout, re.MULTILINE), (scenario, mode, stdout)
        assert re.search(rf"^  {scenario} +worker CPU +[\d.]+x, Redis CPU +[\d.]+x, script calls", stdout, re.MULTILINE)


@pytest.mark.slow
def test_the_eviction_benchmark_runs_every_memory_size() -> None:
    """Every run reports its keys, evictions and admissions: the smallest once crashed, its maxmemory
    below what the loaded decide function takes (every write refused)."""
    stdout = run_bench("bench.eviction", timeout=300)
    for label in ("no eviction (no maxmemory)", "allkeys-lru, 3 MB for keys", "allkeys-lru, 300 kB for keys"):
        figures = r" +keys +\d+, evicting +\d+/s: asked \d+, admitted \d+, the limit allows \d+ \([\d.]+x\)$"
        assert re.search(rf"^{re.escape(label)}{figures}", stdout, re.MULTILINE), (label, stdout)
