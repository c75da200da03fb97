"""Worker processes against one real Redis: storms of decisions, and a worker that dies holding slots.

The storm runs processes x threads deciding the same checks; :func:`hold_slots` takes slots and
hangs until the test kills it. Both live in an importable module because the ``spawn`` start
method re-imports the target function in each child. Each child builds its own client (sockets
are never inherited) and needs no Django settings: the checks' subject digests are computed by
the parent before pickling. Every thread waits on cross-process barriers that the parent also
joins, and every loop is bounded: a fixed number of attempts, barrier and queue waits with timeouts.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.conf import LocalPathSettings
from ratelimits.engine.breaker import CircuitBreaker
from ratelimits.engine.limiter import Limiter, build_limiter
from ratelimits.policies import Check
from ratelimits.redis_url import parse_redis_url

#: Seconds any participant waits at the start line or for a child's report before giving up.
START_TIMEOUT = 60.0
REPORT_TIMEOUT = 60.0
#: The longest a slot-holding child hangs if nobody kills it (the test kills it within seconds).
HANG_TIMEOUT = 60.0


@dataclass(frozen=True)
class Attempt:
    """One decision as a thread saw it."""

    allowed: bool
    #: Redis ``TIME`` inside the script that decided it (server clock mode).
    now_us: int
    #: Per check: (allowed, remaining).
    results: tuple[tuple[bool, int], ...]
    cost: int
    #: (pid, thread index) that made it.
    worker: tuple[int, int]
    #: How the worker answered without the store ("denial", "lease"), if it did (a storm with the local path).
    local: str | None = None


@dataclass
class StormReport:
    attempts: list[Attempt] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    #: Redis TIME (us) read by the parent just before it released the start line / after all reports.
    start_us: int = 0
    end_us: int = 0

    @property
    def admitted(self) -> list[Attempt]:
        return [a for a in self.attempts if a.allowed]

    @property
    def admitted_cost(self) -> int:
        return sum(a.cost for a in self.admitted)

    @property
    def elapsed_us(self) -> int:
        return self.end_us - self.start_us

    def spans(self) -> dict[int, tuple[int, int]]:
        """Per process, the Redis times of its first and last decision."""
        spans: dict[int, tuple[int, int]] = {}
        for a in self.attempts:
            first, last = spans.get(a.worker[0], (a.now_us, a.now_us))
            spans[a.worker[0]] = (min(first, a.now_us), max(last, a.now_us))
        return spans


def backend_for(url: str) -> RedisBackend:
    """A backend on ``url``'s Redis (a cluster's for a cluster URL), deciding on the Redis clock."""
    client = make_client(url, 2.0, 2.0)
    if isinstance(client, redis.RedisCluster):
        return ClusterBackend(client, clock=None)
    return RedisBackend(client, clock=None)


def timer_for(url: str) -> redis.Redis:
    """A client for reading Redis ``TIME``: of the server, or of a cluster's first node (one machine, one clock)."""
    target = parse_redis_url(url)
    if target.cluster:
        host, port = target.addresses[0]
        return redis.Redis(host=host, port=port, socket_timeout=5)
    return redis.Redis.from_url(url, socket_timeout=5)


def redis_time_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def limiter_for(backend: RedisBackend, local: LocalPathSettings) -> Limiter:
    """A worker's limiter on ``backend`` with the local fast path, as the engine builds one."""
    breaker = CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=2.0)
    return build_limiter(backend, breaker, local, usage_cap=100)


def _thread_body(
    backend: RedisBackend,
    limiter: Limiter | None,
    checks: Sequence[Check | tuple[Check, ...]],
    attempts: int,
    barriers: tuple[Any, Any],
    out: list[Attempt],
    errors: list[str],
    index: int,
) -> None:
    ready, go = barriers
    try:
        # A tuple of checks is a sharded budget's shards: each attempt picks one, as the resolver does.
        rng = random.Random(f"{os.getpid()}-{index}")
        pick = [c if isinstance(c, Check) else None for c in checks]
        shards = [(i, c) for i, c in enumerate(checks) if not isinstance(c, Check)]
        first = [c if isinstance(c, Check) else c[0] for c in checks]
        backend.decide(first, consume=False)  # open the connections before the start line, not during the storm
        ready.wait(START_TIMEOUT)
        go.wait(START_TIMEOUT)
        cost = first[-1].cost
        for _ in range(attempts):
            for i, alternatives in shards:
                pick[i] = rng.choice(alternatives)
            decision = (limiter or backend).decide(pick)  # type: ignore[arg-type]
            out.append(
                Attempt(
                    allowed=decision.allowed,
                    now_us=decision.now_us,
                    results=tuple((r.allowed, r.remaining) for r in decision.results),
                    cost=cost,
                    worker=(os.getpid(), index),
                    local=decision.local,
                )
            )
            if limiter is not None:
                limiter.return_leases()  # after the response, as request_finished does
    except BaseException:  # reported to the parent, which fails the test
        errors.append(traceback.format_exc())
        ready.abort()
        go.abort()


