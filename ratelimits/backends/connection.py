"""How the limiter reaches Redis: ``REDIS['URL']``, its options and the timeouts made into a redis-py client.

Every client has the limiter's tight timeouts and no retries: a consume that may already have
run must never be sent twice. A Sentinel URL gives the master's client, which asks the sentinels
where the master is whenever it connects, so it follows failovers; it never reads from a replica.
A cluster URL gives a :class:`redis.RedisCluster`, which finds the cluster through its startup
nodes when first used (:class:`~ratelimits.backends.cluster.ClusterBackend` makes it lazily).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..redis_url import parse_redis_url

__all__ = ["make_client", "tight"]


def tight(socket_timeout: float, connect_timeout: float) -> dict[str, Any]:
    """The connection arguments of every limiter connection: its timeouts, and no retry of any kind."""
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
    }


def make_client(
    url: str, socket_timeout: float, connect_timeout: float, options: Mapping[str, Any] | None = None
) -> redis.Redis | RedisCluster:
    """A new client for ``url`` with the limiter's timeouts and no retries (``options`` added to the URL's).

    A cluster's client connects to its startup nodes as it is made: an unreachable cluster raises.
    """
    target = parse_redis_url(url)
    given = dict(options or {})
    if target.cluster:
        given.pop("sentinel_username", None)
        given.pop("sentinel_password", None)
        limits = tight(socket_timeout, connect_timeout)
        limits.pop("retry_on_timeout")  # deprecated where the cluster makes connections; its retry says it
        auth = {k: v for k, v in (("username", target.username), ("password", target.password)) if v is not None}
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.addresses],  # type: ignore[no-untyped-call]
            # The cluster client's own retry (its nodes' connections never retry): none either.
            retry=limits.pop("retry"),
            ssl=target.scheme == "rediss+cluster",
            **limits,
            **{**auth, **given},
        )
    sentinel_auth = {
        key.removeprefix("sentinel_"): given.pop(key)
        for key in ("sentinel_username", "sentinel_password")
        if key in given
    }
    limits = tight(socket_timeout, connect_timeout)
    if target.scheme != "redis+sentinel":
        return redis.Redis.from_url(url, single_connection_client=False, **limits, **given)
    credentials = {"username": target.username, "password": target.password}
    master = {**{k: v for k, v in credentials.items() if v is not None}, **given, "db": target.db}
    # redis-py deprecates retry_on_timeout where a Sentinel makes connections; its retry says the same.
    limits.pop("retry_on_timeout")
    sentinel = Sentinel(list(target.addresses), sentinel_kwargs={**limits, **sentinel_auth}, **limits, **master)  # type: ignore[no-untyped-call]
    master_client: redis.Redis = sentinel.master_for(target.service)  # type: ignore[no-untyped-call]
    return master_client
