"""What the demo's views wait on (a database, a reporting service), as the ``DEMO_DOWNSTREAM`` setting says.

By default a call just takes its view's time (an export: half a second). For the adaptive
capacity's benchmark (``python -m bench.shedding --adaptive``) the setting makes it a shared,
limited resource, as a connection pool is, and lets one kind of call slow down from a given moment::

    DEMO_DOWNSTREAM = {
        # Calls one worker process makes at once; the others wait their turn (None: no limit).
        "connections": 4,
        # Seconds each kind of call takes (a kind not named takes its view's own default).
        "seconds": {"export": 0.05, "charge": 0.002},
        # From a Unix time on, a kind of call takes `factor` times as long: (factor, from).
        "slower": {"export": (5.0, 1764547200.0)},
    }
"""

from __future__ import annotations

import threading
import time
from typing import Any

from django.conf import settings

__all__ = ["call", "seconds_of"]

_pool_lock = threading.Lock()
_pool: tuple[int, threading.Semaphore] | None = None


def _config() -> dict[str, Any]:
    return getattr(settings, "DEMO_DOWNSTREAM", None) or {}


def seconds_of(kind: str, default: float) -> float:
    """How long one ``kind`` of call takes now."""
    config = _config()
    seconds = float(config.get("seconds", {}).get(kind, default))
    slower = config.get("slower", {}).get(kind)
    if slower is not None:
        factor, start = slower
        if time.time() >= start:
            seconds *= factor
    return seconds


def _connections(size: int) -> threading.Semaphore:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != size:
            _pool = (size, threading.Semaphore(size))
        return _pool[1]


def call(kind: str, default: float = 0.0) -> None:
    """Make one ``kind`` of call: wait for a connection if the pool is limited, then take its time."""
    seconds = seconds_of(kind, default)
    size = _config().get("connections")
    if size is None:
        if seconds:
            time.sleep(seconds)
        return
    with _connections(int(size)):
        if seconds:
            time.sleep(seconds)
