"""Where limiter state lives: ``memory`` (one process) or ``redis`` (shared by every worker)."""

from __future__ import annotations

from django.utils.module_loading import import_string

from ..conf import ProcessWide, conf
from ..exceptions import ConfigurationError
from .base import Backend, StoreHealth

__all__ = ["ALIASES", "Backend", "StoreHealth", "backend_class", "get_backend", "load_backend"]

ALIASES = {
    "memory": "ratelimits.backends.memory.MemoryBackend",
    "redis": "ratelimits.backends.redis.RedisBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The backend class named by an alias or a dotted path; a :class:`ConfigurationError` if none."""
    path = ALIASES.get(name, name)
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"RATELIMITS['BACKEND']: cannot import {name!r}: {exc}", setting="BACKEND") from exc
    if not isinstance(cls, type) or not issubclass(cls, Backend):
        raise ConfigurationError(f"RATELIMITS['BACKEND']: {name!r} is not a ratelimits Backend", setting="BACKEND")
    return cls


def load_backend(name: str) -> Backend:
    """A new instance of the backend named by an alias or a dotted path, configured from settings."""
    return backend_class(name).from_settings()


_backend: ProcessWide[Backend] = ProcessWide(lambda: load_backend(conf.backend))


def get_backend() -> Backend:
    """The process-wide backend named by ``RATELIMITS['BACKEND']`` (the engine decides on it)."""
    return _backend.get()
