"""``python -m bench.shedding [--quick] [--fleet-only | --adaptive]``: do critical requests stay fast under a flood?

The demo API runs under gunicorn (gthread, 2 workers x 8 threads, ``--no-control-socket``) on a
free loopback port, against a private ``redis-server`` and a temporary SQLite database, with the
settings of ``bench/shedding_settings.py``, restarted with other environment variables for each
configuration of the shedders. A load generator in this process (``bench/load.py``) runs the
phases of two scenarios: the flood, shedding off and on (``bench/shedding/flood.py``), and issue
12's closed-loop floods and refusals' CPU (``bench/shedding/local_path.py``); or, with
``--adaptive``, fixed capacities against the adaptive one (``bench/shedding/adaptive.py``).

Prints a table, writes JSON (``bench/results/shedding.json``), and stops gunicorn and
redis-server by PID at the end, even after an error or Ctrl-C. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

from ..load import RESULTS, log
from ..support.processes import Service
from ..support.redis_server import RedisServer
from .report import render
from .runner import run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.shedding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (about 20 s in all), for a smoke check")
    parser.add_argument(
        "--fleet-only",
        action="store_true",
        help="add a flood phase with the fleet shedder alone (SHEDDING['WORKER_CAPACITY'] None), about 20 s more",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="instead: fixed worker capacities against the adaptive one while exports slow down 5x "
        "(bench/shedding/adaptive.py; about 4 min, 1.5 with --quick)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="where to write the results (bench/results/shedding.json, adaptive.json)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("redis-server") is None:
        log("redis-server is not on PATH; install Redis 7 to run the benchmark")
        return 2

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    sys.setswitchinterval(0.001)  # the generator's threads wake promptly when a response arrives
    if args.adaptive:
        from .adaptive import run as run_adaptive  # the same load generator (bench/load.py), its own phases

        return run_adaptive(args.quick, args.json)
    args.json = args.json or RESULTS / "shedding.json"
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="ratelimits-shedding-"))
    redis_server = RedisServer()  # never on port 6379, the shared Redis
    servers: list[Service] = []
    try:
        redis_server.start()
        log(f"private redis-server pid {redis_server.pid} on 127.0.0.1:{redis_server.port}")
        report = run(args, redis_server, workdir, servers)
        report["started_at"] = started_at
        report["wall_s"] = round(time.monotonic() - started, 1)
    finally:
        for server in servers:
            pid = server.pid if server.running else None
            server.stop(grace=15)
            if pid is not None:
                log(f"stopped gunicorn master pid {pid} and its workers")
        redis_pid = redis_server.pid if redis_server.running else None
        redis_server.stop()
        if redis_pid is not None:
            log(f"stopped redis-server pid {redis_pid}")
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    log(f"wrote {args.json} ({report['wall_s']:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
