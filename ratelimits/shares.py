"""Regional shares of a global limit: the record each region's store holds, and the arithmetic on it.

A global policy (``scope: "global"``) is one limit for every region together. Each region's store
enforces its *share* of it, a fraction of the rate and of the burst; the reconciler
(:mod:`ratelimits.reconciler`) moves the shares toward each region's demand and writes them into
every region it reaches. ``lua/decide.lua`` reads a check's share record in the same ``MGET`` as
its state, and ``lua/reshare.lua`` writes it; this module is the same arithmetic in Python, for
the reconciler, the status view and the tests (a test holds the two to the same numbers).

The rules (docs/regions.md says why each holds):

* Without a record a region holds an even split, ``1 / regions``: the shares sum to the limit.
* A share above the even split, not rewritten for ``stale_after`` (its region unreachable, or the
  reconciler stopped), decays linearly down to the even split over ``decay``. A share never rises
  without a write: a region below the even split stays there until the reconciler raises it, or
  until its record expires, an hour after it has decayed.
* A region the reconciler cannot reach is assumed to hold the most it can come to without a write,
  ``max(its last share as decayed, 1 / regions)``; the reachable regions share only what is left.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RECORD_TTL_EXTRA_S", "ShareRecord", "target_shares"]

#: share, written (us), stale after (us), decay (us), decay target, epoch; then the share of every
#: region as this record's round set it (regions by sorted name). ``lua/decide.lua`` reads the
#: first five; ``lua/reshare.lua`` checks the epoch.
_HEADER = struct.Struct("<dddddd")
#: A record lives ``stale_after + decay`` and then this long (s): well past its decay, so that two
#: records of one subject written rounds apart have both decayed before either expires to the even
#: split (which raises a share below it).
RECORD_TTL_EXTRA_S = 3600


@functools.cache
def _layout(regions: int) -> struct.Struct:
    """A whole record's layout, for a vector of ``regions`` shares."""
    return struct.Struct(f"{_HEADER.format}{regions}d")


@dataclass(frozen=True, slots=True)
class ShareRecord:
    """One region's share of one global subject's limit, as the reconciler last wrote it."""

    share: float
    written_us: float
    stale_us: float
    decay_us: float
    #: The even split a stale share decays to (``1 / regions``).
    target: float
    #: Bumped by every round that writes the subject: a write names the epoch it read (compare and set).
    epoch: int
    #: Every region's share as the round that wrote this record left them (sorted region names).
    shares: tuple[float, ...]

    def pack(self) -> bytes:
        fields = (self.share, self.written_us, self.stale_us, self.decay_us, self.target, self.epoch, *self.shares)
        return _layout(len(self.shares)).pack(*fields)

    @classmethod
    def unpack(cls, value: bytes) -> ShareRecord:
        """The record ``value`` holds; :class:`ValueError` if it is not one (another length)."""
        extra = len(value) - _HEADER.size
        if extra < 0 or extra % 8:
            raise ValueError(f"a share record is {_HEADER.size} bytes and 8 per region, not {len(value)}")
        share, written, stale, decay, target, epoch, *shares = _layout(extra // 8).unpack(value)
        if not all(math.isfinite(v) for v in (written, stale, decay, epoch)) or not all(
            0 <= v <= 1 for v in (share, target, *shares)
        ):
            raise ValueError("a share record holds values no reconciler writes")
        return cls(share, written, stale, decay, target, int(epoch), tuple(shares))

    @classmethod
    def read(cls, value: bytes | None) -> ShareRecord | None:
        """The record ``value`` holds, or ``None`` for none or a malformed one (read as the even
        split, as ``lua/decide.lua`` reads it)."""
        try:
            return cls.unpack(value) if value else None
        except ValueError:
            return None

    def effective(self, now_us: float) -> float:
        """The share in force at ``now_us``: as written, or once stale decaying down to the even split.

        A share at or below the even split stays as it is: only a write raises a share (and the
        record's expiry, after :data:`RECORD_TTL_EXTRA_S` more, which makes it the even split).
        """
        return self._decayed(self.share, now_us)

    def most_of(self, index: int, now_us: float) -> float:
        """The most region ``index`` of this record's vector can hold from ``now_us`` on without a write.

        The vector's entry is what the round that wrote this record left that region with (or, out of
        reach then, the most it could hold). It decays no sooner than this record (written no later
        than the region's own), and the region's record expires to the even split.
        """
        return max(self._decayed(self.shares[index], now_us), self.target)

    def _decayed(self, share: float, now_us: float) -> float:
        age = now_us - self.written_us - self.stale_us
        if age <= 0 or share <= self.target:
            return share
        if age >= self.decay_us:
            return self.target
        return share + (self.target - share) * age / self.decay_us


def target_shares(
    demand: Mapping[str, float], budget: float, floor: float, current: Mapping[str, float]
) -> dict[str, float]:
    """New shares for the regions in ``demand`` (the reachable ones), summing to at most ``budget``.

    Each region gets ``floor``, and what is left of the budget goes in proportion to demand. With
    no demand anywhere the current shares stand (scaled down if they no longer fit the budget). A
    budget too small for every floor is split evenly.
    """
    regions = sorted(demand)
    if not regions or budget <= 0:
        return dict.fromkeys(regions, 0.0)
    total = sum(demand.values())
    if budget < floor * len(regions):
        return dict.fromkeys(regions, budget / len(regions))
    if total <= 0:
        held = sum(current.get(r, 0.0) for r in regions)
        if 0 < held <= budget:
            return {r: current.get(r, 0.0) for r in regions}
        return dict.fromkeys(regions, budget / len(regions))
    spare = budget - floor * len(regions)
    return {r: floor + spare * demand[r] / total for r in regions}
