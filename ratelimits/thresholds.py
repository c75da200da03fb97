"""Which thresholds of a quota a decision shows crossed: read from the decision's own results.

Every decision brings back each check's ``remaining``: for a quota, how much of the billing period
is left once this request is counted. So a crossing (80% of this month's quota spent) is known
from what the store already answered, with no call of its own. A refusal by the quota shows what
was spent too: a caller refused by a spent quota shows the 100% crossing, whichever process
admitted its last request.

:class:`ThresholdWatch` remembers, in this process, what it has reported, so that a crossing costs
one report per process and period, not one per request. What it reports waits in it until the
policy store takes it, after the response (:mod:`ratelimits.store.notices`): the request never
waits on the database, and an async request never touches it from the loop. The rows made are
unique, so the fleet's processes together make one notice. A process killed before it wrote what
it saw loses nothing for good: the watch dies with it, and the subject's next request, in any
process, reports the crossing again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._process import ProcessWide
from .conf import conf
from .decisions import Decision
from .exceptions import ConfigurationError
from .periods import counted_period
from .policies.values import Role

__all__ = ["PENDING_LIMIT", "Crossing", "ThresholdWatch", "observe", "threshold_watch"]

#: The most crossings waiting to be written in one process: decisions made outside a request (no
#: response to write them after) must not make the list grow for ever.
PENDING_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class Crossing:
    """A subject past ``threshold`` percent of a quota in one billing period."""

    subject_kind: str
    subject_id: str
    policy: str
    threshold: int
    #: The billing period's start, in microseconds since the epoch (as the store picked the period).
    period_start_us: int
    #: What was spent, of ``limit``, when the crossing was seen.
    used: int
    limit: int

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        return (self.subject_kind, self.subject_id, self.policy, self.threshold, self.period_start_us)


class ThresholdWatch:
    """The crossings of ``thresholds`` (percentages of a quota) that this process has reported.

    Bounded: past ``limit`` entries it forgets them all (a forgotten crossing is reported again,
    and its row is already there: nothing is sent twice).
    """

    def __init__(self, thresholds: Sequence[int], *, limit: int = 100_000) -> None:
        self.thresholds = tuple(sorted(set(thresholds)))
        self.limit = limit
        self._seen: set[tuple[str, str, str, int, int]] = set()
        #: Reported and not yet taken by the writer (:meth:`take`).
        self.pending: list[Crossing] = []
        self._lock = threading.Lock()

    def observe(self, decision: Decision) -> None:
        """Keep the crossings ``decision`` shows that this process has not reported, for :meth:`take`."""
        found = self.crossings(decision)
        if found:
            with self._lock:
                room = PENDING_LIMIT - len(self.pending)
                self.pending += found[:room]
            if len(found) > room:
                self.forget(found[room:])  # reported by their subjects' next requests

    def take(self) -> list[Crossing]:
        """The crossings waiting to be written, handed over (and no longer waiting)."""
        with self._lock:
            taken, self.pending = self.pending, []
        return taken

    def crossings(self, decision: Decision) -> list[Crossing]:
        """The thresholds ``decision``'s quota checks are past that this process has not reported yet.

        A shadow quota's crossings are not reported: it enforces nothing, so it has nothing to warn of.
        """
        if not self.thresholds or decision.degraded or decision.local is not None:
            # A degraded decision's counts are not the store's; one answered from memory (a
            # remembered refusal, a lease) was timed by this worker's clock, which may place it in
            # another period than the store's would near a boundary: the next store call tells.
            return []
        found: list[Crossing] = []
        for result in decision.results:
            policy = result.check.policy
            if policy.role is not Role.QUOTA or policy.shadow:
                continue
            period = policy.billing_period
            if period is None:
                continue
            if result.allowed and not decision.allowed:
                continue  # refused by another limit: this request spent nothing of the quota
            # Admitted: what is spent with this request. Refused by the quota: what was spent
            # before it (all of it, unless the request cost more than was left).
            limit = policy.rate.limit
            used = limit - result.remaining
            passed = [t for t in self.thresholds if used * 100 >= t * limit]
            if passed:
                start_us, _ = counted_period(period.bounds(decision.now_us), decision.now_us)
                subject = result.check.subject
                found += self._new(subject.kind.value, subject.value, policy.name, passed, start_us, used, limit)
        return found

    def forget(self, crossings: Iterable[Crossing]) -> None:
        """Report ``crossings`` again when next seen: their rows could not be written."""
        # Forgotten, not put back: a crossing is reported with what was spent when it is next seen.
        with self._lock:
            for crossing in crossings:
                self._seen.discard(crossing.key)

    def _new(
        self, kind: str, ident: str, policy: str, passed: Iterable[int], start_us: int, used: int, limit: int
    ) -> list[Crossing]:
        new = []
        with self._lock:
            if len(self._seen) >= self.limit:
                self._seen.clear()
            for threshold in passed:
                crossing = Crossing(kind, ident, policy, threshold, start_us, used, limit)
                if crossing.key not in self._seen:
                    self._seen.add(crossing.key)
                    new.append(crossing)
        return new


def _build() -> ThresholdWatch | None:
    try:
        settings = conf.usage.notices
        thresholds = settings.quota_thresholds if settings.enabled else ()
    except ConfigurationError:
        # manage.py check names the setting; a request is never refused for how notices are set.
        return None
    return ThresholdWatch(thresholds) if thresholds else None


_watch: ProcessWide[ThresholdWatch | None] = ProcessWide(_build)


def threshold_watch() -> ThresholdWatch | None:
    """This process's watch; ``None`` with ``USAGE['NOTICES']`` off or no ``QUOTA_THRESHOLDS``."""
    return _watch.get()


def observe(decision: Decision) -> None:
    """Keep ``decision``'s new quota crossings for the writer (a consuming decision on a caller's checks)."""
    watch = _watch.get()
    if watch is not None:
        watch.observe(decision)
