"""A clock that only moves when a test says so: the test kit's own (``ratelimits.testing.FakeClock``)."""

from __future__ import annotations

from ratelimits.testing import FakeClock

__all__ = ["FakeClock"]
