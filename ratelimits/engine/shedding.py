"""The worker utilisation shedder: when this process is nearly full, lower classes wait outside.

It needs no Redis, so it keeps a worker alive when the store itself is slow or down. In-flight
requests are counted from admission to ``request_finished`` (after the response left).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from ..choices import Priority
from ..conf import ProcessWide, conf

__all__ = ["WorkerShedder", "get_worker_shedder"]


class WorkerShedder:
    """Admit a request of a priority class while this worker's in-flight count is below its threshold.

    ``capacity`` is how many requests the process serves at once (its threads); each class is
    shed once that many percent of it are busy (``thresholds``: low, normal, high). Critical
    requests are never shed here.
    """

    def __init__(self, capacity: int, thresholds: Mapping[Priority, int]) -> None:
        self.capacity = capacity
        self._limits = {klass: max(capacity * percent // 100, 1) for klass, percent in thresholds.items()}
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self, priority: Priority) -> bool:
        """Count the request in and return ``True``, or return ``False`` to shed it."""
        with self._lock:
            limit = self._limits.get(priority)
            if limit is not None and self._in_flight >= limit:
                return False
            self._in_flight += 1
            return True

    def sheds(self, priority: Priority) -> bool:
        """Whether :meth:`admit` would shed ``priority`` now (nothing is counted: asked before authentication)."""
        limit = self._limits.get(priority)
        return limit is not None and self._in_flight >= limit

    def finish(self) -> None:
        """Count an admitted request out (never below zero)."""
        with self._lock:
            self._in_flight = max(self._in_flight - 1, 0)


def _build() -> WorkerShedder | None:
    capacity = conf.worker_capacity
    return WorkerShedder(capacity, conf.shed_thresholds) if capacity else None


_shedder: ProcessWide[WorkerShedder | None] = ProcessWide(_build)


def get_worker_shedder() -> WorkerShedder | None:
    """This process's utilisation shedder, or ``None`` when ``WORKER_CAPACITY`` is not set."""
    return _shedder.get()