def process_main(
    url: str,
    checks_per_thread: list[list[Check]],
    attempts: int,
    barriers: tuple[Any, Any],
    reports: Any,
    local: LocalPathSettings | None = None,
) -> None:
    """Child entry point: one backend (own client, Redis server clock), one thread per check list.

    With ``local``, the threads decide through one limiter with the local fast path (a worker's).
    """
    backend = backend_for(url)
    limiter = limiter_for(backend, local) if local is not None else None
    outs: list[list[Attempt]] = [[] for _ in checks_per_thread]
    errors: list[str] = []
    threads = [
        threading.Thread(
            target=_thread_body, args=(backend, limiter, checks, attempts, barriers, outs[i], errors, i), daemon=True
        )
        for i, checks in enumerate(checks_per_thread)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(START_TIMEOUT + REPORT_TIMEOUT)
        if thread.is_alive():
            errors.append(f"pid {os.getpid()}: a storm thread did not finish in time")
    reports.put((os.getpid(), [a for out in outs for a in out], errors))


def run_storm(
    url: str,
    checks_for: Any,
    *,
    processes: int = 4,
    threads: int = 8,
    attempts: int = 50,
    method: str = "spawn",
    local: LocalPathSettings | None = None,
) -> StormReport:
    """Run ``processes`` x ``threads`` workers, each making ``attempts`` decisions.

    ``checks_for(process_index, thread_index)`` returns the checks one thread decides (its
    last check's cost is recorded as the request's cost). Subjects' digests are computed
    here, so children need no Django settings.
    """
    ctx = multiprocessing.get_context(method)
    plan = [[list(checks_for(p, t)) for t in range(threads)] for p in range(processes)]
    for per_process in plan:
        for checks in per_process:
            for check in checks:
                for one in check if isinstance(check, tuple) else (check,):
                    one.key("rl")  # fills the cached digest that travels with the pickled Subject
    # Two start lines: "ready" (every thread connected, the parent included), then the parent
    # reads Redis TIME, then "go". So the measured span covers the storm, not process start-up.
    barriers = (ctx.Barrier(processes * threads + 1), ctx.Barrier(processes * threads + 1))
    reports = ctx.Queue()
    children = [
        ctx.Process(target=process_main, args=(url, plan[p], attempts, barriers, reports, local), daemon=True)
        for p in range(processes)
    ]
    report = StormReport()
    timer = timer_for(url)
    try:
        for child in children:
            child.start()
        try:
            barriers[0].wait(START_TIMEOUT)
            report.start_us = redis_time_us(timer)  # every decision happens after this instant
            barriers[1].wait(START_TIMEOUT)
        except threading.BrokenBarrierError:
            report.errors.append("the start line broke: a worker failed or never arrived")
        for _ in children:
            try:
                pid, attempts_seen, errors = reports.get(timeout=REPORT_TIMEOUT)
            except queue.Empty:
                report.errors.append("a worker process never reported")
                break
            report.pids.add(pid)
            report.attempts.extend(attempts_seen)
            report.errors.extend(errors)
        report.end_us = redis_time_us(timer)  # and before this one
        for child in children:
            child.join(REPORT_TIMEOUT)
            if child.exitcode != 0:
                report.errors.append(f"pid {child.pid} exited with {child.exitcode}")
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
                child.join(10)
        reports.close()
        timer.close()
    return report


def hold_slots(url: str, checks: Sequence[Check], count: int, reports: Any) -> None:
    """Admit ``count`` requests on ``checks`` (Redis server clock), report them, then hang holding them."""
    backend = backend_for(url)
    taken = []
    for _ in range(count):
        decision = backend.decide(checks)
        taken.append((decision.allowed, decision.slot, decision.slot_keys, decision.now_us))
    reports.put((os.getpid(), taken))
    threading.Event().wait(HANG_TIMEOUT)  # "busy with the requests" until SIGKILL
