"""Hot-key sharding: one hot budget split into sub-buckets that spread over a cluster's nodes.

A sharded policy (``shards: N``) holds its rate and burst split over N keys, each with its own
hash tag; a request is decided by one shard picked at random. The shards together never hold
more than the policy; the price is under-admission while one shard is empty and others are not,
measured here and in ``python -m bench.sharding``.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from ratelimits.algorithms import RATE_ALGORITHMS, Algorithm
from ratelimits.backends import layout
from ratelimits.backends.memory import MemoryBackend
from ratelimits.checks import check_settings
from ratelimits.exceptions import ConfigurationError
from ratelimits.identity import Subject
from ratelimits.policies import Policy
from ratelimits.policies.values import check_for, every_shard, fleet_checks, policy_from_config
from ratelimits.rates import parse_rate

from .support.clock import FakeClock
from .support.redis_cluster import Cluster
from .support.settings import merged
from .test_cluster import node_ids, node_of
from .test_concurrency import assert_clean, storm, summary

ENDPOINT = Subject("endpoint", "POST /v1/search")


def sharded(rate: str, burst: int, shards: int, algorithm: Algorithm = Algorithm.TOKEN_BUCKET) -> Policy:
    return Policy("endpoint-all:search", parse_rate(rate), burst, algorithm, shards=shards)


@pytest.mark.parametrize("algorithm", RATE_ALGORITHMS, ids=[a.value for a in RATE_ALGORITHMS])
def test_the_shards_together_never_hold_more_than_the_policy(algorithm: Algorithm) -> None:
    for rate, burst, shards in [("10000/s", 20000, 16), ("1000/s", 1000, 16), ("7/s", 7, 3), ("100/d", 100, 7)]:
        whole = sharded(rate, burst, shards, algorithm)
        shard = whole.shard
        assert shard is not None and shard.is_shard and shard.shard is None and shard.name == whole.name
        per_second = lambda p: p.rate.limit * 1_000_000 / p.rate.period_us  # noqa: E731
        assert shards * per_second(shard) <= per_second(whole) + 1e-9
        assert shards * shard.capacity <= whole.capacity
        assert shard.capacity >= 1
        if algorithm is Algorithm.TOKEN_BUCKET:
            assert shards * per_second(shard) == pytest.approx(per_second(whole))  # the rate splits exactly
    assert Policy("p", parse_rate("5/s"), 5).shard is None


@pytest.mark.parametrize(
    ("shards", "message"),
    [(0, "must be a positive integer"), (True, "must be a positive integer"), (17, "exceeds its capacity 16")],
)
def test_bad_shards_are_configuration_errors_naming_the_field(shards: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        policy_from_config(
            "p", {"rate": "16/s", "shards": shards}, field="RATELIMITS['DIMENSIONS']['org']", default_fail_mode="open"
        )  # type: ignore[arg-type]
    assert "RATELIMITS['DIMENSIONS']['org']" in str(caught.value)


def test_a_sharded_check_is_one_shard_picked_at_random_each_with_its_own_slot() -> None:
    whole = sharded("16000/s", 16000, 16)
    picks = Counter(check_for(whole, ENDPOINT, 1) for _ in range(3200))
    assert len(picks) == 16 and all(check.policy is whole.shard for check in picks)
    assert min(picks.values()) > 100  # uniform: 200 each on average
    keys = {check.key("rl") for check in picks}
    assert len(keys) == 16 and len({layout.key_slot(k.encode()) for k in keys}) == 16
    assert sorted(c.key("rl") for c in every_shard(next(iter(picks)))) == sorted(keys)  # what a reset clears


def test_a_sharded_budget_spreads_over_the_clusters_masters(redis_cluster: Cluster, cluster_client: Any) -> None:
    whole = sharded("16000/s", 16000, 16)
    shard_keys = {c.key("rl") for c in every_shard(check_for(whole, ENDPOINT, 1))}
    per_node = Counter(node_of(cluster_client, key) for key in shard_keys)
    assert set(per_node) == set(node_ids(redis_cluster))  # every master holds some of the hot budget
    assert max(per_node.values()) <= 8


def test_sharded_decisions_never_admit_more_than_the_budget_and_the_cost_is_measured() -> None:
    """Exactly the burst's worth of requests, no refill: one bucket admits them all, shards fewer; then all."""
    random.seed("shards")  # the picks check_for makes, repeatable
    at_capacity = {}
    for shards in (1, 4, 16):
        backend = MemoryBackend(clock=FakeClock())
        whole = Policy("endpoint-all", parse_rate("320/h"), 320, shards=shards)
        first = sum(backend.decide([check_for(whole, ENDPOINT, 1)]).allowed for _ in range(320))
        # Far more than the budget: every shard runs dry, and none gives more than its share.
        total = first + sum(backend.decide([check_for(whole, ENDPOINT, 1)]).allowed for _ in range(640))
        at_capacity[shards] = first
        assert first <= total <= 320
        assert total == 320
    print(f"admitted of the first 320 requests for a burst of 320: {at_capacity}")
    assert at_capacity[1] == 320 and at_capacity[16] < 320


