"""Integer arithmetic the package does in more than one place."""

from __future__ import annotations

__all__ = ["ceil_div"]


def ceil_div(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up, in integers (no float: exact for any size).

    For a positive ``denominator``: the microseconds a wait takes rounded up to the millisecond or
    second a header says, never rounded down to a moment that is too soon.
    """
    return -(-numerator // denominator)
