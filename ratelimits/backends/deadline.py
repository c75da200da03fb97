"""When a call's answer stops mattering: the deadline a script is sent with, on the store's clock.

A call the worker gave up on (its socket timeout passed: the request was decided by its fail
mode, and its usage counted by the worker) may still run when a stalled store resumes. Run then,
it would take fleet and concurrency slots nobody holds, and count usage the worker counted too:
after a 3 s stall, 27 of 763 requests were shed for slots no request held, and 400 requests
were counted 405 and 408 times. So every call that takes slots, consumes or counts carries the
moment the worker stops waiting for it, and a script that runs later does nothing and says so
(``LATE``): the worker's fail mode was the decision, and the worker's count the only one.

The moment is on the store's clock (Redis ``TIME``), which the script reads. The worker knows
its own clock, and learns the store's from the decisions' replies, which carry Redis ``TIME``:
a reply's time minus the moment its call was sent bounds the offset between the two clocks from
above (the script ran after the call was sent). The least bound seen lately is the estimate:
never below the true offset, so a call in time is never refused as late, and above it by the
one-way trip of the call that gave it (tens of microseconds on a LAN). Clocks that drift apart
are followed: bounds older than two windows are forgotten. With the app's clock
(``REDIS['USE_REDIS_TIME']`` off) the clocks are taken as in step, as that setting already does.

The deadline leaves :data:`ANSWER_SHARE` of the timeout for the answer to travel back: a script
that runs just before it is answered before the worker stops waiting.
"""

from __future__ import annotations

import threading
import time

__all__ = ["ANSWER_SHARE", "StoreClock"]

#: The share of the socket timeout kept for the answer's way back: the script must have run by
#: the rest of it.
ANSWER_SHARE = 0.2
#: How long one window of offset bounds lasts (seconds): the estimate is the least of this
#: window's and the last one's.
WINDOW_S = 30.0


class StoreClock:
    """The offset of the store's clock from this process's, learnt from replies; and deadlines on it."""

    def __init__(self, *, in_step: bool = False) -> None:
        #: The clocks are taken as in step (the app's clock decides): the offset is 0. Fixed when made.
        self.in_step = in_step
        self._window_start = time.monotonic()
        self._current: int | None = None
        self._previous: int | None = None
        #: The least of the two windows' bounds, kept as they change: every call's deadline reads it.
        self._offset: int | None = 0 if in_step else None
        #: Held to change the bounds (rarely: a tighter one, a new window), so that two threads'
        #: replies never leave an offset made of a bound the other dropped.
        self._lock = threading.Lock()

    @staticmethod
    def now_us() -> int:
        """This process's wall clock, in microseconds: what a call's send time is read on."""
        return time.time_ns() // 1000

    def observe(self, sent_us: int, store_us: int) -> None:
        """A script sent at ``sent_us`` (:meth:`now_us`) read ``store_us`` from the store's clock."""
        bound = store_us - sent_us
        current = self._current
        if current is not None and bound >= current and time.monotonic() - self._window_start < WINDOW_S:
            return  # the common case: no tighter than this window's bound, and the offset stands
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= WINDOW_S:
                self._window_start, self._previous, self._current = now, self._current, bound
            elif self._current is None or bound < self._current:
                self._current = bound
            if not self.in_step:
                current, previous = self._current, self._previous
                self._offset = current if previous is None or current < previous else previous

    def offset_us(self) -> int | None:
        """How far the store's clock is ahead of this process's (at most), or ``None`` before any reply."""
        return self._offset

    def deadline_us(self, sent_us: int, timeout_s: float | None, waiting_s: float = 0.0) -> int:
        """The store-clock moment by which a call sent at ``sent_us`` must run; 0: none (not known yet).

        ``waiting_s``: how long the call may wait for a connection before it is sent (an event
        loop's pool), which the worker waits on top of its socket timeout.
        """
        offset = self._offset
        if offset is None or not timeout_s:
            return 0
        return sent_us + offset + int((waiting_s + timeout_s * (1 - ANSWER_SHARE)) * 1_000_000)