def test_settings_take_shards_for_an_endpoint_wide_limit_and_the_fleet(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "ENDPOINTS": {"POST /v1/search": {"endpoint_rate": {"rate": "1000/s", "shards": 8}}},
            "SHEDDING": {"FLEET_CAPACITY": 400, "FLEET_SHARDS": 4},
        },
    )
    assert [m.id for m in check_settings()] == []
    fleet = fleet_checks(400, {"low": 60}, 4)
    assert all(check.policy.shards == 4 and check.policy.shard is not None for check in fleet.values())


def test_too_many_fleet_shards_fail_the_checks_naming_the_setting(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"SHEDDING": {"FLEET_CAPACITY": 10, "FLEET_SHARDS": 16}})
    errors = [m for m in check_settings() if m.level >= 40]
    assert [m.id for m in errors] == ["ratelimits.E142"]
    assert "FLEET_SHARDS" in errors[0].msg


def test_a_bad_endpoint_shards_value_fails_the_checks_naming_the_field(settings: Any) -> None:
    settings.RATELIMITS = {
        **settings.RATELIMITS,
        "ENDPOINTS": {"POST /v1/search": {"endpoint_rate": {"rate": "10/s", "shards": 11}}},
    }
    errors = [m for m in check_settings() if m.level >= 40]
    assert [m.id for m in errors] == ["ratelimits.E119"]
    assert "['endpoint_rate']" in errors[0].msg and "shards 11 exceeds its capacity 10" in errors[0].msg


@pytest.mark.slow
def test_a_16_shard_endpoint_wide_limit_under_the_storm_admits_no_more_than_the_limit(
    redis_cluster: Cluster, cluster_client: Any
) -> None:
    """4 processes x 8 threads, each request on one of 16 shards picked at random, on the cluster."""
    whole = sharded("320/h", 320, 16)
    shards = tuple(every_shard(check_for(whole, ENDPOINT, 1)))
    report = storm(redis_cluster.url, cluster_client, lambda p, t: [shards])
    assert_clean(report)
    admitted = len(report.admitted)
    print(summary("cluster, 16-shard endpoint-wide 320/h", report, whole.burst))
    print(f"sharding: {admitted} of {whole.burst} admitted; under-admission {whole.burst - admitted}")
    assert admitted <= whole.burst
    assert admitted == whole.burst  # 1600 attempts for 320: every shard was asked for more than it holds


@pytest.mark.django_db
def test_the_admin_shards_an_endpoints_all_callers_limit(settings: Any) -> None:
    from ratelimits.models import EndpointPolicy
    from ratelimits.store.database import load_snapshot

    EndpointPolicy.objects.create(endpoint="search", endpoint_rate="1600/s", endpoint_shards=16)
    rule = load_snapshot().endpoint_rule("search", "GET")
    assert rule.endpoint_wide is not None and rule.endpoint_wide.shards == 16
    shard = rule.endpoint_wide.shard
    assert shard is not None and shard.burst == 100


def test_a_bucket_too_slow_to_split_is_refused() -> None:
    """A period too long to stretch by the shards, with fewer tokens per period than shards: no shard could hold one."""
    with pytest.raises(ConfigurationError, match="shards 16 exceeds its rate's 10 per period"):
        Policy("yearly", parse_rate("10/300d"), 20, shards=16)
