"""Where limiter state lives: ``memory`` (one process) or ``redis`` (shared by every worker).

``redis`` is one server (or a Sentinel master), or a Redis Cluster when ``REDIS['URL']`` names one
(``redis+cluster://``) or ``REDIS['CLIENT']`` is a cluster's client.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from django.utils.module_loading import import_string

from .._process import ProcessWide
from ..conf import conf
from ..exceptions import ConfigurationError
from ..redis_url import parse_redis_url
from .base import (
    CAPABILITIES,
    Backend,
    BulletinSupport,
    HealthSupport,
    LeaseSupport,
    PolicyFailed,
    RegionSupport,
    SettleSupport,
    StoreHealth,
    UsageSupport,
)

__all__ = [
    "ALIASES",
    "CAPABILITIES",
    "Backend",
    "BulletinSupport",
    "HealthSupport",
    "LeaseSupport",
    "PolicyFailed",
    "RegionSupport",
    "SettleSupport",
    "StoreHealth",
    "UsageSupport",
    "backend_class",
    "get_backend",
    "load_backend",
    "standing_in",
]

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
        return False  # a bad REDIS['URL'] or REDIS['CLIENT'] is reported as itself, once


def load_backend(name: str) -> Backend:
    """A new instance of the backend named by an alias or a dotted path, configured from settings."""
    return backend_class(name).from_settings()


#: Backends standing in for the configured one, the innermost block's last (:func:`standing_in`).
_stand_ins: list[Backend] = []


def _build() -> Backend:
    return _stand_ins[-1] if _stand_ins else load_backend(conf.backend)


_backend: ProcessWide[Backend] = ProcessWide(_build)


def get_backend() -> Backend:
    """The process-wide backend named by ``RATELIMITS['BACKEND']`` (the engine decides on it)."""
    return _backend.get()


@contextmanager
def standing_in(backend: Backend) -> Iterator[Backend]:
    """Decide on ``backend`` instead of ``RATELIMITS['BACKEND']`` until the block ends (the test kit's limiter).

    The process's backend, limiter and policy source are built afresh on entry and on exit. A
    change of the settings inside the block rebuilds them around ``backend`` still: it stands in
    until the block ends, whatever the settings say.
    """
    _stand_ins.append(backend)
    ProcessWide.reset_all()
    try:
        yield backend
    finally:
        _stand_ins.remove(backend)
        ProcessWide.reset_all()
