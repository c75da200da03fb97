"""Two regions on private redis-servers, global policies' shares in them, and demand that moves between them.

Used by ``python -m bench.regions`` and ``tests/test_regions*.py``: the same traffic, measured the
same way, whether the reconciler runs in a thread (the bench) or under Celery beat (the tests).
Here, in bench, because bench imports nothing of the tests; the tests may import bench. A server is
anything with a loopback ``port`` and a ``url`` (bench's redis-server, or the tests').
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ratelimits.backends import layout
from ratelimits.backends.redis import RedisBackend
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies.values import Check, Policy, Scope
from ratelimits.rates import parse_rate
from ratelimits.shares import ShareRecord


class RedisServer(Protocol):
    """A redis-server on loopback, as this module needs to know it."""

    @property
    def port(self) -> int: ...

    @property
    def url(self) -> str: ...


__all__ = ["MovingDemand", "global_check", "region_settings", "run_moving_demand", "share_in"]

PREFIX = "rl"


def quick_client(server: RedisServer) -> redis.Redis:
    """A client that gives up on a stopped server in 250 ms, once (a partition test stops one)."""
    return redis.Redis(
        host="127.0.0.1",
        port=server.port,
        socket_timeout=0.25,
        socket_connect_timeout=0.25,
        retry=Retry(NoBackoff(), 0),  # redis-py's default retries would wait seconds on a stopped server
    )


def region_settings(servers: Mapping[str, RedisServer], region: str) -> dict[str, Any]:
    """``RATELIMITS`` keys naming every region's store, this deployment being ``region``."""
    return {"REGIONS": {"CURRENT": region, "STORES": {name: server.url for name, server in servers.items()}}}


def global_check(rate: str, burst: int, subject: str = "acme") -> Check:
    policy = Policy("tier:global", parse_rate(rate), burst, scope=Scope.GLOBAL)
    return Check(policy, Subject(SubjectKind.ORG, subject), 1)


def share_in(server: RedisServer, check: Check, regions: int, now_us: float | None = None) -> float:
    """The share of ``check``'s global limit that ``server``'s region enforces now (the even split without a record)."""
    client = quick_client(server)
    try:
        value = client.get(layout.share_key(check.key(PREFIX)))
        if now_us is None:
            seconds, micros = client.time()
            now_us = seconds * 1_000_000 + micros
    finally:
        client.close()
    return ShareRecord.unpack(value).effective(now_us) if value else 1 / regions


@dataclass
class MovingDemand:
    """What a run of :func:`run_moving_demand` saw."""

    limit: float
    burst: int
    #: Phases as ``(start, end, busy region)`` in seconds from the start.
    phases: list[tuple[float, float, str]]
    offered: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    #: Admitted only on the store's word (a degraded decision, by a fail mode, is not counted here).
    degraded: int = 0
    elapsed: float = 0.0
    #: ``(seconds from the start, {region: share})``, sampled every 50 ms.
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    @property
    def bound(self) -> float:
        """``burst + rate x elapsed``: what one bucket of the global limit could have admitted."""
        return self.burst + self.limit * self.elapsed

    @property
    def total(self) -> int:
        return sum(self.admitted.values())

    @property
    def excess(self) -> float:
        """Admissions over the bound, as a share of it (0 when under)."""
        return max(self.total - self.bound, 0) / self.bound

    def growth(self, phase: int, region: str, share: float) -> float | None:
        """Seconds from the start of ``phase`` until ``region`` held at least ``share`` (``None``: never)."""
        start, end, _ = self.phases[phase]
        for at, shares in self.samples:
            if start <= at <= end and shares[region] >= share:
                return at - start
        return None

    def most(self) -> float:
        """The largest sum of every region's share in any sample where every region answered."""
        sums = [sum(shares.values()) for _, shares in self.samples]
        return max((total for total in sums if not math.isnan(total)), default=math.nan)

    def over(self) -> list[tuple[float, dict[str, float]]]:
        """The samples whose shares sum above the limit (none, if the reconciler is right)."""
        return [(at, shares) for at, shares in self.samples if sum(shares.values()) > 1 + 1e-9]

    def report(self) -> str:
        lines = [
            f"global limit {self.limit:g}/s, burst {self.burst}; {self.elapsed:.1f} s; demand moved "
            + " -> ".join(busy for _, _, busy in self.phases),
            f"admitted {self.total} (per region {self.admitted}) of {sum(self.offered.values())} offered "
            f"(per region {self.offered}); bound burst + rate x elapsed = {self.bound:.0f}; "
            f"admitted / bound = {self.total / self.bound:.4f} (excess {self.excess:.2%}); "
            f"largest sum of shares sampled {self.most():.4f}",
        ]
        for i, (_, _, busy) in enumerate(self.phases[1:], start=1):
            grew = self.growth(i, busy, 0.4)
            whole = self.growth(i, busy, 0.9)
            lines.append(
                f"phase {i}: {busy}'s share reached 0.4 after "
                + (f"{grew:.2f} s" if grew is not None else "never")
                + ", 0.9 after "
                + (f"{whole:.2f} s" if whole is not None else "never")
            )
        return "\n".join(lines)


