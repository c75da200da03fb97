"""A bounded wait on a condition, for what a test cannot join (another process's or thread's work)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(condition: Callable[[], object], bound: float) -> bool:
    """Whether ``condition()`` holds within ``bound`` seconds (polled, then read once more at the end)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)  # polling a condition with a deadline, not synchronising on a guess
    return bool(condition())
