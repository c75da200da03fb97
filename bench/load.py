"""What every scenario of ``bench.shedding`` shares: the demo under gunicorn, and a load generator.

The demo API is served by gunicorn (gthread) on a free loopback port, against a private
``redis-server`` and a temporary SQLite database, with the settings of
``bench/shedding_settings.py``; a generator in this process (threads and ``http.client``) sends
its phases of critical charges and low-priority floods, meters the processes' CPU, and sums up
what each phase measured. Each bench adds its own phases, targets and report.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .stats import percentile
from .support.http import request
from .support.processes import Service, gunicorn
from .support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SETTINGS_MODULE = "bench.shedding_settings"

# -- the server --------------------------------------------------------------------------------
WORKERS = 2
THREADS = 8
#: Shedding on: the fleet can serve as many requests at once as gunicorn has threads, and each
#: worker as many as its threads. Thresholds (percent): low 60, normal 75, high 90 (settings).
FLEET_CAPACITY = WORKERS * THREADS
WORKER_CAPACITY = THREADS
SHED_THRESHOLDS = {"low": 60, "normal": 75, "high": 90}

# -- the load ----------------------------------------------------------------------------------
#: Critical charges: open loop, evenly spaced, whatever the responses (each on its own thread).
CHARGE_RATE = 40.0
CHARGE_KEYS = 8
#: The flood: one client per API key, each sending one export per period, or as soon as its
#: previous export has been answered when that took longer (it never has two in flight, never
#: catches up on missed periods, and ignores Retry-After).
FLOOD_CLIENTS = 64
FLOOD_PERIOD = 1.0
#: Seconds the demo's export sleeps (``ReportExport.duration``): the flood's offered load is
#: FLOOD_CLIENTS / FLOOD_PERIOD = 64 exports/s against 16 threads / 0.5 s = 32/s of capacity.
EXPORT_SECONDS = 0.5
CLIENT_TIMEOUT = 30.0
#: A phase during which the rest of the machine used more than this many CPUs on average is
#: flagged noisy (the VM has 2): its latencies say more about the neighbours than about shedding.
NOISY_OTHER_CPUS = 0.25
DRAIN_TIMEOUT = 30.0
START_TIMEOUT = 30.0


@dataclass(frozen=True)
class Durations:
    warm: float
    unloaded: float
    unloaded_on: float
    settle: float
    flood: float
    probe_rounds: int
    #: Each phase measuring what one kind of request costs the workers.
    cpu: float


FULL = Durations(warm=1.0, unloaded=8.0, unloaded_on=5.0, settle=2.0, flood=14.0, probe_rounds=2, cpu=5.0)
QUICK = Durations(warm=0.5, unloaded=2.0, unloaded_on=1.0, settle=0.5, flood=2.5, probe_rounds=1, cpu=1.5)


_STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:5.1f} s] {message}", file=sys.stderr, flush=True)


def setup_database() -> None:
    """Run inside ``DJANGO_SETTINGS_MODULE=bench.shedding_settings``: migrate, then seed the API keys."""
    import django

    django.setup()
    from django.core.management import call_command

    from project.payments.models import ApiKey, hash_key

    call_command("migrate", interactive=False, verbosity=0)
    keys = [raw for raw, _ in all_keys()]
    ApiKey.objects.bulk_create(
        ApiKey(name=raw, prefix=raw[:12], key_hash=hash_key(raw), tier=tier_of(raw), organization=org)
        for raw, org in all_keys()
    )
    assert ApiKey.objects.filter(key_hash__in=[hash_key(k) for k in keys]).count() == len(keys)


def prepare_database(env: dict[str, str]) -> None:
    """:func:`setup_database` in a child process with ``env``: the servers' settings module and SQLite file."""
    subprocess.run(
        [sys.executable, "-c", "from bench.load import setup_database; setup_database()"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=120,
    )


def charge_keys() -> list[str]:
    return [f"sk_bench_charge_{i:03d}" for i in range(CHARGE_KEYS)]


def flood_keys() -> list[str]:
    return [f"sk_bench_export_{i:03d}" for i in range(FLOOD_CLIENTS)]


#: The abusive caller: one key on the ``abusive`` tier (10/s), flooding ``GET /v1/customers``.
ABUSIVE_KEY = "sk_bench_abusive_000"


def all_keys() -> list[tuple[str, str]]:
    """Every raw key with its organisation (8 organisations; no limit applies to them)."""
    return [(raw, f"org{i % 8}") for i, raw in enumerate([*charge_keys(), *flood_keys(), ABUSIVE_KEY])]


def tier_of(raw: str) -> str:
    return "abusive" if raw == ABUSIVE_KEY else "bench"


# -- the load generator ------------------------------------------------------------------------


def kept_alive_request(
    conn: http.client.HTTPConnection, method: str, path: str, *, key: str, body: bytes | None
) -> tuple[int, http.client.HTTPResponse]:
    """One request on a connection kept open between requests (reconnected if the server closed it)."""
    headers = {"Authorization": f"Bearer {key}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    if response.will_close:
        conn.close()
    return response.status, response


@dataclass(frozen=True, slots=True)
class Sample:
    """One request: when it was due, sent and answered (monotonic seconds), and how."""

    klass: str
    due: float
    sent: float
    done: float
    status: int | None
    #: For a 503: "fleet" (decided in Redis: rate-limit headers describe a policy) or "worker"
    #: (the worker shedder decides before any check: a 503 without rate-limit headers).
    shed_by: str | None = None
    degraded: bool = False
    error: str | None = None
    #: ``X-RateLimit-Local``: "denial" when the 429 came from the worker's memory.
    local: str | None = None


CHARGE_BODY = json.dumps({"amount": 1999, "currency": "eur"}).encode()


#: What each class of request sends: method, path, body.
REQUESTS = {
    "critical": ("POST", "/v1/charges", CHARGE_BODY),
    "low": ("POST", "/v1/reports/export", None),
    # GET /v1/customers: an ordinary admitted request (normal priority), or the abusive key's.
    "normal": ("GET", "/v1/customers", None),
    "abusive": ("GET", "/v1/customers", None),
}


def attempt(
    port: int, klass: str, key: str, due: float, connection: http.client.HTTPConnection | None = None
) -> Sample:
    """Send one request of ``klass`` (see :data:`REQUESTS`) and describe what came back.

    On a fresh connection, or on ``connection``, kept open (a closed-loop flood's).
    """
    method, path, body = REQUESTS[klass]
    sent = time.monotonic()
    try:
        if connection is None:
            status, response = request(port, method, path, key=key, body=body, timeout=CLIENT_TIMEOUT)
        else:
            status, response = kept_alive_request(connection, method, path, key=key, body=body)
    except (OSError, http.client.HTTPException) as exc:
        if connection is not None:
            connection.close()  # opened again by the next request
        return Sample(klass, due, sent, time.monotonic(), None, error=type(exc).__name__)
    done = time.monotonic()
    shed_by = None
    if status == 503:
        # The worker shedder answers before any check is made, so its 503 describes no policy;
        # a fleet shed was decided in Redis with the caller's other checks, and describes one.
        described = response.getheader("X-RateLimit-Resource") or response.getheader("RateLimit-Policy")
        shed_by = "fleet" if described else "worker"
    degraded = response.getheader("X-RateLimit-Degraded") == "1"
    return Sample(klass, due, sent, done, status, shed_by, degraded, local=response.getheader("X-RateLimit-Local"))


def sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


#: Closed-loop floods (each of its connections, kept open, sends its next request as soon as the
#: last is answered, or at most ``pace`` a second): the flood's class, connections, pace (0: none).
CLOSED_FLOODS = {
    "exports32": ("low", 32, 0.0),
    "abusive32": ("abusive", 32, 0.0),
    # Without charges: what one kind of request costs the workers (CPU per request), on 2
    # connections, less what the workers use idle (measured in the phase before them).
    "cpu-admitted": ("normal", 2, 0.0),
    "cpu-early-429": ("abusive", 2, 0.0),
    # Enough exports in flight (0.5 s each) to keep both workers over the low class's threshold:
    # the rest are shed before authentication.
    "cpu-early-503": ("low", 32, 0.0),
}


class Phase:
    """One measured phase: charges at a fixed rate and, optionally, a flood.

    ``flood``: ``None``, ``"periodic"`` (the export flood: one export a period from each of many
    keys), or one of :data:`CLOSED_FLOODS`. Traffic starts at ``t0``; requests due before
    ``t0 + settle`` warm the phase up and are not counted; nothing new is sent after ``end``, and
    what is in flight then is waited for.
    """

    def __init__(
        self, name: str, port: int, *, duration: float, settle: float, flood: str | None, charges: bool = True
    ) -> None:
        self.name = name
        self.port = port
        self.duration = duration
        self.flood = flood
        self.charges = charges
        self.t0 = time.monotonic() + 0.05
        self.measure_from = self.t0 + settle
        self.end = self.measure_from + duration
        self.samples: list[Sample] = []
        self.flood_missed_periods = 0
        self._lock = threading.Lock()
        self._request_threads: list[threading.Thread] = []

    def record(self, sample: Sample) -> None:
        with self._lock:
            self.samples.append(sample)

    def run(self) -> None:
        drivers = [threading.Thread(target=self._charges, name="charges", daemon=True)] if self.charges else []
        if self.flood == "periodic":
            drivers += [
                threading.Thread(target=self._flood_client, args=(i, key), name=f"flood-{i}", daemon=True)
                for i, key in enumerate(flood_keys())
            ]
        elif self.flood is not None:
            klass, connections, pace = CLOSED_FLOODS[self.flood]
            drivers += [
                threading.Thread(
                    target=self._closed_loop, args=(klass, i, pace, connections), name=f"{klass}-{i}", daemon=True
                )
                for i in range(connections)
            ]
        for thread in drivers:
            thread.start()
        if not drivers:
            sleep_until(self.end)  # an idle phase: nothing is sent
        deadline = self.end + DRAIN_TIMEOUT
        for thread in drivers:
            thread.join(max(deadline - time.monotonic(), 0.1))
        for thread in list(self._request_threads):
            thread.join(max(deadline - time.monotonic(), 0.1))
        stuck = sum(t.is_alive() for t in drivers + self._request_threads)
        if stuck:
            raise RuntimeError(f"phase {self.name}: {stuck} requests unanswered {DRAIN_TIMEOUT:g} s after it ended")

    def _charges(self) -> None:
        keys = charge_keys()
        k = 0
        while True:
            due = self.t0 + k / CHARGE_RATE
            if due >= self.end:
                return
            sleep_until(due)
            key = keys[k % len(keys)]
            thread = threading.Thread(
                target=lambda key=key, due=due: self.record(attempt(self.port, "critical", key, due)), daemon=True
            )
            self._request_threads.append(thread)
            thread.start()
            k += 1

    def _flood_client(self, index: int, key: str) -> None:
        due = self.t0 + FLOOD_PERIOD * index / FLOOD_CLIENTS
        while due < self.end:
            sleep_until(due)
            self.record(attempt(self.port, "low", key, due))
            due += FLOOD_PERIOD
            behind = time.monotonic() - due
            if behind > 0:
                with self._lock:
                    self.flood_missed_periods += int(behind // FLOOD_PERIOD) + 1
                due = time.monotonic()

    def _closed_loop(self, klass: str, index: int, pace: float, connections: int) -> None:
        """One connection of a closed-loop flood, kept open: its next request as soon as one is answered
        (no sooner than ``1 / pace`` after the last was sent, with a pace)."""
        keys = {"low": flood_keys(), "normal": charge_keys(), "abusive": [ABUSIVE_KEY]}[klass]
        key = keys[index % len(keys)]
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT)
        # Paced connections take turns: together they send evenly, not all at once each period.
        due = self.t0 + (index / (pace * connections) if pace else 0.0)
        try:
            while True:
                if pace:
                    sleep_until(due)
                    due += 1 / pace
                now = time.monotonic()
                if now >= self.end:
                    return
                self.record(attempt(self.port, klass, key, now, connection))
        finally:
            connection.close()

    def measured(self, klass: str) -> list[Sample]:
        return [s for s in self.samples if s.klass == klass and self.measure_from <= s.due < self.end]


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    total = sum(values[:8])  # guest time is already counted in user
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


class CpuMeter:
    """CPU seconds used during a phase by gunicorn, redis-server, this load generator and the
    rest of the machine (other work on the VM: what makes a run noisy)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        busy, total = _machine_cpu()
        reading = {name: sum(_process_cpu(pid) for pid in pids) for name, pids in self.groups.items()}
        return {**reading, "machine_busy": busy, "machine_total": total}

    def stop(self) -> dict[str, Any]:
        end = self._read()
        used = {name: end[name] - self.start[name] for name in end}
        ours = sum(used[name] for name in self.groups)
        return {
            **{f"{name}_s": round(used[name], 2) for name in self.groups},
            "other_s": round(max(used["machine_busy"] - ours, 0.0), 2),
            "machine_busy_percent": round(100 * used["machine_busy"] / used["machine_total"], 1)
            if used["machine_total"]
            else None,
        }


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def latency_summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "p50_ms": ms(percentile(ordered, 50)),
        "p90_ms": ms(percentile(ordered, 90)),
        "p99_ms": ms(percentile(ordered, 99)),
        "max_ms": ms(ordered[-1]),
    }


def summarize(samples: list[Sample], duration: float, *, open_loop: bool) -> dict[str, Any]:
    """Counts and latencies of one class in one phase.

    Latency is from when the request was due for the open-loop charges (so a request the
    generator sent late is not flattered), from when it was sent for the closed-loop flood.
    """
    statuses = Counter(s.status for s in samples if s.status is not None)
    ok = [s for s in samples if s.status is not None and 200 <= s.status < 300]
    answered = [s for s in samples if s.status is not None]

    def latency(s: Sample) -> float:
        return s.done - (s.due if open_loop else s.sent)

    n = len(samples)
    return {
        "requests": n,
        "successes": len(ok),
        "success_rate": round(len(ok) / n, 4) if n else None,
        "status_429": statuses.get(429, 0),
        "status_503": statuses.get(503, 0),
        "shed_by_fleet": sum(s.shed_by == "fleet" for s in samples),
        "shed_by_worker": sum(s.shed_by == "worker" for s in samples),
        "other_statuses": {
            str(k): v for k, v in sorted(statuses.items()) if not 200 <= k < 300 and k not in (429, 503)
        },
        "errors": dict(Counter(s.error for s in samples if s.error)),
        "degraded": sum(s.degraded for s in samples),
        "refused_from_memory": sum(s.local == "denial" for s in samples),
        "successes_per_s": round(len(ok) / duration, 1),
        "latency_successes": latency_summary([latency(s) for s in ok]),
        "latency_all": latency_summary([latency(s) for s in answered]),
        "send_lag_p99_ms": ms(percentile(sorted(s.sent - s.due for s in samples), 99)) if samples else None,
    }


def run_phase(
    name: str,
    port: int,
    *,
    duration: float,
    settle: float,
    flood: str | None,
    pids: dict[str, list[int]],
    charges: bool = True,
    idle_rate: float = 0.0,
) -> dict[str, Any]:
    """One phase, measured. ``idle_rate``: CPU seconds a second gunicorn uses with nothing to do,
    taken off the CPU a phase without charges used before it is divided by its requests."""
    label = ("charges and " if charges else "") + (f"the {flood} flood" if flood else "nothing else")
    log(f"phase {name}: {label}, {settle:g} s settle + {duration:g} s measured")
    phase = Phase(name, port, duration=duration, settle=settle, flood=flood, charges=charges)
    started = time.monotonic()
    load = os.getloadavg()[0]
    meter = CpuMeter(pids)
    phase.run()
    result: dict[str, Any] = {
        "duration_s": duration,
        "settle_s": settle,
        "wall_s": round(time.monotonic() - started, 1),
        "load_average_1m_at_start": round(load, 2),
        "cpu": meter.stop(),
    }
    if charges:
        result["critical"] = summarize(phase.measured("critical"), duration, open_loop=True)
    # Other work on the machine averaging more than a quarter of a CPU: latencies are suspect.
    result["noisy"] = result["cpu"]["other_s"] > NOISY_OTHER_CPUS * result["wall_s"]
    if flood == "periodic":
        result["low"] = summarize(phase.measured("low"), duration, open_loop=False)
        result["low"]["flood_missed_periods"] = phase.flood_missed_periods
    elif flood is not None:
        klass = CLOSED_FLOODS[flood][0]
        # Every request of the phase, warm-up included: the CPU was measured over all of them.
        every = len([s for s in phase.samples if s.klass == klass])
        result[klass] = summarize(phase.measured(klass), duration, open_loop=False)
        if not charges and every:
            busy = result["cpu"]["gunicorn_s"] - idle_rate * result["wall_s"]
            result[klass]["gunicorn_cpu_us_per_request"] = round(max(busy, 0.0) * 1e6 / every, 1)
    return result


def demo_server(name: str, port: int, workdir: Path) -> Service:
    """The demo under gunicorn as every phase runs it: gthread, WORKERS x THREADS, logs in ``workdir``."""
    return gunicorn(name, port=port, logs=workdir, workers=WORKERS, threads=THREADS, timeout=60)


def warm_up(port: int, seconds: float) -> None:
    """Untimed traffic after a (re)start: both workers import their views, open DB and Redis connections."""
    Phase("warm-up", port, duration=seconds, settle=0, flood=None).run()
    exports = [threading.Thread(target=attempt, args=(port, "low", key, time.monotonic())) for key in flood_keys()[:2]]
    for thread in exports:
        thread.start()
    for thread in exports:
        thread.join(CLIENT_TIMEOUT + 5)


def probe_exports(port: int, rounds: int) -> dict[str, Any]:
    """After the flood: with nothing else in flight, 3 exports at once must all be admitted.

    Three fit under either shedder's low-priority limit (4 per worker, 9 in the fleet) even if
    they all land on one worker; a 503 here means in-flight counts leaked during the flood.
    """
    results: list[Sample] = []

    def one(key: str) -> None:
        results.append(attempt(port, "low", key, time.monotonic()))

    for _ in range(rounds):
        threads = [threading.Thread(target=one, args=(key,)) for key in flood_keys()[:3]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(CLIENT_TIMEOUT + 5)
    statuses = [s.status for s in results]
    return {"exports": len(statuses), "admitted": sum(1 for s in statuses if s is not None and 200 <= s < 300)}


def fleet_slots(server: RedisServer, wait: float = 2.0) -> dict[str, Any]:
    """Members of the fleet's in-flight sets once every response has arrived, and after up to ``wait`` s.

    A slot is released on ``request_finished``, just after the response has left the worker, so
    one can still be held when its client already has the response; one still there seconds
    later was not released (it would only go when ``SHEDDING['SLOT_TTL']`` expires it).
    """
    client = server.client()

    def count() -> int:
        return sum(int(client.zcard(key)) for key in client.scan_iter(match="*:fleet:*", count=1000))

    try:
        started = time.monotonic()
        first = last = count()
        while last and time.monotonic() - started < wait:
            time.sleep(0.05)
            last = count()
        return {"at_drain": first, "after_wait": last, "waited_s": round(time.monotonic() - started, 2)}
    finally:
        client.close()


LOG_PATTERNS = {
    "degraded": "backend unavailable, degrading",
    "release_left_to_expiry": "slot release left to expiry",
    "traceback": "Traceback",
    "worker_timeout": "WORKER TIMEOUT",
    "database_locked": "database is locked",
}


def log_counts(text: str) -> dict[str, int]:
    return {name: text.count(pattern) for name, pattern in LOG_PATTERNS.items()}


def log_excerpt(text: str, limit: int = 20) -> list[str]:
    """The server log's lines that match a pattern (the first ``limit``), kept in the JSON."""
    return [line for line in text.splitlines() if any(p in line for p in LOG_PATTERNS.values())][:limit]


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    found = {}
    for name in ("gunicorn", "Django", "djangorestframework", "redis", "hiredis"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=10).stdout
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": found,
        "redis_server": redis_version.split()[2].removeprefix("v=") if redis_version else "unknown",
    }


def source_version() -> dict[str, Any]:
    """The commit measured, and whether ``ratelimits/`` or ``project/`` differed from it (read-only git)."""

    def git(*command: str) -> str | None:
        try:
            done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "ratelimits", "project")
    return {"commit": git("rev-parse", "--short", "HEAD"), "app_modified": None if status is None else bool(status)}
