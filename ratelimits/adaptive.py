"""Adaptive capacity: how many requests a worker serves at once, following its latency and errors.

The worker shedder admits each priority class while the worker's in-flight count is below a
share of its capacity. With ``SHEDDING['ADAPTIVE']`` that capacity is no longer a fixed number but
the output of this controller: additive increase while the worker is healthy and the capacity is
what turns requests away, multiplicative decrease when it is sick. Sick means one of:

- an endpoint's median latency over a window above ``tolerance`` times its usual one: the factor is
  ``tolerance / slowdown`` (between 0.5 and 0.9), so the worse the latency, the deeper the cut;
- more 5xx responses (and timeouts) than usual by over ``error_rate``.

Each endpoint has its own usual latency (a baseline), since a report export and a payment differ
a hundredfold; a single minimum RTT, as in TCP Vegas, would always call the slow endpoint sick.
A baseline follows its endpoint down fast (halfway each window), and up slowly and only in
windows within tolerance in which the capacity turned nothing away: latency from load never
becomes the new usual, which is how Gradient2's long-term average drifts upward under a steady
overload (Netflix concurrency-limits #134, #137). A latency that stays high even at the floor,
for requests admitted there, does not come from this worker's load (the downstream itself became
slower): only then is it taken as the new usual, as Envoy re-measures its minimum RTT at the
least concurrency (the knee those cuts set is forgotten, for the last one another endpoint caused
or the one known before them). After a cut the capacity stays below the level it was cut at for
``probe_interval`` (one below, or for the worker shedder where every class is admitted less), so
it does not keep probing into the overload it just left.

Pure arithmetic on the samples it is given, with the clock passed in: docs/adaptive.md, and the
scripted series of tests/test_adaptive.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from .conf import AdaptiveSettings

__all__ = ["CapacityController", "Move"]

#: The most responses of one endpoint kept for judging (the median of the first ones is as good).
MAX_SAMPLES = 1024
#: How fast a baseline rises toward a slower window (within tolerance, nothing shed), and falls toward a faster one.
RISE = 0.05
FALL = 0.5
#: A cut takes at least a tenth off (a latency just over tolerance is no reason for a token move),
#: and at most half.
MAX_CUT = 0.9
#: Windows an endpoint's responses wait to be enough to judge, and its last judgement is kept.
STALE_WINDOWS = 8
#: The most endpoints with a baseline: endpoint names are few; the bound only guards against a
#: project that names endpoints after something unbounded.
MAX_ENDPOINTS = 1000


@dataclass(frozen=True, slots=True)
class Move:
    """A change of the capacity: from, to, and why (for the log and the admin)."""

    at: float
    before: float
    after: float
    reason: str

    @property
    def changed(self) -> bool:
        """Whether the whole-request capacity changed (the limit moves by fractions in between)."""
        return int(self.before) != int(self.after)


class _Samples:
    """Latencies (seconds) of one endpoint not yet judged: kept over windows until there are ``min_samples``."""

    __slots__ = ("latencies", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.latencies: list[float] = []


class CapacityController:
    """The capacity of one worker: ``limit`` moves within ``[floor, ceiling]``; ``capacity`` is its whole part.

    Not thread-safe: the worker shedder calls it under its lock. ``now`` is any monotonic clock in seconds.
    """

    def __init__(
        self,
        ceiling: int,
        settings: AdaptiveSettings,
        *,
        now: float,
        below: Callable[[int], int] | None = None,
    ) -> None:
        floor = settings.floor if settings.floor is not None else max(ceiling // 4, 1)
        if not 1 <= floor <= ceiling:
            raise ValueError(f"the floor ({floor}) must be between 1 and the ceiling ({ceiling})")
        self.settings = settings
        self.ceiling = ceiling
        self.floor = floor
        #: The capacity to grow back to after a cut at a given one: one less by default; the worker
        #: shedder's is the highest at which every class is admitted less than at the cut.
        self.below = below or (lambda knee: knee - 1)
        #: Starts at the floor, as TCP's slow start does: the first responses, which teach each
        #: endpoint's usual latency, come under the least load; it grows while requests are shed.
        self.limit = float(floor)
        self.baselines: dict[str, float] = {}
        #: The share of errors taken as usual (re-measured at the floor; falls with the share).
        self.usual_errors = 0.0
        #: The limit at the last cut, and when: the capacity stays below it for ``probe_interval``.
        self.knee: float | None = None
        self.knee_at = 0.0
        self.last: Move | None = None
        #: The cuts since the worker was last healthy: (limit, when, the endpoint whose latency
        #: caused it, or None for errors), and the knee from before them.
        self._cuts: list[tuple[float, float, str | None]] = []
        self._before_cuts: tuple[float | None, float] = (None, 0.0)
        #: Each endpoint's last judgement (slowdown, when, median latency): a slow endpoint judged a
        #: moment ago still holds the capacity back while its next responses are awaited.
        self._judged: dict[str, tuple[float, float, float]] = {}
        self._pending: dict[str, _Samples] = {}
        self._started = now
        #: When the capacity was last cut: responses admitted before are not judged after it.
        self._cut_at = -math.inf
        #: Every response it was told of (what the admin shows it learned from).
        self.observed = 0
        self._responses = 0
        self._errors = 0
        self._shed = 0

    @property
    def capacity(self) -> int:
        return int(self.limit)

    def shed(self) -> None:
        """A request was turned away because of the capacity: more of it would have been used."""
        self._shed += 1

    def record(
        self, endpoint: str, latency: float, *, error: bool, now: float, admitted_at: float | None = None
    ) -> Move | None:
        """One response: its endpoint, its latency (seconds) and whether it failed. Closes the window when due.

        A response admitted (``admitted_at``, on the same clock as ``now``) before the last cut
        says how the old capacity did, not the new one: it is left out, or the windows after a
        cut would judge it on the very load it removed, and the floor could take that load's
        latency as the new usual. ``None``: admitted at the current capacity.
        """
        if admitted_at is not None and admitted_at < self._cut_at:
            return None
        timeout = self.settings.timeout
        self.observed += 1
        self._responses += 1
        if error or (timeout is not None and latency >= timeout):
            self._errors += 1
        samples = self._pending.get(endpoint)
        if samples is None:
            if len(self._pending) >= MAX_ENDPOINTS:
                return None
            samples = self._pending[endpoint] = _Samples(now)
        if len(samples.latencies) < MAX_SAMPLES:
            samples.latencies.append(latency)
        if now - self._started < self.settings.window:
            return None
        return self._adjust(now)

    def _judge(self, now: float) -> tuple[float, str] | None:
        """Judge each endpoint with enough responses; the slowest judged now (slowdown, endpoint)."""
        settings = self.settings
        worst: tuple[float, str] | None = None
        for endpoint, samples in list(self._pending.items()):
            if len(samples.latencies) < settings.min_samples:
                if now - samples.since > STALE_WINDOWS * settings.window:
                    del self._pending[endpoint]  # too few to judge, and too old to judge later
                continue
            del self._pending[endpoint]
            # The median: what most of its responses met (a queue makes every one wait), not what
            # a few stalled ones did (a garbage collection, a neighbour's CPU burst).
            typical = statistics.median(samples.latencies)
            baseline = self.baselines.get(endpoint)
            if baseline is None:
                if len(self.baselines) < MAX_ENDPOINTS:
                    self.baselines[endpoint] = typical  # its first responses are its usual latency
                continue
            slowdown = typical / baseline if baseline > 0 else 1.0
            self._judged[endpoint] = (slowdown, now, typical)
            if worst is None or slowdown > worst[0]:
                worst = (slowdown, endpoint)
            if typical < baseline:
                self.baselines[endpoint] = baseline + FALL * (typical - baseline)
            elif slowdown <= settings.tolerance and not self._shed:
                # Only while the capacity turned nothing away: a latency measured at full capacity
                # holds some of the load's own queueing, and learning it would ratchet up (#134).
                self.baselines[endpoint] = baseline + RISE * (typical - baseline)
        return worst

    def _adjust(self, now: float) -> Move | None:
        settings = self.settings
        worst = self._judge(now)
        responses, errors, shed = self._responses, self._errors, self._shed
        self._started, self._shed = now, 0
        judged_errors = responses >= settings.min_samples
        if judged_errors:
            self._responses = self._errors = 0  # else they wait for more, as an endpoint's latency does
        error_share = errors / responses if responses else 0.0
        failing = judged_errors and error_share > self.usual_errors + settings.error_rate
        if judged_errors and not failing:
            self.usual_errors = min(self.usual_errors, error_share)
        if failing:
            factor = min(MAX_CUT, max(0.5, 1 - (error_share - self.usual_errors)))
            reason = f"{error_share:.0%} of responses failed (usually {self.usual_errors:.0%})"
        elif worst is not None and worst[0] > settings.tolerance:
            factor = min(MAX_CUT, max(0.5, settings.tolerance / worst[0]))
            reason = f"{worst[1]} answered {worst[0]:.1f}x slower than usual (tolerance {settings.tolerance:g}x)"
        else:
            held_back = bool(self._slow_lately(now))
            if (worst is not None or judged_errors) and not held_back:
                # Healthy, every endpoint: a sickness is over (another endpoint judged healthy
                # while a slow one awaits its next responses is not the end of it).
                self._cuts.clear()
            if not shed or worst is None or held_back:
                # Nothing turned away (more capacity would change nothing), no endpoint judged
                # healthy now, or one judged slow lately awaits judging again.
                return None
            return self._grow(now)
        if self.limit > self.floor:
            if not self._cuts:
                self._before_cuts = (self.knee, self.knee_at)
            self._cuts.append((self.limit, now, None if failing or worst is None else worst[1]))
            self.knee, self.knee_at = self.limit, now
            self._cut_at = now
            self._pending.clear()  # admitted before the cut (see record)
            self._responses = self._errors = 0
            return self._move(max(self.limit * factor, float(self.floor)), reason, now)
        # Still sick with as little load as this worker may take: the cause is not its load.
        # Every endpoint judged slow lately, not only now: one awaiting its next responses was judged
        # at the floor too (or it would hold the capacity back until judged again).
        usual: set[str | None] = set()
        for endpoint in self._slow_lately(now):
            self.baselines[endpoint] = self._judged.pop(endpoint)[2]
            usual.add(endpoint)
        if failing:
            self.usual_errors = error_share
            usual.add(None)
        # The cuts those caused were no knee either. The last cut another endpoint's latency
        # caused is (a payment that queued behind exports before they slowed down); with none,
        # the knee it knew before these cuts is its best guess again.
        kept = [(limit, at) for limit, at, cause in self._cuts if cause not in usual]
        self.knee, self.knee_at = kept[-1] if kept else self._before_cuts
        self._cuts.clear()
        return self._move(self.limit, f"{reason} at the floor: taken as the new usual", now)

    def _slow_lately(self, now: float) -> list[str]:
        """The endpoints last judged slow, lately enough that their judgement still stands."""
        recent = STALE_WINDOWS * self.settings.window
        tolerance = self.settings.tolerance
        return [e for e, (slowdown, at, _) in self._judged.items() if slowdown > tolerance and now - at <= recent]

    def _grow(self, now: float) -> Move | None:
        top = float(self.ceiling)
        if self.knee is not None and now - self.knee_at < self.settings.probe_interval:
            top = min(top, max(float(self.below(math.floor(self.knee))), float(self.floor)))
        target = min(self.limit + max(1.0, math.sqrt(self.limit) / 2), top)
        if target <= self.limit:
            return None  # at the ceiling, or just below the last cut
        return self._move(target, "healthy, and requests were shed", now)

    def _move(self, after: float, reason: str, now: float) -> Move:
        move = Move(at=now, before=self.limit, after=after, reason=reason)
        self.limit = after
        self.last = move
        return move
