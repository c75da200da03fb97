"""What a limit would have refused of recorded traffic, bounded: the arithmetic of a policy preview.

Usage is recorded as counts per period (a minute, or an hour once minutes are rolled up), not
as the instants requests came: a per-second bucket cannot be replayed exactly from them. What
can be said is how few and how many of the recorded requests the limit could have refused, over
every way they could have been placed inside their periods, whatever came before the records:

- **at least** (:func:`fewest_refused`): the requests placed as well as they could be. A token
  bucket admits at most what it holds plus what refills meanwhile, so each period admits at most
  ``level + rate x period`` tokens' worth of requests at the cheapest cost of any, the bucket
  starting full; admitting all it can never costs a later period more than it gives. A window
  admits at most its limit, filled earliest first. Any real order admits no more: no fewer
  refusals.
- **at most** (:func:`most_refused`): the requests bunched as badly as they could be, the bucket
  empty where the records start. Two things are owed however they came. A bucket is never
  emptier than its burst less what it admitted over the time its burst takes to refill, so a
  period whose neighbours over that long asked for less than the burst surely gets the rest.
  And pairing the periods (B, C), (D, E), ...: whatever came before B (its last burst is before B
  starts) and C's burst are further apart than B's start and C's, and what refills between them,
  up to the burst, is there for B and C, and all of it for C if B took none: so the pair is owed
  that much, at the dearest of the two, whatever B did (a window: its limit, once no window can hold both
  the instant before B and C's start). Any real order admits no fewer: no more refusals. Of the
  two pairings, the one that owes more is kept.

A window counted in periods the records align with (a day's quota, a month's, a per-minute
window over minute records) is exact when every request of a window costs the same: both bounds
are the same. Each period's requests are taken to cost between its ``cheapest`` and ``dearest``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Demand", "Limit", "fewest_refused", "most_refused", "period_window", "refused_bounds"]

_ROUNDING = 1e-9


@dataclass(frozen=True, slots=True)
class Demand:
    """One subject's requests in one period of the records: when, how long, how many, at what cost."""

    start_us: int
    length_us: int
    requests: int
    #: Tokens per request: the cheapest of the period's requests, and the dearest (if not said, the same).
    cheapest: float
    dearest: float | None = None

    @property
    def end_us(self) -> int:
        return self.start_us + self.length_us

    @property
    def most_cost(self) -> float:
        return self.cheapest if self.dearest is None else self.dearest


@dataclass(frozen=True, slots=True)
class Limit:
    """The limit a preview replays: a token bucket (``window_of`` None) or a window's count."""

    #: Tokens per ``period_us`` (a bucket's rate, a window's limit).
    limit: int
    period_us: int
    #: A bucket's capacity in tokens (its burst); a window's is its limit.
    burst: int
    #: For a window: which window an instant falls in, by its start (us). ``None``: a token bucket.
    window_of: Callable[[int], int] | None = None
    #: A window's length, where every window has the same (``None``: a calendar's, a day or more).
    window_us: int | None = None

    @property
    def is_window(self) -> bool:
        return self.window_of is not None


def refused_bounds(demand: Sequence[Demand], limit: Limit, since_us: int | None = None) -> tuple[int, int]:
    """``(fewest, most)`` requests of ``demand`` (one subject's periods, in time order, every one
    of its requests since ``since_us``: the first period's start if not said) that ``limit``
    could have refused."""
    return fewest_refused(demand, limit), most_refused(demand, limit, since_us)


def fewest_refused(demand: Sequence[Demand], limit: Limit) -> int:
    """The fewest refusals any placing of ``demand`` inside its periods could have met."""
    # Every request at the cheapest cost of any: admitting a dearer one first could leave fewer
    # admitted than refusing it would (a count, not tokens, is what is bounded).
    cost = min((period.cheapest for period in demand), default=0.0)
    if limit.is_window:
        exact = _aligned_windows(demand, limit)
        if exact is not None:  # windows apart: each at its own cheapest
            return sum(requests - _fit(requests, limit.limit, cheapest) for requests, cheapest, _ in exact)
        return _window_fewest(demand, limit, cost)
    rate = limit.limit / limit.period_us  # tokens per us
    level = float(limit.burst)
    refused = 0
    at: int | None = None
    for period in demand:
        if at is not None and period.start_us > at:
            level = min(limit.burst, level + rate * (period.start_us - at))  # idle time refills it
        at = period.end_us
        room = level + rate * period.length_us
        admitted = _fit(period.requests, room, cost)
        refused += period.requests - admitted
        level = min(float(limit.burst), room - admitted * cost)
    return refused


