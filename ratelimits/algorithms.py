"""The limiting algorithms as pure functions of (state, now): the reference the Lua script mirrors.

Every function takes the stored state (or ``None``), the current time and the limit, and
returns an :class:`Outcome` without side effects; backends decide whether to store
``new_state``. All times are integer microseconds. Arithmetic is done in the same order as in
``lua/decide.lua`` so both produce bit-identical results on IEEE doubles.

A state records the terms it was written in (a bucket's capacity, a window's limit and period).
When a policy changes, its state is read in the new terms by the share already used: a bucket
half spent is half spent under the new rate and burst, a window a third used is a third used of
the new limit (with another period, no more than the count itself). Raising a limit so never
lengthens a bucket's wait (the arrival time a strict policy left, read under a looser one's
emission interval, would), nor, within the same window, a window's; lowering one never admits
more than the new burst. A state written in the same terms reads exactly as before: the
conversion runs only when the terms differ. A converted state is stored by the first call that
consumes, admitted or not (:attr:`Outcome.converted`): from then on it drains at the new rate,
so the wait a denial names is the wait there is (read again under the old terms, it would drain
at the old rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from .periods import counted_period


class Algorithm(StrEnum):
    """How a policy counts. The values are the names used in settings and the admin."""

    #: Token bucket expressed as GCRA: one timestamp per key, smooth refill, bursts up to ``burst``.
    TOKEN_BUCKET = "token_bucket"
    #: Two fixed windows, the previous weighted by how much of it still overlaps the sliding one.
    SLIDING_WINDOW = "sliding_window"
    #: Calendar-aligned counter; simple, but allows up to twice the limit across a boundary.
    FIXED_WINDOW = "fixed_window"
    #: Requests in flight per subject: one slot per request, freed when its response has left.
    CONCURRENCY = "concurrency"
    #: Requests in flight across the fleet, limited per priority class (the load shedder).
    FLEET = "fleet"

    @property
    def holds_slots(self) -> bool:
        """Whether a check of this kind holds a slot until the request finishes."""
        return self in (Algorithm.CONCURRENCY, Algorithm.FLEET)

    @property
    def code(self) -> int:
        """The number the Lua script dispatches on."""
        return _CODES[self]


#: The algorithms a rate policy (tier, endpoint, override) may use.
RATE_ALGORITHMS = (Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW)

_CODES = {
    Algorithm.TOKEN_BUCKET: 1,
    Algorithm.SLIDING_WINDOW: 2,
    Algorithm.FIXED_WINDOW: 3,
    Algorithm.CONCURRENCY: 4,
    Algorithm.FLEET: 5,  # the same slots; a denial sheds (503) rather than limits (429)
}

#: Stored state: GCRA keeps (theoretical arrival time, capacity in us); a sliding window (window
#: index, current count, previous count, limit, period in us); a fixed window (window index,
#: count, limit, period in us). A state without its terms (the layouts before them: ``(tat,)``,
#: ``(window, current, previous)``, ``(window, count)``) is read in the current policy's terms.
State = tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one check decided, before the all-or-nothing rule is applied."""

    allowed: bool
    #: Whole requests of cost 1 still available after this one (or now, if denied).
    remaining: int
    #: Microseconds until the limit is fully restored if nothing else arrives.
    reset_us: int
    #: Microseconds until this request would be admitted; 0 when allowed.
    retry_us: int
    #: State to store if the request is admitted.
    new_state: State
    #: The stored state in the policy's current terms, when it was written in others: stored by a
    #: call that consumes even when the request is denied (it spends nothing; it fixes the change).
    converted: State | None = None


def token_bucket(state: State | None, now: int, limit: int, period_us: int, burst: int, cost: int) -> Outcome:
    """GCRA: admit when the theoretical arrival time after this request is within ``burst`` intervals.

    The arrival time is kept as a float, unrounded: rounding it up on every request would
    shave a little off the burst each time (three requests of 1/3 s each would no longer fit
    in one second).
    """
    interval = period_us / limit
    capacity = burst * interval
    tat = float(now)
    converted = None
    if state is not None and state[0] > now:
        tat = state[0]
        if len(state) > 1 and state[1] != capacity:
            # Written under another rate or burst: the same share of the burst is spent in the new
            # terms. At most all of it: an arrival time near 2026 is a double of 0.25 us resolution,
            # and a debt rounded past the capacity would grow by the ratio of the capacities.
            tat = now + min(tat - now, state[1]) * capacity / state[1]
            converted = (tat, capacity)
    new_tat = tat + cost * interval
    allow_at = new_tat - capacity
    if now < allow_at:
        remaining = math.floor((now + capacity - tat) / interval)
        return Outcome(
            allowed=False,
            remaining=max(remaining, 0),
            reset_us=math.ceil(tat - now),
            retry_us=math.ceil(allow_at - now),
            new_state=(tat, capacity),
            converted=converted,
        )
    return Outcome(
        allowed=True,
        remaining=max(math.floor((now + capacity - new_tat) / interval), 0),
        reset_us=math.ceil(new_tat - now),
        retry_us=0,
        new_state=(new_tat, capacity),
        converted=converted,
    )


