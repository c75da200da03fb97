"""``python -m bench.plumbing``: where a throttle call's Python time goes, each part removed in turn.

The main bench times the four-dimension throttle against Redis, where a round trip's wait and the
store's work hide the worker's own. This one times the worker's Python alone: the store's answer
is replayed (the decide script's reply, recorded from a real call and given back at once with the
clock of the moment; nothing is sent), so what is left is the identity, the policy resolution, the
usage row, the limiter (breaker, local path), the backend's call making and reading, the headers
and the glue between them.

Then each part is removed in turn: replaced by what it gave that caller, recorded beforehand. What
the call saves is what the part costs in place, between the others (a part timed alone runs
hotter in the CPU's caches than it does in a request). The variants take turns in interleaved
rounds over the bench's 1,024 callers, and each figure is the median of its rounds. Every
replacement counts its calls, and the report says how many each call made (one: the part was
really taken out).

It starts a private ``redis-server`` on a free loopback port (for the recorded reply and the row
with the store asked) and stops it by PID. Issue 28 defines the plumbing as the throttle minus
``RedisBackend.decide``; both are printed, replayed, and their difference.

``--instructions`` counts instead of timing: it runs the replayed call under valgrind's callgrind
in two child processes (1,000 and 6,000 calls, ``PYTHONHASHSEED=0``, against this process's
private Redis), and the difference over 5,000 is the instructions of one call. Callgrind counts
every thread of a child, and the background threads' work grows with the time a run takes, which
does not cancel out: counts of the same code have moved by up to 4 % between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .support.redis_server import RedisServer

#: The issue's target for the plumbing (throttle minus decide), in microseconds.
TARGET_US = 15.0
RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plumbing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per variant per round (default 20,000)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--json", type=Path, default=RESULTS / "plumbing.json", help="where to write the figures")
    parser.add_argument(
        "--instructions", action="store_true", help="count the replayed call's instructions under callgrind (~3 min)"
    )
    # A callgrind child's calls, on its parent's Redis (which the parent stops).
    parser.add_argument("--replayed-only", type=int, nargs=2, metavar=("CALLS", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replayed_only is not None:
        calls, port = args.replayed_only
        replay_only(port, calls)
        return 0
    server = RedisServer()  # never on port 6379, the shared Redis
    try:
        server.start()
        log(f"private redis-server pid {server.pid} on 127.0.0.1:{server.port}")
        if args.instructions:
            return count_instructions(server.port)
        report = measure(server.port, args.calls, args.rounds)
    finally:
        server.stop()
        log("stopped redis-server")
    print(render(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.json}")
    return 0


@dataclass
class Variant:
    """One way of making the call: its patches (``(owner, attribute, replacement)``), and its figures."""

    name: str
    call: Callable[[int], None]
    patches: tuple[tuple[Any, str, Callable[..., Any]], ...] = ()
    #: The store's reply replayed (else the store is asked).
    replayed: bool = True
    #: A part of the throttle's path this variant takes out (its cost is the replayed row's minus this one's).
    part: bool = True
    rounds: list[float] = field(default_factory=list)
    replaced_calls: int = 0
    calls: int = 0

    @contextmanager
    def active(self, replay: Callable[..., Any], redis_module: Any) -> Iterator[None]:
        with ExitStack() as stack:
            if self.replayed:
                stack.enter_context(_patched(redis_module, "call", replay))
            for owner, name, replacement in self.patches:
                stack.enter_context(_patched(owner, name, self._counted(replacement)))
            yield

    def _counted(self, replacement: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.replaced_calls += 1
            return replacement(*args, **kwargs)

        return counted


def measure(port: int, calls: int, rounds: int) -> dict[str, Any]:
    url = f"redis://127.0.0.1:{port}/0"
    from .settings import configure, ratelimits_settings

    configure(url, f"redis://127.0.0.1:{port}/1")
    from django.test import override_settings

    with override_settings(RATELIMITS=ratelimits_settings(url, dimensions=4)):
        path = _Path()
        variants = path.variants()
        log(f"{len(variants)} variants x {rounds} rounds x {calls:,} calls")
        for _ in range(rounds):
            for variant in variants:
                with variant.active(path.replay, path.redis_module):
                    variant.rounds.append(_per_call_us(variant, calls))
    figures = {v.name: statistics.median(v.rounds) for v in variants}
    replayed = figures["throttle, reply replayed"]
    parts = {v.name: replayed - figures[v.name] for v in variants if v.patches and v.part}
    decide = figures["RedisBackend.decide alone, reply replayed"]
    return {
        "calls": calls,
        "rounds": rounds,
        "us_per_call": figures,
        "part_us": parts,
        "rest_us": replayed - sum(parts.values()),
        "replaced_calls_per_call": {v.name: v.replaced_calls / v.calls for v in variants if v.patches},
        "plumbing_us": replayed - decide,
        "plumbing_target_us": TARGET_US,
        "store_us": figures["throttle, store asked"] - replayed,
    }


#: The callgrind children's calls: the difference is one call's instructions times their difference.
COUNTED_CALLS = (1_000, 6_000)


def count_instructions(port: int) -> int:
    """Instructions of one replayed throttle call: two children under callgrind, the difference."""
    if shutil.which("valgrind") is None:
        log("valgrind is not on PATH; install it to count instructions")
        return 2
    totals = []
    for calls in COUNTED_CALLS:
        # A child that outlives its timeout is killed; the Redis it used is this process's, stopped after.
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--callgrind-out-file=/dev/null",
                sys.executable,
                "-m",
                "bench.plumbing",
                "--replayed-only",
                str(calls),
                str(port),
            ],
            env={**os.environ, "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode != 0 or found is None:
            log(done.stderr[-2000:])
            return 1
        totals.append(int(found.group(1)))
        log(f"{calls:,} replayed calls: {totals[-1]:,} instructions in all")
    per_call = (totals[1] - totals[0]) / (COUNTED_CALLS[1] - COUNTED_CALLS[0])
    print(f"Instructions per four-dimension throttle call, the store's reply replayed: {per_call:,.0f}")
    return 0


def replay_only(port: int, calls: int) -> None:
    """What a callgrind child runs: the throttle ``calls`` times with the store's reply replayed."""
    url = f"redis://127.0.0.1:{port}/0"
    from .settings import configure, ratelimits_settings

    configure(url, f"redis://127.0.0.1:{port}/1")
    from django.test import override_settings

    with override_settings(RATELIMITS=ratelimits_settings(url, dimensions=4)):
        path = _Path()
        with _patched(path.redis_module, "call", path.replay):
            for i in range(calls):
                path.throttle(i)


