"""``python -m bench.instructions``: the instructions Redis runs per decision, counted, not timed.

Runs the main bench's scenarios (bench/scenarios.py) against a private ``redis-server`` under
valgrind's callgrind, and reads how many instructions the server executed for each block of
decisions. A count is the same on a busy machine as on an idle one, and from run to run: what a
change to a script saves shows up to the thousand instructions, where the timed bench's CPU
columns move by a tenth between two runs. What it does not see: the kernel's work for the
socket (most of a PING's cost), and cache misses. So read its ratios against the anchors, which
pay the same network, and the timed bench's ``INFO cpu`` for the bill. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ratelimits.backends import codec

from .support.redis_server import RedisServer

RESULTS = Path(__file__).resolve().parent / "results"
#: Decisions each block counts over, after as many untimed ones as the bench's subjects and more.
CALLS = 2_000
WARM_CALLS = 1_100


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Callgrind:
    """``callgrind_control`` on one valgrind'd process: zero its counters, then read them."""

    def __init__(self, server: RedisServer, out: Path) -> None:
        self.pid = str(server.pid)
        self.out = out

    def zero(self) -> None:
        subprocess.run(["callgrind_control", "-z", self.pid], capture_output=True, check=True, timeout=60)

    def read(self) -> int:
        """Instructions executed since :meth:`zero` (a dump, read from its file)."""
        subprocess.run(["callgrind_control", "-d", self.pid], capture_output=True, check=True, timeout=60)
        dumps = sorted(self.out.parent.glob(self.out.name + ".*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        found = re.search(r"^(?:summary|totals): (\d+)", dumps[-1].read_text(), re.M)
        if found is None:
            raise RuntimeError(f"no totals in {dumps[-1]}")
        return int(found.group(1))


#: How many numbers the decide script's request header and check record hold (a check's TTL is its last).
_REQUEST_FIELDS = len(codec.REQUEST.unpack(bytes(codec.REQUEST.size)))
_CHECK_FIELDS = len(codec.CHECK.unpack(bytes(codec.CHECK.size)))
#: The part that counts usage: what a decision that counts none does not run.
USAGE_PART = "+ one HINCRBY of the usage row"
#: Where a four-dimension decision's instructions go: a script built up a line at a time, each run
#: with the very KEYS and ARGV of the 4-dimension throttle's decisions (lua/decide.lua says what
#: each is). Each part's cost is its row minus the one before; decide.lua's own arithmetic and
#: bookkeeping are what it costs beyond the last row.
PARTS = (
    ("a call with a decision's KEYS and ARGV, doing nothing", ""),
    ("+ TIME", "local t = redis.call('TIME')"),
    ("+ one MGET of the version stamp and the 4 states", "local stored = redis.call('MGET', unpack(KEYS, 1, 5))"),
    (
        "+ unpacking the request and its 4 check records",
        f"local u = struct.unpack local pos = select({_REQUEST_FIELDS + 1}, u('{codec.REQUEST.format}', ARGV[1])) "
        f"local ttls, _, ttl = {{}} for i = 1, 4 do {'_, ' * (_CHECK_FIELDS - 1)}ttl, pos = "
        f"u('{codec.CHECK.format}', ARGV[1], pos) ttls[i] = ttl end",
    ),
    (
        "+ 4 SET ... PX of 16-byte states",
        "for i = 1, 4 do redis.call('SET', KEYS[i + 1], string.sub(ARGV[1], 1, 16), 'PX', ttls[i]) end",
    ),
    (USAGE_PART, "redis.call('HINCRBY', KEYS[6], ARGV[2] .. 'a', 1)"),
    ("+ a reply of 14 numbers", "return {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}"),
)
#: One part done another way, in place of the cumulative script's: what a redesign would save.
ALTERNATIVES = (
    (
        "4 SET ... KEEPTTL in place of PX",
        "for i = 1, 4 do redis.call('SET', KEYS[i + 1], string.sub(ARGV[1], 1, 16), 'KEEPTTL') end",
        "+ 4 SET ... PX of 16-byte states",
    ),
    (
        "the request and its 4 records unpacked in one call",
        f"local fields = {{struct.unpack('{codec.REQUEST.format}' .. "
        f"string.rep('{codec.CHECK.format[1:]}', 4), ARGV[1])}}",
        "+ unpacking the request and its 4 check records",
    ),
    (
        "a reply of the 14 numbers packed in one string, and the version",
        "return {struct.pack('<' .. string.rep('d', 14), 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14), stored[1]}",
        "+ a reply of 14 numbers",
    ),
)


def parts(backend: Any, calls: list[Any], callgrind: Callgrind, count: int) -> dict[str, int]:
    """The instructions of each cumulative part script, and of each alternative (see :data:`PARTS`)."""
    from .scenarios import bench_script_text

    found: dict[str, int] = {}
    lines: list[str] = []
    scripts: list[tuple[str, str]] = []
    for label, line in PARTS:
        lines.append(line)
        scripts.append((label, "\n".join(lines) + ("" if line.startswith("return") else "\nreturn 1")))
    for label, line, replaces in ALTERNATIVES:
        upto = [part for part, _ in PARTS].index(replaces)
        body = [*[part_line for _, part_line in PARTS[:upto]], line]
        scripts.append((label, "\n".join(body) + ("" if line.startswith("return") else "\nreturn 1")))
    run = backend._run
    for label, text in scripts:
        script = bench_script_text(f"part {label}", text)
        for i in range(WARM_CALLS):
            run(script, *calls[i % len(calls)])
        callgrind.zero()
        for i in range(count):
            run(script, *calls[i % len(calls)])
        found[label] = round(callgrind.read() / count)
        log(f"  {label}: {found[label]:,}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help=f"decisions counted per scenario (default {CALLS})")
    parser.add_argument("--json", type=Path, default=RESULTS / "instructions.json", help="where to write the results")
    args = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            log(f"{tool} is not on PATH")
            return 2
    # Background work runs by the clock, not by the calls: under valgrind a call takes some fifty
    # times longer, so the server's cron (10 a second) and its active expiry (sampling the keys
    # with a TTL) would add counts that depend on how busy the machine is. Both are held off: the
    # cron to once a second, active expiry entirely (a key read after its TTL still expires then).
    server = RedisServer(config=("--hz", "1", "--enable-debug-command", "yes"))
    out = server.dir / "callgrind.out"
    server.service.argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *server.service.argv]
    try:
        server.start(timeout=120)
        with server.client() as client:
            client.execute_command("DEBUG", "SET-ACTIVE-EXPIRE", "0")
        log(f"private redis-server under callgrind, pid {server.pid}, port {server.port}")
        return run(args, server, Callgrind(server, out))
    finally:
        server.stop()


def scenarios_backend() -> Any:
    """The limiter's own Redis backend (the one the scenarios decide with)."""
    from ratelimits.engine import get_limiter

    return get_limiter().backend


def run(args: argparse.Namespace, server: RedisServer, callgrind: Callgrind) -> int:
    from . import settings

    settings.SOCKET_TIMEOUT = "5s"
    settings.configure(server.url, f"redis://127.0.0.1:{server.port}/1")
    from . import scenarios as sc

    counts: dict[str, int] = {}
    labels: dict[str, str] = {}
    for scenario in sc.build(server.url):
        with scenario.active():
            call = scenario.call
            for i in range(WARM_CALLS):
                call(i)
            callgrind.zero()
            for i in range(WARM_CALLS, WARM_CALLS + args.calls):
                call(i)
            counts[scenario.key] = round(callgrind.read() / args.calls)
        labels[scenario.key] = scenario.label
        log(f"  {scenario.key}: {counts[scenario.key]:,} instructions per decision")
    backend = scenarios_backend()
    requests = sc.build_requests()
    view = sc.BenchView()
    calls = sc.decision_calls(backend, requests, [sc.checks_for(request, view) for request in requests])
    costs = parts(backend, calls, callgrind, args.calls)
    ping, envoy = counts["ping"], counts["envoy_4"]
    rows = {
        key: {
            "label": labels[key],
            "instructions": n,
            "over_ping": round(n / ping, 2),
            "over_envoy_4": round(n / envoy, 2),
        }
        for key, n in counts.items()
    }
    header = f"{'scenario':<46} {'instructions':>12} {'x PING':>8} {'x Envoy 4':>10}"
    print(f"Instructions redis-server ran per decision (callgrind, {args.calls:,} decisions a scenario)")
    print(header)
    print("-" * len(header))
    for row in rows.values():
        print(f"{row['label']:<46} {row['instructions']:>12,} {row['over_ping']:>8} {row['over_envoy_4']:>10}")
    print()
    print("Where a 4-dimension decision's instructions go (each part's script, run with its KEYS and ARGV)")
    header = f"{'part':<56} {'instructions':>12} {'the part':>9}"
    print(header)
    print("-" * len(header))
    cumulative = [label for label, _ in PARTS]
    # Each part's own cost: its script's count less the one before it (for an alternative, the one
    # before the part it replaces).
    before = dict(zip(cumulative, [0, *(costs[label] for label in cumulative[:-1])], strict=True))
    added = {label: costs[label] - before[label] for label in cumulative}
    added |= {label: costs[label] - before[replaces] for label, _, replaces in ALTERNATIVES}
    for label in added:
        print(f"{label:<56} {costs[label]:>12,} {added[label]:>+9,}")
    # What decide.lua does beyond the parts: its arithmetic and bookkeeping. The throttle's call
    # counts usage; RedisBackend.decide's do not (their parts less the HINCRBY).
    floor = costs[cumulative[-1]]
    without_usage = floor - added[USAGE_PART]
    for key, parts_cost in (
        ("ratelimits_4dim", floor),
        ("decide_4", without_usage),
        ("decide_4_script", without_usage),
    ):
        print(f"{'beyond the parts: ' + labels[key]:<56} {counts[key]:>12,} {counts[key] - parts_cost:>+9,}")
    report: dict[str, Any] = {"calls": args.calls, "scenarios": rows, "parts": costs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