def sliding_window(state: State | None, now: int, limit: int, period_us: int, burst: int, cost: int) -> Outcome:
    """Sliding window counter: ``previous * overlap + current + cost <= limit``."""
    window = now // period_us
    elapsed = now - window * period_us
    current, previous = _roll(state, now, window, limit, period_us)
    converted = (window, current, previous, limit, period_us) if _other_terms(state, 3, limit, period_us) else None
    estimate = _estimate(previous, current, elapsed, period_us)
    until_next = period_us - elapsed
    reset = until_next + period_us if current > 0 else (until_next if previous > 0 else 0)
    if estimate + cost <= limit:
        return Outcome(
            allowed=True,
            remaining=max(math.floor(limit - estimate - cost), 0),
            reset_us=until_next + period_us,
            retry_us=0,
            new_state=(window, current + cost, previous, limit, period_us),
            converted=converted,
        )
    return Outcome(
        allowed=False,
        remaining=max(math.floor(limit - estimate), 0),
        reset_us=reset,
        retry_us=_sliding_retry(previous, current, elapsed, period_us, limit, cost),
        new_state=(window, current, previous, limit, period_us),
        converted=converted,
    )


def fixed_window(state: State | None, now: int, limit: int, period_us: int, burst: int, cost: int) -> Outcome:
    """Fixed window counter aligned to the epoch."""
    window = now // period_us
    until_next = period_us - (now - window * period_us)
    count, converted = 0, None
    if state is not None:
        if _other_terms(state, 2, limit, period_us):
            # Written under another limit or window: the same share of the new limit, while its
            # window (in its own terms) is still the current one.
            same = state[3] == period_us
            count = _share(state[1], limit, state[2], same) if state[0] == now // state[3] else 0
            converted = (window, count, limit, period_us)
        elif state[0] == window:
            count = int(state[1])
    return _counted(window, count, until_next, limit, period_us, cost, converted, soft=False)


def period_window(
    state: State | None,
    now: int,
    limit: int,
    period_us: int,
    cost: int,
    bounds: tuple[int, int, int],
    soft: bool,
) -> Outcome:
    """A quota's count in the billing period holding ``now``: ``[b0, b1)`` before ``b1``, else ``[b1, b2)``.

    ``bounds`` are three period starts around now (:meth:`ratelimits.periods.BillingPeriod.bounds`);
    the window is named by its start, and ``period_us`` (the unit's longest period) is only the terms
    a count was written in. ``soft``: past the limit, admitted all the same and counted (the overage).
    """
    window, until_next = counted_period(bounds, now)
    count, converted = 0, None
    if state is not None:
        if _other_terms(state, 2, limit, period_us):
            # Another limit: the same share of it, while the period is the same one. Another unit
            # (its start moved): a period of its own, counted afresh.
            count = _share(state[1], limit, state[2], True) if state[0] == window and state[3] == period_us else 0
            converted = (window, count, limit, period_us)
        elif state[0] == window:
            count = int(state[1])
    return _counted(window, count, until_next, limit, period_us, cost, converted, soft=soft)


def _counted(
    window: int,
    count: int,
    until_next: int,
    limit: int,
    period_us: int,
    cost: int,
    converted: State | None,
    *,
    soft: bool,
) -> Outcome:
    """A window's verdict on ``cost`` more with ``count`` spent; ``soft``: past the limit, admitted and counted."""
    terms = (limit, period_us)
    if count + cost <= limit:
        return Outcome(True, limit - count - cost, until_next, 0, (window, count + cost, *terms), converted)
    if soft:
        return Outcome(True, 0, until_next, 0, (window, count + cost, *terms), converted)
    return Outcome(False, max(limit - count, 0), until_next, until_next, (window, count, *terms), converted)


def _other_terms(state: State | None, at: int, limit: int, period_us: int) -> bool:
    """Whether a window's state records terms (a limit and period from index ``at``) other than these."""
    return state is not None and len(state) > at and (state[at] != limit or state[at + 1] != period_us)


