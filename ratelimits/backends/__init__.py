"""Where limiter state lives: ``memory`` (one process) or ``redis`` (shared by every worker)."""

from __future__ import annotations

from django.utils.module_loading import import_string

from ..exceptions import ConfigurationError
from .base import Backend

__all__ = ["Backend", "load_backend"]

ALIASES = {
    "memory": "ratelimits.backends.memory.MemoryBackend",
    "redis": "ratelimits.backends.redis.RedisBackend",
}


def load_backend(name: str) -> Backend:
    """Instantiate the backend named by an alias or a dotted path, configured from settings."""
    path = ALIASES.get(name, name)
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"RATELIMITS['BACKEND']: cannot import {name!r}: {exc}") from exc
    backend = cls.from_settings()
    if not isinstance(backend, Backend):
        raise ConfigurationError(f"RATELIMITS['BACKEND']: {name!r} is not a ratelimits Backend")
    return backend
