"""The worker utilisation shedder: when this process is nearly full, lower classes wait outside.

It needs no Redis, so it keeps a worker alive when the store itself is slow or down. In-flight
requests are counted from admission to the response's close (after it left). With
``SHEDDING['ADAPTIVE']``, its capacity follows the latency and errors of the requests it admitted
(:mod:`ratelimits.adaptive`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from .._process import ProcessWide
from ..adaptive import CapacityController, Move
from ..choices import Priority
from ..conf import AdaptiveSettings, conf
from ..metrics import get_recorder

__all__ = ["WorkerShedder", "get_worker_shedder", "worker_name"]

logger = logging.getLogger("ratelimits")


def worker_name() -> str:
    """This process, as the admin lists it: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


class WorkerShedder:
    """Admit a request of a priority class while this worker's in-flight count is below its threshold.

    ``capacity`` is how many requests the process serves at once (its threads); each class is
    shed once that many percent of it are busy (``thresholds``: low, normal, high). Critical
    requests are never shed here. With ``adaptive``, ``capacity`` is where the capacity starts
    and the most it reaches; the thresholds stay shares of the current capacity.
    """

    def __init__(
        self, capacity: int, thresholds: Mapping[Priority, int], adaptive: AdaptiveSettings | None = None
    ) -> None:
        self._thresholds = dict(thresholds)
        self._in_flight = 0
        self._lock = threading.Lock()
        self.controller = (
            CapacityController(capacity, adaptive, now=time.monotonic(), below=self._below) if adaptive else None
        )
        self._set_capacity(self.controller.capacity if self.controller is not None else capacity)

    def _set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        self._limits = self._limits_at(capacity)

    def _limits_at(self, capacity: int) -> dict[Priority, int]:
        return {klass: max(capacity * percent // 100, 1) for klass, percent in self._thresholds.items()}

    def _below(self, knee: int) -> int:
        """The highest capacity under ``knee`` at which every class gets fewer requests in than at it
        (a class already at one stays there): growing back to knee - 1 could admit just as many of
        the class whose requests made the cut."""
        at_knee = self._limits_at(knee)
        for capacity in range(knee - 1, 0, -1):
            limits = self._limits_at(capacity)
            if all(limits[k] < at_knee[k] or at_knee[k] == 1 for k in at_knee):
                return capacity
        return 1

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self, priority: Priority) -> bool:
        """Count the request in and return ``True``, or return ``False`` to shed it."""
        with self._lock:
            limit = self._limits.get(priority)
            if limit is not None and self._in_flight >= limit:
                if self.controller is not None:
                    self.controller.shed()
                return False
            self._in_flight += 1
            return True

    def sheds(self, priority: Priority) -> bool:
        """Whether :meth:`admit` would shed ``priority`` now (nothing is counted: asked before authentication).

        A request refused here is counted as shed by the adaptive capacity all the same.
        """
        limit = self._limits.get(priority)
        shed = limit is not None and self._in_flight >= limit
        if shed and self.controller is not None:
            with self._lock:
                self.controller.shed()
        return shed

    def finish(
        self,
        endpoint: str | None = None,
        latency: float | None = None,
        *,
        error: bool = False,
        admitted_at: float | None = None,
    ) -> None:
        """Count an admitted request out (never below zero); with its endpoint and latency, the adaptive
        capacity learns from it (a request that got no response of the view's, a denial, teaches nothing)."""
        with self._lock:
            self._in_flight = max(self._in_flight - 1, 0)
            if self.controller is None or endpoint is None or latency is None:
                return
            move = self.controller.record(endpoint, latency, error=error, now=time.monotonic(), admitted_at=admitted_at)
            if move is not None and move.changed:
                self._set_capacity(self.controller.capacity)
        if move is not None and (move.changed or move.before == move.after):
            _log(move)
            recorder = get_recorder()
            if recorder is not None and move.changed:
                recorder.count("ratelimits_capacity_moves", "cut" if move.after < move.before else "rise")

    def state(self) -> dict[str, Any]:
        """What the admin and the logs show: the capacity now, its bounds and its last move."""
        controller = self.controller
        state: dict[str, Any] = {"worker": worker_name(), "capacity": self.capacity, "in_flight": self._in_flight}
        if controller is None:
            return {**state, "adaptive": False}
        with self._lock:  # a consistent snapshot: requests finishing move it
            return self._adaptive_state(controller, state)

    def _adaptive_state(self, controller: CapacityController, state: dict[str, Any]) -> dict[str, Any]:
        last = controller.last
        return {
            **state,
            "adaptive": True,
            "limit": round(controller.limit, 2),
            "floor": controller.floor,
            "ceiling": controller.ceiling,
            "responses": controller.observed,
            "reason": last.reason if last else "started at the floor",
            "moved_at": time.time() - (time.monotonic() - last.at) if last else None,
            "baselines_ms": {name: round(value * 1000, 1) for name, value in sorted(controller.baselines.items())},
        }


def _log(move: Move) -> None:
    level = logging.WARNING if move.after < move.before else logging.INFO
    logger.log(
        level,
        "ratelimits: worker capacity %d -> %d: %s",
        int(move.before),
        int(move.after),
        move.reason,
        extra={
            "ratelimit_capacity": int(move.after),
            "ratelimit_capacity_before": int(move.before),
            "ratelimit_capacity_reason": move.reason,
        },
    )


def _build() -> WorkerShedder | None:
    capacity = conf.shedding.worker_capacity
    if not capacity or not conf.enabled:
        return None
    return WorkerShedder(capacity, conf.shedding.thresholds, conf.shedding.adaptive.settings)


_shedder: ProcessWide[WorkerShedder | None] = ProcessWide(_build)


def get_worker_shedder() -> WorkerShedder | None:
    """This process's utilisation shedder: ``None`` without ``SHEDDING['WORKER_CAPACITY']``, or ``ENABLED`` off."""
    return _shedder.get()


def current_worker_shedder() -> WorkerShedder | None:
    """This process's utilisation shedder if one was built (without building it)."""
    return _shedder.current()
