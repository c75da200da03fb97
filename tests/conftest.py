"""Fixtures: a private Redis and Redis Cluster per test session, backends on every store, a clock, a browser."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from ratelimits import engine
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client

from .support.browser import chromium  # noqa: F401  (a fixture the browser tests use)
from .support.clock import FakeClock
from .support.docs_site import built_site  # noqa: F401  (a fixture the docs tests use)
from .support.gate import GATE, Gate
from .support.redis_cluster import Cluster
from .support.redis_server import RedisServer
from .support.settings import merged

#: How long a test's end waits for a background policy reload to end: a load is bounded by
#: POLICIES['LOAD_TIMEOUT'], and one waiting out its backoff ends within RETIRED_CHECK_S.
RELOAD_JOIN_S = 10.0


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """Six redis-servers in cluster mode (3 masters, 3 replicas), shared by the tests that do not break it."""
    with Cluster() as cluster:
        yield cluster


@pytest.fixture
def cluster_client(redis_cluster: Cluster) -> Iterator[redis.RedisCluster]:
    client = redis_cluster.client()
    client.flushall()  # on every master
    yield client
    client.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to kill, pause or flush: stopped by PID afterwards, whatever happened."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis", "cluster"])
def backend(request: pytest.FixtureRequest, clock: FakeClock) -> Any:
    """Each backend, driven by the same fake clock (Redis in app-clock mode)."""
    if request.param == "memory":
        return MemoryBackend(clock=clock)
    if request.param == "cluster":
        cluster: Cluster = request.getfixturevalue("redis_cluster")
        request.getfixturevalue("cluster_client")  # flushed
        return ClusterBackend(make_client(cluster.url, 2.0, 2.0), clock=clock)  # type: ignore[arg-type]
    server: RedisServer = request.getfixturevalue("redis_server")
    request.getfixturevalue("redis_client")  # flushed
    return RedisBackend(make_client(server.url, 2.0, 2.0), clock=clock)


@pytest.fixture
def use_redis(settings: Any, redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[RedisServer]:
    """Point RATELIMITS at the private Redis (server clock) for the duration of a test.

    With timeouts of seconds, not the default 50 ms: these tests are about decisions, and on this
    loaded 2-core machine a connection can take longer than 50 ms to open (the store is then
    "unavailable" and the request degrades). Tests of timeouts use a server of their own.
    """
    redis = {"URL": redis_server.url, "SOCKET_TIMEOUT": "2s", "CONNECT_TIMEOUT": "2s"}
    settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": redis})
    yield redis_server
    engine.reset()


@pytest.fixture(autouse=True)
def _fresh_engine() -> Iterator[None]:
    engine.reset()
    yield
    engine.reset()
    # A policy source's background reload started in this test (after a load that met a locked
    # table, say) ends within RETIRED_CHECK_S of its source's retirement, or once the load it is
    # in finishes: before the next test writes. On SQLite's shared in-memory database, a read in
    # another thread refuses a write at once ("database table is locked").
    for thread in threading.enumerate():
        if thread.name == "ratelimits-policy-reload":
            thread.join(RELOAD_JOIN_S)


@pytest.fixture
def gate() -> Iterator[Gate]:
    """The test views' gate (tests/support/gate.py), closed; opened and emptied after the test."""
    GATE.reset()
    yield GATE
    GATE.open()
    assert GATE.wait_for(lambda g: g.inside == 0, 20), "requests still held in the gate"
