"""A per-process circuit breaker that keeps a dead or stalled store off the request path."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from enum import StrEnum

__all__ = ["NOT_A_PROBE", "BreakerState", "CircuitBreaker"]

#: The ticket of a call let through while the breaker is closed (:meth:`CircuitBreaker.admit`).
NOT_A_PROBE = 0


class BreakerState(StrEnum):
    """Whether calls reach the store: all of them, none, or one probe."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    """Opens on a failure *rate*, lets exactly one probe through when half-open.

    Closed: every call goes to the store and its outcome joins a window of the last
    ``window`` outcomes. Once at least ``min_calls`` are in the window and the failure share
    reaches ``failure_rate``, the breaker opens: for ``cooldown`` seconds no call reaches the
    store. Then it is half-open: the first caller becomes the probe; everyone else is turned
    away until the probe reports. A successful probe closes the breaker with an empty window;
    a failed one opens it for another cooldown. Time is read from a monotonic clock.

    Outcomes reported while the breaker is open and no probe is out come from calls admitted
    before it opened (they were in flight when it tripped): they are ignored, so a straggling
    success cannot close the breaker early and a straggling failure cannot stretch the cooldown.
    (One that reports while a probe is out is taken for the probe's outcome; with a cooldown far
    longer than the store's timeouts, stragglers have reported long before.)
    """

    def __init__(
        self,
        *,
        window: int = 20,
        min_calls: int = 5,
        failure_rate: float = 0.5,
        cooldown: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # More required calls than the window holds could never be met: the breaker would never open.
        self.min_calls = min(min_calls, window)
        self.failure_rate = failure_rate
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        #: How often it entered each state (for the metrics: read, never reset).
        self.transitions: Counter[str] = Counter()
        #: How many probes it let out: the last one's number is its ticket (see :meth:`admit`).
        self.probes = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._opened_at is None:
                return BreakerState.CLOSED
            return BreakerState.OPEN if self._clock() - self._opened_at < self.cooldown else BreakerState.HALF_OPEN

    def allow(self) -> bool:
        """Whether this call may go to the store. A ``True`` in half-open state makes it the probe."""
        return self.admit() is not None

    def admit(self) -> int | None:
        """:meth:`allow`, with the call's ticket: ``None`` if it may not go; :data:`NOT_A_PROBE`
        (0) if it goes while the breaker is closed; else the probe's number, which names it to
        :meth:`abandon` and to the reports of :meth:`record_success` and :meth:`record_failure`."""
        if self._opened_at is None:
            # Closed, read without the lock (one attribute read is atomic): every decision asks, and
            # a call let through as the breaker opens is one admitted just before it, as the
            # class says.
            return NOT_A_PROBE
        with self._lock:
            if self._opened_at is None:
                return NOT_A_PROBE
            if self._probing or self._clock() - self._opened_at < self.cooldown:
                return None
            self._probing = True
            self.probes += 1
            self.transitions[BreakerState.HALF_OPEN] += 1
            return self.probes

    def retry_after(self) -> float:
        """Seconds until the breaker will try the store again (0 when closed)."""
        with self._lock:
            if self._opened_at is None:
                return 0.0
            return max(self.cooldown - (self._clock() - self._opened_at), 0.0)

    def record_success(self, ticket: int | None = None) -> None:
        """A call answered. With its ``ticket`` (:meth:`admit`), a late report of a call that is
        not the probe out now is told apart from the probe's."""
        outcomes = self._outcomes
        if self._opened_at is None and self._failures == 0 and len(outcomes) == outcomes.maxlen:
            # A full window of successes stays one: recording another changes nothing. (Read
            # without the lock: a failure recorded meanwhile is counted by its own call.)
            return
        with self._lock:
            if self._opened_at is None:
                self._record(True)
            elif self._probing and self._is_probe(ticket):
                self._close()
            # else: a call admitted before the breaker opened answered late; it stays open.

    def abandon(self, ticket: int) -> None:
        """A call that will never report (its request or its event loop was cancelled) gives its
        turn back: if it is the probe out now, the next call may probe instead. Nothing is
        recorded. ``ticket``: the call's (:meth:`admit`), so that only the probe can."""
        with self._lock:
            if self._opened_at is not None and self._probing and ticket == self.probes:
                self._probing = False

    def _is_probe(self, ticket: int | None) -> bool:
        return ticket is None or ticket == self.probes

    def record_failure(self, ticket: int | None = None) -> None:
        """A call failed (``ticket``: as for :meth:`record_success`)."""
        with self._lock:
            if self._opened_at is not None:
                if self._probing and self._is_probe(ticket):
                    # The probe failed: another full cooldown from now.
                    self._opened_at = self._clock()
                    self._probing = False
                    self.transitions[BreakerState.OPEN] += 1
                # else: a call admitted before the breaker opened; the cooldown runs from the opening.
                return
            self._record(False)
            if len(self._outcomes) >= self.min_calls and self._failures >= self.failure_rate * len(self._outcomes):
                self._opened_at = self._clock()
                self.transitions[BreakerState.OPEN] += 1

    def _record(self, ok: bool) -> None:
        if len(self._outcomes) == self._outcomes.maxlen and not self._outcomes[0]:
            self._failures -= 1
        self._outcomes.append(ok)
        if not ok:
            self._failures += 1

    def _close(self) -> None:
        self.transitions[BreakerState.CLOSED] += 1
        self._opened_at = None
        self._probing = False
        self._outcomes.clear()
        self._failures = 0