def run_moving_demand(
    servers: Mapping[str, RedisServer],
    check: Check,
    *,
    phases: Sequence[tuple[float, str]],
    offered: float,
    trickle: float,
    during: Callable[[float], None] | None = None,
) -> MovingDemand:
    """Offer ``check``'s subject ``offered`` requests a second in the busy region of each phase
    (``(seconds, region)``) and ``trickle`` in the others, one paced thread per region; sample every
    region's share meanwhile. ``during(seconds from the start)`` is called by the sampler.

    Phases start half way through a second: the reconciler reads whole seconds, so the first
    second read after a move already holds half a second of the new demand.
    """
    backends = {name: RedisBackend(quick_client(server), prefix=PREFIX) for name, server in servers.items()}
    time.sleep(1.5 - time.time() % 1)  # the next half second (a start, not a synchronisation)
    start = time.monotonic()
    bounds, at = [], 0.0
    for seconds, busy in phases:
        bounds.append((at, at + seconds, busy))
        at += seconds
    result = MovingDemand(check.policy.rate.limit * 1_000_000 / check.policy.rate.period_us, check.policy.burst, bounds)
    result.offered = dict.fromkeys(servers, 0)
    result.admitted = dict.fromkeys(servers, 0)
    lock = threading.Lock()
    done = threading.Event()

    def traffic(name: str) -> None:
        backend = backends[name]
        due = time.monotonic()
        offered_here = admitted = degraded = 0
        while True:
            now = time.monotonic() - start
            if now >= at:
                break
            busy = next(b for s, e, b in bounds if s <= now < e)
            rate = offered if busy == name else trickle
            time.sleep(max(due - time.monotonic(), 0))
            due = max(due, time.monotonic()) + 1 / rate
            try:
                decision = backend.decide([check])
            except BackendUnavailable:  # the store is stopped (a partition): it admits nothing
                degraded += 1
                continue
            offered_here += 1
            admitted += decision.allowed
        with lock:
            result.offered[name] += offered_here
            result.admitted[name] += admitted
            result.degraded += degraded

    def read() -> dict[str, float]:
        shares = {}
        for name, server in servers.items():
            try:
                shares[name] = share_in(server, check, len(servers))
            except redis.RedisError:
                shares[name] = math.nan  # stopped: its share is what it last was
        return shares

    def sample() -> None:
        while not done.wait(0.05):
            now = time.monotonic() - start
            # The regions are read one after the other, so a round may fall between two reads: read
            # them all twice and keep each one's least. A round lowers before it raises, so some
            # pair of reads is of one moment's shares, and the least of each is never above it.
            first, second = read(), read()
            result.samples.append((now, {name: min(first[name], second[name]) for name in servers}))
            if during is not None:
                during(now)

    threads = [threading.Thread(target=traffic, args=(name,), daemon=True) for name in servers]
    sampler = threading.Thread(target=sample, daemon=True)
    for thread in (*threads, sampler):
        thread.start()
    for thread in threads:
        thread.join(at + 30)
    result.elapsed = time.monotonic() - start
    done.set()
    sampler.join(10)
    for backend in backends.values():
        backend.client.close()
    return result