def _roll(state: State | None, now: int, window: int, limit: int, period_us: int) -> tuple[float, float]:
    """(current, previous) counts as seen from ``window``, in the terms of ``limit`` per ``period_us``."""
    if state is None:
        return 0, 0
    stored_window, current, previous = state[0], state[1], state[2]
    if _other_terms(state, 3, limit, period_us):
        # Written under another limit or window: its windows seen from now in their own terms,
        # each count as the same share of the new limit, exactly (the estimate weighs the previous
        # window by a fraction anyway: rounding each count up would refuse, after a raise, a
        # request the old terms admitted).
        old_limit, old_window, same = state[3], now // state[4], state[4] == period_us
        if stored_window == old_window:
            return _exact_share(current, limit, old_limit, same), _exact_share(previous, limit, old_limit, same)
        if stored_window == old_window - 1:
            return 0, _exact_share(current, limit, old_limit, same)
        return 0, 0
    # As stored: a count converted from other terms may be a fraction of a request.
    if stored_window == window:
        return current, previous
    if stored_window == window - 1:
        return 0, current
    return 0, 0


def _exact_share(count: float, limit: int, old_limit: float, same_period: bool) -> float:
    """A sliding window's count as the same share of ``limit`` (at most the count, with another period)."""
    shared = count * limit / old_limit
    return shared if same_period else min(shared, count)


def _share(count: float, limit: int, old_limit: float, same_period: bool) -> int:
    """``count`` of ``old_limit``, as the same share of ``limit``: rounded up, never to admit more.

    With another period, no more than ``count`` itself: 10 of 10 a minute are 10 requests of a new
    1000 an hour, not the whole hour's (which would lock the caller out for the rest of it).
    """
    shared = math.ceil(count * limit / old_limit)
    return shared if same_period else min(shared, int(count))


def _estimate(previous: float, current: float, elapsed: int, period_us: int) -> float:
    # float() first: Lua multiplies in doubles, and Python's exact integers would round differently.
    return previous * float(period_us - elapsed) / period_us + current


def _sliding_retry(previous: float, current: float, elapsed: int, period_us: int, limit: int, cost: int) -> int:
    """Smallest wait after which the request fits, assuming nothing else is admitted meanwhile."""
    if cost > limit:
        raise ValueError(f"cost {cost} can never fit a limit of {limit}")
    until_next = period_us - elapsed
    room = limit - current - cost
    if room >= 0 and previous > 0:
        # Fits later in this window, once enough of the previous window has slid out.
        wait = until_next - room * float(period_us) / previous
    else:
        # In the next window, today's count becomes the weighted "previous".
        refill = period_us - (limit - cost) * float(period_us) / current if current > 0 else 0.0
        wait = until_next + max(refill, 0.0)
    wait_us = max(math.ceil(wait), 1)
    # Division can land a hair early; step forward to the first microsecond that really fits.
    while not _fits_after(previous, current, elapsed, period_us, limit, cost, wait_us):
        wait_us += 1
    return wait_us


def _fits_after(
    previous: float, current: float, elapsed: int, period_us: int, limit: int, cost: int, wait: int
) -> bool:
    at = elapsed + wait
    if at < period_us:
        return _estimate(previous, current, at, period_us) + cost <= limit
    at -= period_us
    prior = current if at < period_us else 0
    return _estimate(prior, 0, at % period_us, period_us) + cost <= limit


#: How soon a caller denied a slot should retry: slots are freed as requests finish, which is
#: usually far sooner than their expiry.
SLOT_RETRY_US = 1_000_000


def slots(held: dict[str, int], now: int, limit: int, ttl_us: int, cost: int) -> tuple[Outcome, dict[str, int]]:
    """Slots in flight: admit while fewer than ``limit`` unexpired slots are held.

    ``held`` maps slot ids to their expiry (microseconds). Expired slots (their worker died
    holding them) no longer count. Returns the outcome and the live slots; taking the new slot
    is the backend's job, once every check of the request has allowed.
    """
    live = {slot: expiry for slot, expiry in held.items() if expiry > now}
    count = len(live)
    if count + cost <= limit:
        return Outcome(True, limit - count - cost, ttl_us, 0, ()), live
    earliest = min(live.values(), default=now + ttl_us)
    return Outcome(False, max(limit - count, 0), earliest - now, min(earliest - now, SLOT_RETRY_US), ()), live


#: A global bucket's share that is ``EPSILON`` tokens short of a cost still pays it (``lua/decide.lua``).
EPSILON = 1e-9
#: How soon a global check whose region's share holds less than its cost is told to retry.
RESHARE_RETRY_US = 1_000_000


