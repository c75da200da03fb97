"""How the limiter reaches Redis: ``REDIS_URL``, its options and the timeouts made into a redis-py client.

Every client has the limiter's tight timeouts and no retries: a consume that may already have
run must never be sent twice. A Sentinel URL gives the master's client, which asks the sentinels
where the master is whenever it connects, so it follows failovers; it never reads from a replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from redis.backoff import NoBackoff
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
) -> redis.Redis:
    """A new client for ``url`` with the limiter's timeouts and no retries (``options`` added to the URL's)."""
    target = parse_redis_url(url)
    given = dict(options or {})
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
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs={**limits, **sentinel_auth}, **limits, **master)  # type: ignore[no-untyped-call]
    master_client: redis.Redis = sentinel.master_for(target.service)  # type: ignore[no-untyped-call]
    return master_client
