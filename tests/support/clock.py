"""A clock that only moves when a test says so."""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Integer microseconds that only move when a test says so."""

    def __init__(self, start_us: int = 1_700_000_000_000_000) -> None:
        self.now = start_us

    def __call__(self) -> int:
        return self.now

    def advance(self, us: int) -> None:
        self.now += us