def global_bucket(
    state: State | None, now: int, limit: int, period_us: int, burst: int, cost: int, share: float
) -> Outcome:
    """A global policy's token bucket in one region: ``share`` of its rate and burst (``lua/decide.lua``).

    The state is ``(tokens, time, share spent at, rate per us, burst)``: tokens, so that a share
    change keeps what the region holds. Refilled at the lesser of the two shares since it was spent.
    A bucket written under another burst holds the same share of the new one.
    """
    if share <= 0:  # every other region out of reach holds what there is
        return Outcome(False, 0, 0, RESHARE_RETRY_US, state or ())
    full = limit / period_us
    capacity = burst * share
    speed = full * share
    held = capacity
    if state is not None:
        held, at, spent_share = state[0], state[1], state[2]
        if state[4] != burst:
            held = held * burst / state[4]
        if now > at:
            held += (now - at) * full * min(share, spent_share)
        held = min(held, capacity)
    if held + EPSILON >= cost:
        held = max(held - cost, 0.0)
        reset = math.ceil((capacity - held) / speed)
        return Outcome(True, math.floor(held + EPSILON), reset, 0, (held, float(now), share, full, float(burst)))
    retry = max(math.ceil((cost - held) / speed), 1) if cost <= capacity else RESHARE_RETRY_US
    return Outcome(False, math.floor(held + EPSILON), math.ceil((capacity - held) / speed), retry, state or ())


ALGORITHMS = {
    Algorithm.TOKEN_BUCKET: token_bucket,
    Algorithm.SLIDING_WINDOW: sliding_window,
    Algorithm.FIXED_WINDOW: fixed_window,
}


#: A token bucket's holes: refunds time has not reached yet, ``(end, length)`` in its queue's
#: coordinates (us), highest first, holes that touch made one. Those apart are kept apart by a
#: spend nobody gave back: at most this many are kept, the lowest dropped (taken as reached, so
#: that a refund behind it gives back less, never more).
MAX_HOLES = 64
Holes = tuple[tuple[float, float], ...]


def frontier(queue_end: float, unpaid: float, holes: Holes) -> tuple[float, Holes]:
    """How far time has paid a token bucket's queue, and the holes beyond that point.

    A bucket's queue, in coordinates that refunds never shift (its arrival time plus every us
    given back so far: ``queue_end``), holds each admission's interval in order; a refund cuts the
    unpaid end of one out (a hole) and time pays the rest from the front, skipping holes. The
    point time has reached is where the unpaid intervals beyond it, holes left out, add up to
    ``unpaid`` (the arrival time less now): walked down from the end, through the holes.
    """
    at, left = queue_end, unpaid
    for n, (end, length) in enumerate(holes):
        gap = max(at - end, 0.0)
        if gap >= left:
            return at - left, holes[:n]
        left -= gap
        at = end - length
    return at - left, holes


def with_hole(holes: Holes, end: float, length: float) -> Holes:
    """``holes`` with one more, in its place (highest first), holes that touch made one (within a
    microsecond: positions near 2^50 us are doubles rounded to a quarter of one)."""
    merged: list[tuple[float, float]] = []
    for hole_end, hole_length in sorted((*holes, (end, length)), reverse=True):
        if merged and merged[-1][0] - merged[-1][1] - hole_end < 1:
            above_end, above_length = merged[-1]
            merged[-1] = (above_end, above_end - min(above_end - above_length, hole_end - hole_length))
        else:
            merged.append((hole_end, hole_length))
    return tuple(merged[:MAX_HOLES])