def most_refused(demand: Sequence[Demand], limit: Limit, since_us: int | None = None) -> int:
    """The most refusals any bunching of ``demand`` inside its periods could have met (every one of
    its requests since ``since_us``; before, anything may have emptied the bucket)."""
    total = sum(period.requests for period in demand)
    if limit.is_window:
        exact = _aligned_windows(demand, limit)
        if exact is not None:
            return sum(requests - _fit(requests, limit.limit, dearest) for requests, _, dearest in exact)
    alone = _held(demand, limit, demand[0].start_us if since_us is None and demand else since_us or 0)
    return total - max(_owed(demand, limit, first, alone) for first in (0, 1))


def _owed(demand: Sequence[Demand], limit: Limit, first: int, alone: Sequence[int]) -> int:
    """Requests surely admitted, pairing the periods from ``first``: each pair's second is owed what
    refills between the last burst before the pair and its own (a window: a window's limit, once
    those cannot share a window); each period is owed at least what it surely gets on its own
    (``alone``, :func:`_held`), a pair at least the sum of its two."""
    admitted = sum(alone[:first])
    for i in range(first, len(demand), 2):
        if i + 1 == len(demand):
            admitted += alone[i]
            break
        before, period = demand[i], demand[i + 1]
        if limit.is_window:
            window_of = limit.window_of
            assert window_of is not None
            owed = float(limit.limit) if window_of(before.start_us - 1) != window_of(period.start_us) else 0.0
        else:
            owed = min(float(limit.burst), limit.limit * (period.start_us - before.start_us) / limit.period_us)
        # At the dearest of both: what B admits takes at most that much each from what C is owed.
        dearest = max(before.most_cost, period.most_cost)
        admitted += max(_fit(period.requests, owed, dearest), alone[i] + alone[i + 1])
    return admitted


def _held(demand: Sequence[Demand], limit: Limit, since_us: int) -> list[int]:
    """What each period surely admits on its own, whatever the order: a token bucket is never
    emptier than its burst less what it admitted over the last burst's refill time, so a period
    whose neighbours of that long before asked for less than the burst gets the rest. (Before
    ``since_us`` nothing is known: a period that near it is owed nothing. A window: nothing.)"""
    if limit.is_window:
        return [0] * len(demand)
    refill_us = limit.burst * limit.period_us / limit.limit  # an empty bucket's time to fill
    held = []
    asked = 0.0  # the dearest tokens asked by the periods since ``start - refill_us``, before this one
    oldest = 0
    for i, period in enumerate(demand):
        while oldest < i and demand[oldest].end_us <= period.start_us - refill_us:
            asked -= demand[oldest].requests * demand[oldest].most_cost
            oldest += 1
        if period.start_us - refill_us < since_us:
            held.append(0)
        else:
            held.append(_fit(period.requests, limit.burst - asked, period.most_cost))
        asked += period.requests * period.most_cost
    return held


def _window_fewest(demand: Sequence[Demand], limit: Limit, cost: float) -> int:
    """A window's fewest refusals: each period's requests, at ``cost``, into the windows it
    overlaps, the earliest with room first (each window holds its limit)."""
    window_of = limit.window_of
    assert window_of is not None
    room: dict[int, float] = {}
    refused = 0
    for period in demand:
        left = period.requests
        for window in _windows_of(period, limit, window_of):
            held = room.setdefault(window, float(limit.limit))
            taken = _fit(left, held, cost)
            room[window] = held - taken * cost
            left -= taken
            if not left:
                break
        refused += left
    return refused


def _windows_of(period: Demand, limit: Limit, window_of: Callable[[int], int]) -> list[int]:
    """The windows ``period`` overlaps, by their starts, in order."""
    first, last = window_of(period.start_us), window_of(period.end_us - 1)
    if first == last:
        return [first]
    if limit.window_us is None:  # a calendar's windows are longer than any record's period
        return [first, last]
    return list(range(first, last + 1, limit.window_us))


def _aligned_windows(demand: Sequence[Demand], limit: Limit) -> list[tuple[int, float, float]] | None:
    """Each window's requests and their cheapest and dearest cost, if every period of ``demand``
    lies in one window (the records align with it); ``None`` if one spans two."""
    window_of = limit.window_of
    assert window_of is not None
    windows: dict[int, tuple[int, float, float]] = {}
    for period in demand:
        first = window_of(period.start_us)
        if first != window_of(period.end_us - 1):
            return None
        requests, cheapest, dearest = windows.get(first, (0, period.cheapest, period.most_cost))
        windows[first] = (
            requests + period.requests,
            min(cheapest, period.cheapest),
            max(dearest, period.most_cost),
        )
    return list(windows.values())


def _fit(requests: int, tokens: float, cost: float) -> int:
    """How many of ``requests`` at ``cost`` each ``tokens`` hold (all, at no cost)."""
    if cost <= 0:
        return requests
    return max(0, min(requests, int(tokens / cost + _ROUNDING)))


def period_window(period_us: int) -> Callable[[int], int]:
    """The window of a fixed window of ``period_us`` aligned to the epoch, by its start (us)."""
    return lambda at_us: at_us // period_us * period_us
