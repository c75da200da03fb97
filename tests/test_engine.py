"""The Limiter's fail modes, against a Redis that is not there (a real refused connection)."""

from __future__ import annotations

import pytest

from ratelimits.algorithms import Algorithm
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.decisions import Verdict
from ratelimits.engine import Limiter
from ratelimits.engine.breaker import CircuitBreaker
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy
from ratelimits.rates import parse_rate

from .support.redis_server import free_port

ALICE = Subject("api_key", "alice")


@pytest.fixture
def limiter() -> Limiter:
    nobody_listens = make_client(f"redis://127.0.0.1:{free_port()}/0", 0.05, 0.05)
    return Limiter(
        RedisBackend(nobody_listens),
        CircuitBreaker(window=4, min_calls=2, cooldown=30),
        local=MemoryBackend(),
        local_share=0.25,
    )


def policy(name: str, mode: str, rate: str = "20/m", burst: int = 20) -> Policy:
    return Policy(name, parse_rate(rate), burst, Algorithm.TOKEN_BUCKET, mode)


def test_open_allows_and_counts(limiter: Limiter) -> None:
    decisions = [limiter.decide([Check(policy("p", "open"), ALICE)]) for _ in range(5)]
    assert all(d.allowed and d.degraded for d in decisions)
    assert limiter.degraded_count == 5


def test_closed_wins_over_open_with_a_wait_of_at_least_a_second(limiter: Limiter) -> None:
    decision = limiter.decide([Check(policy("a", "open"), ALICE), Check(policy("b", "closed"), ALICE)])
    assert decision.verdict is Verdict.UNAVAILABLE and decision.degraded
    assert decision.retry_after_us >= 1_000_000


def test_local_enforces_this_workers_share(limiter: Limiter) -> None:
    check = Check(policy("p", "local"), ALICE)
    allowed = [limiter.decide([check]).allowed for _ in range(8)]
    assert allowed == [True] * 5 + [False] * 3  # a quarter of a burst of 20


def test_local_share_never_drops_below_the_cost(limiter: Limiter) -> None:
    check = Check(policy("p", "local"), ALICE, cost=10)  # a quarter of the burst would be 5
    first, second = limiter.decide([check]), limiter.decide([check])
    assert first.allowed and first.degraded
    assert not second.allowed and second.retry_after_us > 0