def settled(
    algorithm: Algorithm,
    state: State | None,
    now: int,
    limit: int,
    period_us: int,
    burst: int,
    change: int,
    *,
    taken_us: int,
    spent_tat: float,
    given_back: float,
    refunded: float = 0.0,
    holes: Holes = (),
    is_global: bool = False,
) -> tuple[State, float, Holes] | None:
    """A spend's state after its cost changed by ``change`` tokens (fewer give back, more charge):
    ``lua/refund.lua``'s rule, and the memory backend's. ``None``: left as it is.

    ``taken_us``, ``spent_tat`` and ``given_back`` are what the spend recorded
    (:class:`~ratelimits.decisions.Spent`); a token bucket's ``refunded`` (us given back to it so
    far) and ``holes`` (:func:`frontier`) come back as they are after the change. Given back: the
    part of the spend time has not paid yet, wherever the refunds of other spends came in the
    meantime, in whatever order. Charged: whether or not the limit has room, in the window the
    spend was made in while it still counts (a bucket's arrival time moves later, a full bucket's
    from now). A state in other terms (its policy changed) is left as it is.
    """
    if change == 0 or algorithm.holds_slots:
        return None
    if is_global:
        if state is None:
            return None
        held, at, spent_share, full, written_burst = state[:5]
        # Given back up to the share's burst it was spent at, as the bucket was written (refund.lua).
        new_held = held + (-change if change > 0 else min(-change, written_burst * spent_share - held))
        if change < 0 and new_held <= held:
            return None
        return (new_held, at, spent_share, full, written_burst), refunded, holes
    if algorithm is Algorithm.TOKEN_BUCKET:
        interval = period_us / limit
        capacity = burst * interval
        if change > 0:
            tat, written = (float(now), capacity) if state is None else (state[0], state[1])
            if written != capacity:
                return None
            return (max(tat, now) + change * interval, capacity), refunded, holes if tat > now else ()
        if state is None:
            return None
        tat, written = state[0], state[1]
        if written != capacity or tat <= now or refunded < given_back:
            return None  # other terms; nothing unpaid; a bucket reset since (given back less than then)
        reached, beyond = frontier(tat + refunded, tat - now, holes)
        end = spent_tat + given_back  # the spend's end in the queue's coordinates
        spend = -change * interval
        outstanding = min(spend, end - reached)
        if spend - outstanding < 1:
            # Less than a microsecond paid: the rounding of doubles near 2^50 us, not time (whose
            # clock counts whole microseconds). Owed whole, or a storm's refunds would each leave a
            # sliver spent, and their sum keep a token from coming back.
            outstanding = spend
        if outstanding <= 0:
            return None
        new_tat = max(tat - outstanding, float(now))
        cut = tat - new_tat
        return (new_tat, capacity), refunded + cut, with_hole(beyond, end, cut)
    terms_at = 3 if algorithm is Algorithm.SLIDING_WINDOW else 2
    if state is not None and len(state) > terms_at and (state[-2] != limit or state[-1] != period_us):
        return None  # other terms
    consumed = taken_us // period_us
    if algorithm is Algorithm.FIXED_WINDOW and spent_tat > 0:
        consumed = int(spent_tat)  # a billing period's, named by its start
    if change > 0:
        charged = _window_charged(algorithm, state, now, limit, period_us, change, consumed, spent_tat > 0)
        return None if charged is None else (charged, refunded, holes)
    if state is None:
        return None
    window = state[0]
    if algorithm is Algorithm.SLIDING_WINDOW:
        current, previous = state[1], state[2]
        if window == consumed:
            return (window, max(current + change, 0), previous, limit, period_us), refunded, holes
        if window == consumed + 1:
            return (window, current, max(previous + change, 0), limit, period_us), refunded, holes
        return None
    if window == consumed:
        return (window, max(state[1] + change, 0), limit, period_us), refunded, holes
    return None


def _window_charged(
    algorithm: Algorithm,
    state: State | None,
    now: int,
    limit: int,
    period_us: int,
    change: int,
    consumed: float,
    billing: bool,
) -> State | None:
    """A window's state charged ``change`` more for a spend made in window ``consumed``: there while
    it counts (a sliding window's, as current or previous), else in the window now (a billing
    period's only if its state is of that period or a later one: its start is not known here)."""
    window = state[0] if state is not None else None
    if algorithm is Algorithm.SLIDING_WINDOW:
        current, previous = (state[1], state[2]) if state is not None else (0.0, 0.0)
        now_window = now // period_us
        if now_window <= consumed + 1:  # the spend's window still counts, as current or previous
            if window == consumed:
                return (window, current + change, previous, limit, period_us)
            if window == consumed + 1:
                return (window, current, previous + change, limit, period_us)
            if now_window == consumed:  # its state gone: made afresh
                return (now_window, change, 0, limit, period_us)
            return (now_window, 0, change, limit, period_us)
        if window == now_window:  # over: the window now pays
            return (window, current + change, previous, limit, period_us)
        return (now_window, change, current if window == now_window - 1 else 0, limit, period_us)
    if billing:
        if state is None or window is None or window < consumed:
            return None
        return (window, state[1] + change, limit, period_us)
    now_window = now // period_us  # the spend's window, or, over, the one now
    if window == now_window and state is not None:
        return (window, state[1] + change, limit, period_us)
    return (now_window, change, limit, period_us)


def charged_window_end(algorithm: Algorithm, state: State, period_us: int) -> int:
    """Until when a window's state charged by :func:`settled` counts (us): its window's end (a
    sliding window's, a period more)."""
    end = (int(state[0]) + 1) * period_us
    return end + period_us if algorithm is Algorithm.SLIDING_WINDOW else end
