"""What the engine tells the metrics at each flush: its breaker, its local path and its worker shedder.

They keep their own counts (a breaker's transitions, the local path's hits and tokens), which are
added to the metrics as the differences since the last flush; gauges are set as they are then.
"""

from __future__ import annotations

import weakref
from collections import Counter

from ..metrics import Recorder, add_sampler
from .breaker import BreakerState
from .limiter import current_limiter
from .shedding import current_worker_shedder

__all__ = ["BREAKER_STATE_VALUES", "sample"]

#: ``ratelimits_breaker_state``'s values: the higher, the less reaches the store.
BREAKER_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

#: Each count's owner -> the figures last added to the metrics (an owner rebuilt starts at zero).
_exported: weakref.WeakKeyDictionary[object, Counter[str]] = weakref.WeakKeyDictionary()


def sample(recorder: Recorder) -> None:
    """Set the engine's gauges and add its counts since the last call (one flush at a time calls it)."""
    limiter = current_limiter()
    if limiter is not None:
        breaker = limiter.breaker
        recorder.set_gauge("ratelimits_breaker_state", BREAKER_STATE_VALUES[breaker.state])
        _add_new(recorder, "ratelimits_breaker_transitions", breaker, breaker.transitions)
        local = limiter.local_path
        if local is not None:
            _add_new(recorder, "ratelimits_local_events", local, local.counts)
    shedder = current_worker_shedder()
    if shedder is not None:
        recorder.set_gauge("ratelimits_worker_capacity", shedder.capacity)
        recorder.set_gauge("ratelimits_worker_in_flight", shedder.in_flight)


def _add_new(recorder: Recorder, name: str, owner: object, counts: Counter[str]) -> None:
    last = _exported.get(owner)
    if last is None:
        last = _exported[owner] = Counter()
    for label, value in list(counts.items()):
        before = last[label]
        # Fewer than last time: the counts were started afresh (in a forked child), so all are new.
        new = value - before if value >= before else value
        if new:
            recorder.count(name, str(label), amount=new)
        last[label] = value


add_sampler(sample)
