"""A gate that holds requests inside a view until a test opens it (for in-flight limits).

The test view ``/t/gated`` (``tests.views.Gated``) passes through :data:`GATE`; tests count
who is inside, then open it. Every wait is bounded: a request never stays inside longer than
``HOLD_TIMEOUT`` even if a test fails before opening the gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: Longest a request stays inside a closed gate; it then answers 504 (which fails any test).
HOLD_TIMEOUT = 15.0


class Gate:
    """Requests wait inside until :meth:`open`; the test sees how many are inside."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        #: Requests waiting inside right now, and every request that has ever entered.
        self.inside = 0
        self.entered = 0

    def pass_through(self, timeout: float = HOLD_TIMEOUT) -> bool:
        """Wait until the gate opens; ``False`` if it never did within ``timeout``."""
        with self._cond:
            self.inside += 1
            self.entered += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._open, timeout)
            finally:
                self.inside -= 1
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Gate], bool], timeout: float) -> bool:
        """Wait (bounded) until ``predicate(gate)`` holds."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def wait_inside(self, count: int, timeout: float = 10.0) -> bool:
        return self.wait_for(lambda g: g.inside >= count, timeout)

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def reset(self) -> None:
        """Close the gate for the next burst (nobody may be inside)."""
        with self._cond:
            assert self.inside == 0, f"{self.inside} requests still inside the gate"
            self._open = False
            self.entered = 0


GATE = Gate()
