"""The scenarios' configurations run one after another: gunicorn started for each, its phases measured."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from ..load import (
    CHARGE_KEYS,
    CHARGE_RATE,
    EXPORT_SECONDS,
    FLEET_CAPACITY,
    FLOOD_CLIENTS,
    FLOOD_PERIOD,
    FULL,
    QUICK,
    SETTINGS_MODULE,
    SHED_THRESHOLDS,
    START_TIMEOUT,
    THREADS,
    WORKER_CAPACITY,
    WORKERS,
    Durations,
    all_keys,
    demo_server,
    fleet_slots,
    log,
    log_counts,
    log_excerpt,
    machine,
    prepare_database,
    probe_exports,
    run_phase,
    source_version,
    warm_up,
)
from ..support.http import serving
from ..support.processes import Service
from ..support.redis_server import RedisServer, free_port
from . import flood, local_path
from .configuration import Configuration, combined


def configurations(*, fleet_only: bool) -> list[Configuration]:
    """Shedding off, on (the flood's phases, then the local path's), on without the local path, fleet only."""
    return combined(flood.CONFIGURATIONS, local_path.CONFIGURATIONS, flood.FLEET_ONLY if fleet_only else ())


def run(args: argparse.Namespace, redis_server: RedisServer, workdir: Path, servers: list[Service]) -> dict[str, Any]:
    """Every configuration's phases; each gunicorn started is added to ``servers``, for the caller to stop."""
    durations = QUICK if args.quick else FULL
    base_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
        "BENCH_SHEDDING_DB": str(workdir / "db.sqlite3"),
        "BENCH_SHEDDING_REDIS_URL": redis_server.url,
        "BENCH_SHEDDING_FLEET_CAPACITY": "",
        "BENCH_SHEDDING_WORKER_CAPACITY": "",
        "PYTHONUNBUFFERED": "1",
    }
    t = time.monotonic()
    prepare_database(base_env)
    log(f"database migrated, {len(all_keys())} API keys seeded ({time.monotonic() - t:.1f} s)")
    report: dict[str, Any] = {
        "quick": args.quick,
        "machine": machine(),
        "source": source_version(),
        "config": config(durations, fleet_only=args.fleet_only),
        "phases": {},
        "servers": {},
    }
    port = free_port()
    for configuration in configurations(fleet_only=args.fleet_only):
        shedding = configuration.name
        idle = 0.0
        admin = redis_server.client()
        admin.flushall()
        admin.close()
        server = demo_server(f"gunicorn-{shedding}", port, workdir)
        servers.append(server)
        t = time.monotonic()
        server.start({**base_env, **configuration.env})
        server.wait_until(
            lambda server=server: len(server.children()) >= WORKERS and serving(port), START_TIMEOUT, "workers serving"
        )
        workers = sorted(server.children())
        log(
            f"gunicorn (shedding {shedding}) master pid {server.pid}, workers {workers} "
            f"on 127.0.0.1:{port} ({time.monotonic() - t:.1f} s)"
        )
        warm_up(port, durations.warm)
        for name, flooded in configuration.phases:
            charges = not name.startswith("cpu-")
            if not charges:
                duration, settle = durations.cpu, durations.settle
            elif flooded:
                duration, settle = durations.flood, durations.settle
            else:
                duration = durations.unloaded if shedding == "off" else durations.unloaded_on
                settle = 0.0
            pids = {
                "gunicorn": [server.pid, *workers],
                "redis": [redis_server.pid],
                "generator": [os.getpid()],
            }
            report["phases"][name] = run_phase(
                name, port, duration=duration, settle=settle, flood=flooded, pids=pids, charges=charges, idle_rate=idle
            )
            if name.startswith("cpu-idle"):
                phase = report["phases"][name]
                idle = phase["cpu"]["gunicorn_s"] / phase["wall_s"]
            report["phases"][name]["shedding"] = shedding
        details: dict[str, Any] = {}
        if shedding != "off":
            details["fleet_slots_after_flood"] = fleet_slots(redis_server)
            details["export_probe_after_flood"] = probe_exports(port, durations.probe_rounds)
        pid, t = server.pid, time.monotonic()
        server.stop(grace=15)
        log(f"stopped gunicorn master pid {pid} (workers {workers}) in {time.monotonic() - t:.1f} s")
        text = server.log_text()
        details["log"] = log_counts(text)
        details["log_excerpt"] = log_excerpt(text)
        report["servers"][shedding] = details
    report["targets"] = targets(report["phases"])
    return report


def targets(phases: dict[str, Any]) -> dict[str, Any]:
    """Each scenario's targets, and the phases during which other work made the machine noisy."""
    found = flood.targets(phases)
    found["noisy_phases"] = [name for name, phase in phases.items() if phase["noisy"]]
    return {**found, **local_path.targets(phases, found["unloaded_p99_ms"])}


def config(durations: Durations, *, fleet_only: bool) -> dict[str, Any]:
    return {
        "gunicorn": f"gthread, {WORKERS} workers x {THREADS} threads, --no-control-socket",
        "fleet_capacity_on": FLEET_CAPACITY,
        "fleet_only_phase": fleet_only,
        "worker_capacity_on": WORKER_CAPACITY,
        "shed_thresholds": SHED_THRESHOLDS,
        "tier": "1000/s, burst 1000 per API key",
        "export_cost": 1,
        "export_seconds": EXPORT_SECONDS,
        "charge_rate_per_s": CHARGE_RATE,
        "charge_keys": CHARGE_KEYS,
        "flood_clients": FLOOD_CLIENTS,
        "flood_period_s": FLOOD_PERIOD,
        "durations_s": {
            "warm_up": durations.warm,
            "unloaded": durations.unloaded,
            "unloaded_on": durations.unloaded_on,
            "flood_settle": durations.settle,
            "flood": durations.flood,
            "cpu": durations.cpu,
        },
    }