def _per_call_us(variant: Variant, calls: int) -> float:
    call = variant.call
    warm = calls // 10  # the variant's own code warm again
    for i in range(warm):
        call(i)
    started = time.perf_counter_ns()
    for i in range(calls):
        call(i)
    elapsed = time.perf_counter_ns() - started
    variant.calls += warm + calls
    return elapsed / calls / 1000


class _Path:
    """The bench's four-dimension throttle, its recorded reply, and what each part gave each caller."""

    def __init__(self) -> None:
        from ratelimits import engine, throttles
        from ratelimits.backends import redis as redis_module
        from ratelimits.engine import evaluation
        from ratelimits.policies.source import get_policy_source

        from . import scenarios

        engine.reset()
        self.requests = scenarios.build_requests()
        self.throttle = scenarios.ratelimits_throttle(self.requests, scenarios.BenchView())
        for i in range(2 * len(self.requests)):  # every caller's state, the scripts and the connection in place
            self.throttle(i)
        self.limiter = engine.get_limiter()
        self.backend = self.limiter.backend
        self.source = get_policy_source()
        self.redis_module, self.evaluation, self.throttles = redis_module, evaluation, throttles
        real_call, replies = redis_module.call, []

        def recording(connection: Any, *command: Any) -> Any:
            replies.append(real_call(connection, *command))
            return replies[-1]

        with _patched(redis_module, "call", recording):
            self.throttle(0)
        self.reply = replies[-1]
        self.given: dict[str, dict[int, Any]] = {}
        self._record()

    def replay(self, connection: Any, *command: Any) -> Any:
        """The recorded reply, with the clock of the moment (as the store's would be)."""
        return [time.time_ns() // 1000, *self.reply[1:]]

    def _record(self) -> None:
        """What each part gives each caller, on one pass over them all (the reply replayed)."""
        evaluation, source, backend, throttles = self.evaluation, self.source, self.backend, self.throttles
        given = self.given = {"identity": {}, "checks": {}, "usage": {}, "decision": {}, "headers": {}}
        identify, checks_for, usage_of = evaluation.identify, source.checks_for, evaluation.usage_of
        decide, headers = backend.decide, throttles.rate_limit_headers

        def identified(request: Any, **kwargs: Any) -> Any:
            given["identity"][id(request)] = found = identify(request, **kwargs)
            return found

        def resolved(request: Any, identity: Any) -> Any:
            given["checks"][id(request)] = found = checks_for(request, identity)
            return list(found)

        def counted(identity: Any, checks: Any) -> Any:
            given["usage"][id(checks[0])] = usage = usage_of(identity, checks)
            return usage

        def decided(checks: Any, **kwargs: Any) -> Any:
            given["decision"][id(checks[0])] = decision = decide(checks, **kwargs)
            return decision

        def written(decision: Any) -> Any:
            given["headers"][id(decision.results[0].check)] = made = headers(decision)
            return dict(made)

        with ExitStack() as stack:
            stack.enter_context(_patched(self.redis_module, "call", self.replay))
            stack.enter_context(_patched(evaluation, "identify", identified))
            stack.enter_context(_patched(source, "checks_for", resolved))
            stack.enter_context(_patched(evaluation, "usage_of", counted))
            stack.enter_context(_patched(backend, "decide", decided))
            stack.enter_context(_patched(throttles, "rate_limit_headers", written))
            for i in range(len(self.requests)):
                self.throttle(i)
        # Each caller's own entry (its tier check leads its list): none overwrote another's.
        callers = len(self.requests)
        if any(len(recorded) != callers for recorded in given.values()):
            raise AssertionError(f"expected one recording per caller: {[len(r) for r in given.values()]}")

    def variants(self) -> list[Variant]:
        evaluation, source, backend, limiter, throttles = (
            self.evaluation,
            self.source,
            self.backend,
            self.limiter,
            self.throttles,
        )
        identities, checks, usages = self.given["identity"], self.given["checks"], self.given["usage"]
        decisions, headers = self.given["decision"], self.given["headers"]
        decide = backend.decide
        mask = len(self.requests) - 1
        check_lists = [checks[id(request)] for request in self.requests]
        usage_rows = [usages[id(found[0])] for found in check_lists]

        def decide_only(i: int) -> None:
            decide(check_lists[i & mask], consume=True, usage=usage_rows[i & mask])

        def backend_only(found: Any, consume: bool = True, usage: Any = None, settle: bool = False) -> Any:
            return decide(found, consume=consume, usage=usage)  # the bench's endpoint settles nothing

        throttle = self.throttle
        return [
            Variant("throttle, store asked", throttle, replayed=False, part=False),
            Variant("throttle, reply replayed", throttle, part=False),
            Variant("identity", throttle, ((evaluation, "identify", lambda request, **_: identities[id(request)]),)),
            Variant(
                "policy resolution",
                throttle,
                ((source, "checks_for", lambda request, identity: list(checks[id(request)])),),
            ),
            Variant("usage row", throttle, ((evaluation, "usage_of", lambda identity, found: usages[id(found[0])]),)),
            Variant("limiter (breaker, local path)", throttle, ((limiter, "decide", backend_only),)),
            Variant(
                "backend (call made, stamped, reply read)",
                throttle,
                ((backend, "decide", lambda found, consume=True, usage=None: decisions[id(found[0])]),),
            ),
            Variant(
                "headers",
                throttle,
                ((throttles, "rate_limit_headers", lambda decision: headers[id(decision.results[0].check)]),),
            ),
            Variant("RedisBackend.decide alone, reply replayed", decide_only, part=False),
        ]


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside; put back after (an instance's own attribute is removed)."""
    had = name in vars(owner)
    before = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


def render(report: dict[str, Any]) -> str:
    figures, parts = report["us_per_call"], report["part_us"]
    lines = [
        f"# The throttle's Python path, part by part ({report['rounds']} rounds x {report['calls']:,} calls, medians)",
        "",
        "| variant | µs per call | the part costs (µs) |",
        "|---|---:|---:|",
    ]
    for name, value in figures.items():
        label = f"{name} removed" if name in parts else name
        cost = f"{parts[name]:.1f}" if name in parts else ""
        lines.append(f"| {label} | {value:.1f} | {cost} |")
    lines += [
        f"| the rest: the throttle's, the engine's and the request's own lines | | {report['rest_us']:.1f} |",
        "",
        f"Plumbing (throttle minus decide, both replayed): {report['plumbing_us']:.1f} µs "
        f"(target {report['plumbing_target_us']:g} µs or less).",
        f"The store's round trip and work, as the worker waits for them: {report['store_us']:.1f} µs a call.",
        "Each replacement ran "
        + ", ".join(f"{n:.2f}" for n in report["replaced_calls_per_call"].values())
        + " times a call (1: the part was taken out of every call).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
