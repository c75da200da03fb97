"""Where limiter state lives: ``memory`` (one process) or ``redis`` (shared by every worker).

``redis`` is one server (or a Sentinel master), or a Redis Cluster when ``REDIS_URL`` names one
(``redis+cluster://``) or ``REDIS_CLIENT`` is a cluster's client.
"""

from __future__ import annotations

import redis
from django.utils.module_loading import import_string

from ..conf import ProcessWide, conf
from ..exceptions import ConfigurationError
from ..redis_url import parse_redis_url
from .base import Backend, StoreHealth

__all__ = ["ALIASES", "Backend", "StoreHealth", "backend_class", "get_backend", "load_backend"]

ALIASES = {
    "memory": "ratelimits.backends.memory.MemoryBackend",
    "redis": "ratelimits.backends.redis.RedisBackend",
}
#: What ``redis`` stands for on a Redis Cluster.
CLUSTER = "ratelimits.backends.cluster.ClusterBackend"


def backend_class(name: str) -> type[Backend]:
    """The backend class named by an alias or a dotted path; a :class:`ConfigurationError` if none."""
    path = ALIASES.get(name, name)
    if path == ALIASES["redis"] and _on_a_cluster():
        path = CLUSTER
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"RATELIMITS['BACKEND']: cannot import {name!r}: {exc}", setting="BACKEND") from exc
    if not isinstance(cls, type) or not issubclass(cls, Backend):
        raise ConfigurationError(f"RATELIMITS['BACKEND']: {name!r} is not a ratelimits Backend", setting="BACKEND")
    return cls


def _on_a_cluster() -> bool:
    try:
        client = conf.redis.client
        if client is not None:
            return isinstance(client, redis.RedisCluster)
        return parse_redis_url(conf.redis.address[0]).cluster
    except ConfigurationError:
        return False  # a bad REDIS_URL or REDIS_CLIENT is reported as itself, once


def load_backend(name: str) -> Backend:
    """A new instance of the backend named by an alias or a dotted path, configured from settings."""
    return backend_class(name).from_settings()


_backend: ProcessWide[Backend] = ProcessWide(lambda: load_backend(conf.backend))


def get_backend() -> Backend:
    """The process-wide backend named by ``RATELIMITS['BACKEND']`` (the engine decides on it)."""
    return _backend.get()
