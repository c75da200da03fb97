"""Storms with the local fast path on: 4 worker processes x 8 threads on one real Redis, each process a
worker with its own limiter (the exact denial cache and token leases on), all asking about one key.

Whatever the workers answer from memory, the fleet never admits more than the bucket allows:
leased tokens were taken from it first, and a remembered denial admits nothing.
"""

from __future__ import annotations

import pytest
import redis

from ratelimits.algorithms import Algorithm
from ratelimits.conf import LocalPathSettings
from ratelimits.identity import Subject
from ratelimits.policies.values import Check, Policy
from ratelimits.rates import parse_rate

from .support.redis_server import RedisServer
from .support.storm import StormReport, run_storm

pytestmark = pytest.mark.slow

PROCESSES, THREADS, ATTEMPTS = 4, 8, 400
LOCAL = LocalPathSettings(leases=True, lease_share=0.25)
CALLER = Subject("api_key", "local-storm")


def bound(report: StormReport, policy: Policy) -> float:
    """burst + rate x elapsed over the storm (Redis TIME read before its start and after its end)."""
    return policy.burst + report.elapsed_us * policy.rate.limit / policy.rate.period_us


def assert_ran(report: StormReport) -> None:
    assert not report.errors, "\n".join(report.errors)
    assert len(report.pids) == PROCESSES
    assert len(report.attempts) == PROCESSES * THREADS * ATTEMPTS


@pytest.mark.parametrize(
    ("rate", "burst", "answered_by"),
    [("200/s", 50, "denial"), ("2000/s", 400, "lease")],
    ids=["flooded", "busy"],
)
def test_the_fleet_admits_no_more_than_the_bucket_with_leases_and_denials(
    redis_server: RedisServer, redis_client: redis.Redis, rate: str, burst: int, answered_by: str
) -> None:
    """Unpaced storms on one key: far over a small limit (mostly refused from memory), and over a
    large one (leases taken and spent while it has tokens, then waits too short to remember): in
    both, admissions stay within burst + rate x elapsed."""
    policy = Policy("storm", parse_rate(rate), burst, Algorithm.TOKEN_BUCKET)
    report = run_storm(
        redis_server.url,
        lambda p, t: [Check(policy, CALLER)],
        processes=PROCESSES,
        threads=THREADS,
        attempts=ATTEMPTS,
        local=LOCAL,
    )
    assert_ran(report)
    admitted = len(report.admitted)
    assert admitted <= bound(report, policy), (admitted, bound(report, policy))
    answered = {kind: sum(a.local == kind for a in report.attempts) for kind in ("denial", "lease")}
    # The local path really answered: mostly refusals from memory when flooded, leases when busy.
    assert answered[answered_by] > (0.5 * len(report.attempts) if answered_by == "denial" else 100), answered
    print(
        f"\n{rate} burst {burst}: {admitted} admitted of {len(report.attempts)} (bound {bound(report, policy):.0f}) "
        f"in {report.elapsed_us / 1000:.0f} ms; from memory: {answered}"
    )
