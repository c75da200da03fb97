"""The local fast path: requests this worker can answer without the store, exactly.

Two kinds of answer are made here, never a guess:

- **Denials that nothing can end early.** A token bucket or a window that denies a request of
  cost ``c`` with a wait ``W`` cannot admit ``c`` before ``W`` has passed: other requests only
  spend, they never give back. So until then this worker refuses that check at that cost (or
  more) from memory, with the same 429, and ``Retry-After`` counted down from the store's wait.
  Slots (concurrency, the fleet's in-flight set) free early when requests finish: never cached.
- **Tokens leased from the store** in the decide call (:class:`Lease`), spent here until they run
  out or the lease ends.

A request is refused locally as soon as one of its checks has a live denial (a request the store
would admit is never refused: the property ``tests/test_local_path.py`` replays). Deadlines are
this process's monotonic clock from when the call was *sent*, before the store decided: never
later than the store's own. ``Retry-After`` counts from when the answer *arrived*: never sooner.

What is remembered is trusted only while the invalidation channel is live
(:mod:`ratelimits.backends.invalidation`), or while the store is down (nothing can be published
then, and memory is the best this worker knows of it). A policy change or an admin's reset
anywhere empties the memory of every process, this one at once. The memory is bounded:
``max_entries`` denials, the expired dropped first, then the oldest. docs/local-path.md has the
whole design, its bounds and its figures.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from django.utils import timezone

from ..algorithms import Algorithm
from ..backends import Backend
from ..backends.base import BulletinSupport, Grant, LeaseSupport
from ..backends.invalidation import RESET, Subscription
from ..conf import LocalPathSettings
from ..decisions import Decision, Result, Verdict
from ..identity import SubjectKind
from ..policies.snapshot import PolicySnapshot
from ..policies.source import get_policy_source
from ..policies.values import Check, Role
from .breaker import BreakerState, CircuitBreaker

__all__ = ["DENIAL", "LEASE", "LocalPath"]

US = 1_000_000
#: :attr:`Decision.local <ratelimits.decisions.Decision.local>` of a request refused from memory.
DENIAL = "denial"
#: ... and of a request admitted with tokens this worker leased.
LEASE = "lease"
#: The longest a denial is refused from memory before the store is asked again (seconds): a long
#: one (a day's quota) is measured on this worker's clock, which need not keep Redis' rate for a day.
MAX_DENIAL_S = 60.0
#: The fewest requests of one resolution a worker makes in a lease-length before it leases them, and
#: the fewest a lease pays for: fewer would mostly go back unspent, a call more, and the bookkeeping
#: of many small leases costs a worker more than the calls they save (``bench.hot_keys``' long tail).
LEASE_AFTER = 4
#: How long after the first of them ended the leases that ended go back, together (seconds): a
#: lease's unused tokens wait at most this long more, and a busy worker makes one call for many.
RETURN_BATCH_S = 0.1
#: The subjects every request presenting one credential on one endpoint has in common.
CREDENTIAL_BOUND = frozenset({SubjectKind.API_KEY, SubjectKind.USER, SubjectKind.ENDPOINT})


@dataclass(frozen=True, slots=True)
class Denial:
    """One check that cannot admit its cost (or more) before ``ends``: monotonic seconds."""

    check: Check
    #: Refused from memory until then: the send time plus the store's wait.
    ends: float
    #: What ``Retry-After`` counts down to: the arrival time plus the store's wait.
    advised: float
    #: When the store said the limit is whole again (arrival time plus its reset).
    reset: float
    remaining: int

    def longer_for(self, cost: int) -> float | None:
        """How much longer than this denial's a request costing ``cost`` waits (seconds); ``None``: not
        known without the store (a cheaper request may fit sooner; a sliding window's wait is not linear).
        """
        own = self.check.cost
        if cost == own:
            return 0.0
        policy = self.check.policy
        if cost < own or policy.algorithm is Algorithm.SLIDING_WINDOW:
            return None
        if policy.algorithm is Algorithm.TOKEN_BUCKET:  # each token more is one more emission interval
            return (cost - own) * policy.rate.interval_us / US
        return 0.0  # a fixed window: every cost that fits waits for the next window

    def result(self, check: Check, longer: float, now: float) -> Result:
        wait = max(math.ceil((self.advised + longer - now) * US), 1)
        return Result(check, False, self.remaining, max(math.ceil((self.reset - now) * US), wait), wait)


@dataclass(slots=True)
class Lease:
    """Tokens this worker took from a bucket beyond a request's cost, to spend until ``expires``."""

    grant: Grant
    #: Tokens left to spend.
    tokens: int
    #: Monotonic seconds: spent until then (from the send time of the call that took it).
    expires: float
    #: What the bucket held once the lease was taken, and when it would be whole again (monotonic).
    remaining: int
    reset: float
    #: Given back (or dropped): nothing more is spent from it, nor put back into it.
    closed: bool = False

    def result(self, check: Check, now: float) -> Result:
        # What this caller can still spend here: the bucket's remaining when the lease was taken
        # (other workers' leases counted as spent) and what is left of this worker's lease.
        return Result(check, True, self.remaining + self.tokens, max(math.ceil((self.reset - now) * US), 0), 0)


@dataclass(frozen=True, slots=True)
class EarlyDenial:
    """A credential's denial on one endpoint, as the pre-authentication middleware looks it up."""

    #: The state keys of the denials the credential's request met (none on its client address),
    #: and what that request cost under each.
    keys: tuple[str, ...]
    costs: tuple[int, ...]
    #: The policies the denials were made under: a reload of them (a new snapshot) ends it.
    snapshot: object
    #: Monotonic seconds: refused before authentication until then at the latest.
    ends: float
    #: Where the refusal is counted: the usage row the authenticated request was counted in ("":
    #: usage is not counted).
    usage_field: str
    tokens: int


@dataclass(slots=True)
class _Rate:
    """A resolution's requests in one lease-length window of this worker."""

    checks: tuple[Check, ...]
    #: This window's requests, and the window before's.
    seen: int
    before: int
    #: The most requests one lease of each check may pay for (0: not leased; -1: not known yet).
    most: int = -1
    #: The groups of checks (indices) the store decides in calls of their own besides the first
    #: group's (a Redis Cluster's slot groups) whose every check can be leased: each may be paid
    #: from leases instead of a call. ``None``: not known yet.
    apart: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class Spared:
    """Groups of a request's checks paid from leases, for a store that would ask each in a call of
    its own: the store decides the rest. Their results are the request's once the store admits it;
    if it refuses, the tokens go back into the leases."""

    #: The request's checks, and the indices of those paid here.
    checks: Sequence[Check]
    paid: tuple[int, ...]
    leases: tuple[Lease, ...]
    results: tuple[Result, ...]
    #: Memory's generation when they were paid (:attr:`LocalPath.generation`).
    generation: int


class LocalPath:
    """What this worker answers from memory, and what it remembers of the store's answers."""

    def __init__(
        self,
        backend: Backend,
        breaker: CircuitBreaker,
        settings: LocalPathSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        #: Monotonic seconds: what deadlines are measured in (a test may drive it).
        self.clock = clock
        self.breaker = breaker
        self.settings = settings
        self.prefix: str = getattr(backend, "prefix", "rl")
        self.max_entries = settings.max_entries
        #: State key -> its live denial.
        self._denials: dict[str, Denial] = {}
        #: (credential digest, endpoint, method) -> what the credential's requests there were refused by.
        self._early: dict[tuple[str, str, str], EarlyDenial] = {}
        self._lock = threading.Lock()
        #: State key -> the lease spent from now; and every lease not given back yet, by expiry.
        self._leases: dict[str, Lease] = {}
        self._expiring: deque[Lease] = deque()
        #: The ids of a request's checks -> the requests this worker made of them in this window and the
        #: one before, windows one lease long: the worker's rate per resolution, which leases follow.
        self._current: dict[tuple[int, ...], _Rate] = {}
        self._previous: dict[tuple[int, ...], _Rate] = {}
        #: State key -> how often this worker met it in a group the store decides in a call of its
        #: own (asked about it, or paid it from a lease), this window and the one before (on a store
        #: that makes several calls a decision only).
        self._keys_current: dict[str, int] = {}
        self._keys_previous: dict[str, int] = {}
        self._window_start = -math.inf
        #: The backend as it takes leases (``None``: it takes none, and nothing is leased here).
        self._leaser = backend if isinstance(backend, LeaseSupport) else None
        self._leasing = settings.leases and self._leaser is not None
        #: When the last credential entry's denials end (monotonic): after it, they are all dropped.
        self._early_ends = -math.inf
        #: Raised by every :meth:`forget`: a store answer to a call sent before it is not learned.
        self.generation = 0
        #: The newest policy version the channel announced.
        self._version = 0
        #: Local answers and the leases' bookkeeping, for the status page, the logs and the bench.
        self.counts: Counter[str] = Counter()
        #: Background work the listener's thread does every second (the limiter's usage flush).
        self.tick: Callable[[], None] | None = None
        self._subscription = self._subscribe(wait=True)
        after_fork = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: call_weakly(after_fork))

    # -- trust ---------------------------------------------------------------------------------

    def _subscribe(self, *, wait: bool) -> Subscription | None:
        """Hear the store's invalidations; ``None`` (memory is then never trusted) from a store with no channel."""
        if not isinstance(self.backend, BulletinSupport):
            return None
        return self.backend.subscribe(self.on_message, wait=wait, on_tick=self.on_tick)

    @property
    def idle(self) -> bool:
        """Whether memory has nothing to answer a decision with, nor to lease: no denial
        remembered, no lease held, leases off. Such a decision goes to the store as it is (the
        local path still learns its denials)."""
        return not (self._denials or self._leases or self._leasing)

    def trusted(self, store_down: bool = False) -> bool:
        """Whether memory may answer: the invalidation channel is live, or the store is down.

        While the store is down nothing can be published, and memory is the best this worker knows
        of it (``store_down``: a call just failed; else the breaker says so).
        """
        subscription = self._subscription
        if subscription is None or subscription.refused:
            return False  # no channel, or a store that refuses it: a reset elsewhere would go unheard
        return store_down or subscription.live or self.breaker.state is not BreakerState.CLOSED

    def on_message(self, message: bytes | None) -> None:
        """An invalidation: a reset somewhere, a new policy version, or a new subscription: forget everything.

        A version already announced (this process's own publication heard again on the channel,
        or a worker publishing a lagging stamp again) changes nothing.
        """
        version = parse_version(message)
        if version is not None:
            if version <= self._version:
                return
            self._version = version
        self.forget()
        if version is not None:
            get_policy_source().invalidate()  # reload before the next request, rather than after it

    def on_tick(self) -> None:
        tick = self.tick
        if tick is not None:
            tick()

    def forget(self) -> None:
        """Forget every denial and drop every lease (its tokens are not given back: the bucket may be new)."""
        with self._lock:
            self.generation += 1
            self._denials.clear()
            self._early.clear()
            self._leases.clear()
            for lease in self._expiring:
                lease.closed = True
                self.counts["tokens_dropped"] += lease.tokens
            self._expiring.clear()

    def _after_fork(self) -> None:
        """In a forked child (one thread, right after the fork): the parent's memory, leases (the parent
        spends those) and listener thread are not the child's. Start afresh, subscribing in the background.
        """
        self._denials, self._early, self._leases, self._current, self._previous = {}, {}, {}, {}, {}
        self._keys_current, self._keys_previous = {}, {}
        self._expiring, self.counts = deque(), Counter()
        self._lock = threading.Lock()
        self.generation += 1
        self._subscription = self._subscribe(wait=False)

    # -- leases --------------------------------------------------------------------------------

    def spend(self, checks: Sequence[Check]) -> tuple[Result, ...] | None:
        """Admit a request from live leases if one covers the cost of each of its checks: its results, or ``None``.

        All or nothing, as the store decides: a request some check of which no lease covers is
        the store's to decide, whole, and its leases are left as they are (spending them for the
        rest would take the request's tokens twice from buckets the store spends too, or need
        putting back should the store refuse).
        """
        leases = self._leases
        prefix = self.prefix
        # The common case first, before asking the channel: a request this worker holds no lease of.
        if not leases or not checks or checks[0].key(prefix) not in leases or not self.trusted():
            return None
        now = self.clock()
        with self._lock:
            covered = self._take(checks, now)
            if covered is None:
                return None
            self.counts["lease_hits"] += 1
        self._counted(checks)  # a lease's requests count in the worker's rate as others do
        return tuple(lease.result(check, now) for lease, check in zip(covered, checks, strict=True))

    def _take(self, checks: Sequence[Check], now: float) -> list[Lease] | None:
        """Spend each of ``checks``' cost from its live lease, under the lock: the leases spent, in
        their order, or ``None`` and nothing spent if one cannot pay.

        Each is taken at once, so two checks of one key (one bucket named twice) spend one lease.
        """
        leases, prefix = self._leases, self.prefix
        covered: list[Lease] = []
        for check in checks:
            lease = leases.get(check.key(prefix))
            if (
                lease is None
                or lease.expires <= now
                or lease.tokens < check.cost
                or not (lease.grant.check.policy is check.policy or lease.grant.check.policy == check.policy)
            ):
                for spent, paid in zip(covered, checks, strict=False):
                    spent.tokens += paid.cost  # put back: all are paid, or none
                return None
            lease.tokens -= check.cost
            covered.append(lease)
        return covered

    def with_leases(self, decision: Decision) -> Decision:
        """``decision`` (consuming nothing) with this worker's unspent lease tokens in what is remaining.

        So ``/rate_limit`` and the admin say what a lease's responses say: the store's remaining
        (other workers' leases counted as spent) and what is left of this worker's lease.
        """
        leases = self._leases
        if not leases:
            return decision
        now = self.clock()
        prefix = self.prefix
        results = list(decision.results)
        for i, result in enumerate(results):
            lease = leases.get(result.check.key(prefix))
            if lease is not None and not lease.closed and lease.expires > now and lease.tokens > 0:
                remaining = min(result.remaining + lease.tokens, result.check.policy.capacity)
                results[i] = result._replace(remaining=remaining)
        return replace(decision, results=tuple(results))

    def _counted(self, checks: Sequence[Check]) -> _Rate | None:
        """Count a consuming request of ``checks`` in this worker's rate, which leases follow; its count.

        Counted per resolution (the request's checks, as the policy snapshot keeps them: the same
        objects for every request that resolves alike), one lease-length at a time; this window
        and the one before are kept. ``None``: not counted (more resolutions than ``max_entries``
        came this window).
        """
        now = self.clock()
        ttl = self.settings.lease_ttl
        if now - self._window_start >= ttl:
            with self._lock:  # once per window: two threads must not both start one
                start = self._window_start
                if now - start >= ttl:
                    # The window before is kept (one step per window, not per resolution), an older one dropped.
                    fresh = now - start < 2 * ttl
                    self._previous = self._current if fresh else {}
                    self._current = {}
                    if self._keys_current or self._keys_previous:
                        self._keys_previous = self._keys_current if fresh else {}
                        self._keys_current = {}
                    self._window_start = now
        # Counted without the lock, on the request path: a count two threads race on may lose one,
        # which only sizes a lease a little smaller. The ids of the checks are the key: each entry
        # holds its checks (a copy: a caller's list may change), so no other object takes their ids.
        key = tuple(map(id, checks))
        current = self._current
        rate = current.get(key)
        if rate is not None:
            rate.seen += 1
            return rate
        if len(current) >= self.max_entries:
            return None  # bounded: a new resolution beyond it is not counted this window
        before = self._previous.get(key)
        if before is not None:
            rate = current[key] = _Rate(before.checks, 1, before.seen, before.most, before.apart)
        else:
            rate = current[key] = _Rate(tuple(checks), 1, 0)
        return rate

    def ask(self, checks: Sequence[Check]) -> tuple[Sequence[Check], list[int] | None, Spared | None]:
        """What to ask the store of a request no lease answers whole: its checks, how many tokens to
        lease of each (:meth:`wants`), and the groups of them paid from leases instead (``Spared``).

        Only on a store that decides a request in several calls (a Redis Cluster's slot groups):
        a group apart from the first (the caller's own, which counts usage) whose every check a live
        lease covers is paid here, and the store asked about the rest, one call fewer. A group this
        worker asks about at least ``LEASE_AFTER`` times in a lease-length (an organisation's, an
        endpoint's, shared by many callers) is leased in the call, whatever the request's own rate.
        """
        rate = self._counted_for_leases(checks)
        if rate is None:
            return checks, None, None
        wants = self._wants(checks, rate)
        apart = rate.apart
        if apart is None:
            apart = rate.apart = self._apart(checks) if len(checks) > 1 else ()
        if not apart or not self.trusted():
            return checks, wants, None
        spared = self._spare(checks, apart)
        paid = spared.paid if spared is not None else ()
        wants = self._shared_wants(checks, apart, paid, wants)
        if spared is None:
            return checks, wants, None
        asked = [i for i in range(len(checks)) if i not in paid]
        subset = [checks[i] for i in asked]
        sliced = [wants[i] for i in asked] if wants is not None else None
        return subset, sliced if sliced is not None and any(sliced) else None, spared

    def _apart(self, checks: Sequence[Check]) -> tuple[tuple[int, ...], ...]:
        """The groups of ``checks`` the store decides apart from the first, each of checks that can be leased."""
        groups = self._leaser.call_groups(checks) if self._leaser is not None else None
        if not groups:
            return ()
        return tuple(tuple(group) for group in groups[1:] if all(_leasable(checks[i]) for i in group))

    def _spare(self, checks: Sequence[Check], apart: tuple[tuple[int, ...], ...]) -> Spared | None:
        """Pay each group of ``apart`` that live leases cover whole from them: ``None`` if none is."""
        if not self._leases:
            return None
        now = self.clock()
        paid: list[int] = []
        taken: list[Lease] = []
        with self._lock:
            for group in apart:
                covered = self._take([checks[i] for i in group], now)
                if covered is not None:
                    paid += group
                    taken += covered
            if not paid:
                return None
            self.counts["groups_spared"] += 1
            generation = self.generation
        results = tuple(lease.result(checks[i], now) for lease, i in zip(taken, paid, strict=True))
        return Spared(checks, tuple(paid), tuple(taken), results, generation)

    def _shared_wants(
        self,
        checks: Sequence[Check],
        apart: tuple[tuple[int, ...], ...],
        paid: tuple[int, ...],
        wants: list[int] | None,
    ) -> list[int] | None:
        """``wants`` with a lease for each group of ``apart`` asked about often enough (and not paid here).

        Counted per state key, not per request: a shared bucket (an organisation's, an endpoint's)
        is met by many resolutions, each of which may be rare. A group is leased for as many of its
        requests as the least asked of its checks saw in a lease-length, at most what ``lease_share``
        of each check's capacity pays for (bounded by what the bucket holds: the store grants no more).
        """
        counts, before = self._keys_current, self._keys_previous
        leases, prefix = self._leases, self.prefix
        share = self.settings.lease_share
        now = self.clock()
        for group in apart:
            seen = -1
            for i in group:
                key = checks[i].key(prefix)
                n = counts.get(key)
                if n is None:
                    if len(counts) >= self.max_entries:
                        continue  # bounded: a new key beyond it is not counted this window
                    n = 0
                n = counts[key] = n + 1
                n = max(n, before.get(key, 0))
                seen = n if seen < 0 else min(seen, n)
            if seen < LEASE_AFTER or group[0] in paid:
                continue  # rare, or paid from leases (not in the call)
            for i in group:
                check = checks[i]
                lease = leases.get(check.key(prefix))
                if lease is not None and lease.expires > now and lease.tokens >= check.cost:
                    continue  # still pays for this group's next request
                requests = min(seen, int(check.policy.capacity * share) // check.cost)
                if requests >= LEASE_AFTER:
                    if wants is None:
                        wants = [0] * len(checks)
                    wants[i] = max(wants[i], requests * check.cost)
        return wants

    def settle(self, spared: Spared, decision: Decision) -> Decision:
        """The store's ``decision`` on the rest of a request ``spared`` paid part of: the whole request's.

        Admitted (by the store, or by the fail modes while it cannot answer), the leases' tokens
        stay spent; refused, they go back into the leases. The results are the store's and the
        leases', in the request's order where the store's answer covers every check it was asked
        about; a decision made without the store (a fail mode's, a denial from memory) may report
        fewer checks, and the leases' results follow it.
        """
        if not decision.allowed:
            self.put_back(spared)
        paid = spared.paid
        asked = len(spared.checks) - len(paid)
        if len(decision.results) != asked:
            return replace(decision, results=(*decision.results, *spared.results))
        results: list[Result] = []
        answered = iter(decision.results)
        spent = iter(spared.results)
        for i in range(len(spared.checks)):
            results.append(next(spent) if i in paid else next(answered))
        return replace(decision, results=tuple(results))

    def put_back(self, spared: Spared) -> None:
        """The tokens ``spared`` paid, back into their leases: the request was refused, or never decided.

        A lease closed meanwhile (it ended, and went back or is going back) gets them back as a
        lease of their own that has ended: they go back to the bucket with the next ended leases.
        Not if memory was emptied since (a policy change, a reset): the bucket may be new.
        """
        with self._lock:
            for lease, i in zip(spared.leases, spared.paid, strict=True):
                cost = spared.checks[i].cost
                if not lease.closed:
                    lease.tokens += cost
                elif spared.generation != self.generation:
                    self.counts["tokens_dropped"] += cost
                else:
                    # At the front: ended now, no later than any lease still to end.
                    self._expiring.appendleft(Lease(lease.grant, cost, self.clock(), lease.remaining, lease.reset))

    def wants(self, checks: Sequence[Check]) -> list[int] | None:
        """Count this request; how many tokens to lease of each of ``checks`` in its store call (``None``: none).

        A request this worker made at least ``LEASE_AFTER`` times in the last lease-length (or in
        this one, so far), every check of which can be leased, is leased as many of its requests
        as it made there, at most as many as ``lease_share`` of its least roomy check's capacity
        pays for: each check that many times its cost, so that its leases run out together, with
        the request's next call. Not a check whose live lease can still pay for the request
        (another request sent it here). A rarer request is not worth it: its lease would go back mostly
        unspent, one more call, and the bookkeeping would cost more than it saves.
        """
        rate = self._counted_for_leases(checks)
        return None if rate is None else self._wants(checks, rate)

    def _counted_for_leases(self, checks: Sequence[Check]) -> _Rate | None:
        """:meth:`_counted`, where a lease could ever be spent; ``None`` where none could, or not counted."""
        subscription = self._subscription
        if not self._leasing or subscription is None or subscription.refused:
            return None  # no lease could ever be spent: not worth counting for
        return self._counted(checks)

    def _wants(self, checks: Sequence[Check], rate: _Rate) -> list[int] | None:
        """:meth:`wants` of a request counted in ``rate``."""
        seen = max(rate.seen, rate.before)
        if seen < LEASE_AFTER:
            return None
        most = rate.most
        if most < 0:
            most = rate.most = self._requests_per_lease(checks)
        requests = min(seen, most)
        if requests < LEASE_AFTER or not self.trusted():
            return None  # a lease nobody may spend would only keep its tokens from everyone
        now = self.clock()
        leases, prefix = self._leases, self.prefix
        wants = [0] * len(checks)
        for i, check in enumerate(checks):
            lease = leases.get(check.key(prefix))
            # A lease that can still pay for this request is left to be spent (a lease replaced goes
            # back only when it ends: what it holds meanwhile is kept from everyone, so no more than
            # less than one request's cost is ever left in one).
            if lease is None or lease.expires <= now or lease.tokens < check.cost:
                wants[i] = requests * check.cost
        return wants if any(wants) else None

    def _requests_per_lease(self, checks: Sequence[Check]) -> int:
        """The most requests of ``checks`` one lease of each may pay for: ``lease_share`` of the
        least roomy check's capacity, in its costs; 0 if one of them cannot be leased."""
        most = None
        share = self.settings.lease_share
        for check in checks:
            if not _leasable(check):
                return 0
            requests = int(check.policy.capacity * share) // check.cost
            if most is None or requests < most:
                most = requests
        return most or 0

    def install(self, decision: Decision, grants: Sequence[Grant], sent: float, generation: int) -> Decision:
        """Keep the leases a store call granted; ``decision`` with their tokens in what is remaining.

        Not if memory was emptied since the call was sent (``generation``): they were taken under
        policies (or from a bucket) that may be gone. Their tokens are lost to this worker.
        """
        if not grants:
            return decision
        arrived = self.clock()
        ttl = self.settings.lease_ttl
        prefix = self.prefix
        results = list(decision.results)
        pending = iter(grants)  # in the order of the checks, as the results are
        grant: Grant | None = next(pending)
        with self._lock:
            # Under the lock: a forget() on the listener's thread between a check and the lock would
            # leave leases of a bucket reset meanwhile to be spent against the new one.
            if generation != self.generation:
                self.counts["tokens_dropped"] += sum(grant.tokens for grant in grants)
                return decision
            for i, result in enumerate(results):
                if grant is None or grant.check is not result.check:
                    continue
                expires = sent + ttl
                if result.check.policy.algorithm is Algorithm.FIXED_WINDOW:
                    # A window's tokens are spent in it: the lease ends with the window at the latest.
                    expires = min(expires, sent + result.reset_us / US)
                lease = Lease(grant, grant.tokens, expires, result.remaining, arrived + result.reset_us / US)
                self._leases[result.check.key(prefix)] = lease  # one that is still live goes back as it expires
                self._expiring.append(lease)
                self.counts["leases"] += 1
                self.counts["tokens_leased"] += grant.tokens
                results[i] = lease.result(result.check, arrived)
                grant = next(pending, None)
        return replace(decision, results=tuple(results))

    def expired(self) -> list[tuple[Grant, int]]:
        """Close the leases that have run out; their grants and unused tokens, to give back.

        Once the first of them has been over for ``RETURN_BATCH_S``: the leases that end within
        that long of each other go back in one call, not one call each.
        """
        if not self._expiring:
            return []
        now = self.clock()
        unused = []
        with self._lock:
            expiring = self._expiring  # another thread may have emptied it meanwhile, or forget() cleared it
            if not expiring or expiring[0].expires > now - RETURN_BATCH_S:
                return []
            while expiring and expiring[0].expires <= now:
                lease = expiring.popleft()
                lease.closed = True
                key = lease.grant.check.key(self.prefix)
                if self._leases.get(key) is lease:
                    del self._leases[key]
                if lease.tokens > 0:
                    unused.append((lease.grant, lease.tokens))
        return unused

    def returned(self, unused: Sequence[tuple[Grant, int]]) -> None:
        """Tokens of ``unused`` went back to their buckets: a denial remembered of them may end sooner now."""
        prefix = self.prefix
        with self._lock:
            for grant, _ in unused:
                self._denials.pop(grant.check.key(prefix), None)
            self.counts["tokens_returned"] += sum(n for _, n in unused)

    # -- denials -------------------------------------------------------------------------------

    def refuse(self, checks: Sequence[Check], *, store_down: bool = False) -> Decision | None:
        """The 429 for ``checks`` if one of them has a live denial at its cost; else ``None``."""
        denials = self._denials
        if not denials:
            return None
        now = self.clock()
        met = None
        prefix = self.prefix
        for check in checks:
            denial = denials.get(check.key(prefix))
            if denial is None or denial.ends <= now:
                continue
            policy = denial.check.policy
            if policy is not check.policy and policy != check.policy:
                continue  # remembered under policies that have changed since
            longer = denial.longer_for(check.cost)
            if longer is None:
                continue
            if met is None:
                met = [(denial, check, longer)]
            else:
                met.append((denial, check, longer))
        if met is None or not self.trusted(store_down):
            return None
        return self._refusal(met, now)

    def _refusal(self, met: Sequence[tuple[Denial, Check, float]], now: float) -> Decision:
        results = [denial.result(check, longer, now) for denial, check, longer in met]
        with self._lock:
            self.counts["denial_hits"] += 1
        return Decision(
            Verdict.LIMITED,
            tuple(results),
            max(r.retry_us for r in results),
            time.time_ns() // 1000,
            local=DENIAL,
        )

    def learn(self, decision: Decision, sent: float, generation: int) -> None:
        """Remember the denials of ``decision``, a consuming answer of the store to a call sent at ``sent``.

        An admitted request spent from its checks: a denial remembered of one of them (at a higher
        cost) now ends later than remembered, so it is forgotten, to be learned again exactly.
        """
        if decision.verdict is not Verdict.LIMITED or decision.degraded:
            if self._denials and decision.allowed:
                prefix = self.prefix
                with self._lock:
                    for result in decision.results:
                        self._denials.pop(result.check.key(prefix), None)
            return
        if generation != self.generation or not self.settings.denials:
            return  # memory was emptied since the call was sent: its answer may be stale already
        arrived = self.clock()
        prefix = self.prefix
        for result in decision.violated:
            check = result.check
            if check.policy.holds_slots or check.policy.is_global:
                # Slots free when requests finish, and a global policy's region may be given a
                # bigger share by the next reconciliation: a denial of either can end early.
                continue
            wait = result.retry_us / US
            ends = sent + min(wait, MAX_DENIAL_S)
            denial = Denial(check, ends, arrived + wait, arrived + result.reset_us / US, result.remaining)
            self._remember(check.key(prefix), denial, arrived, generation)

    def _remember(self, key: str, denial: Denial, now: float, generation: int) -> None:
        with self._lock:
            if generation != self.generation:
                return  # emptied since the call was sent (a forget() on the listener's thread)
            denials = self._denials
            if key not in denials and len(denials) >= self.max_entries:
                expired = [k for k, d in denials.items() if d.ends <= now]
                # Expired first; if few have, the oldest tenth (a dict keeps insertion order).
                for k in (
                    expired
                    if len(expired) * 10 >= self.max_entries
                    else list(denials)[: max(self.max_entries // 10, 1)]
                ):
                    del denials[k]
                early = self._early
                for request in [r for r, e in early.items() if not all(k in denials for k in e.keys)]:
                    del early[request]
            denials[key] = denial

    # -- before authentication -----------------------------------------------------------------

    @property
    def refuses_credentials(self) -> bool:
        """Whether any credential is remembered as refused (the pre-authentication check's shortcut)."""
        if not self._early:
            return False
        if self.clock() < self._early_ends:
            return True
        with self._lock:
            self._early.clear()  # every one of their denials has ended
        return False

    def note_credential(
        self,
        credential: str,
        endpoint: str,
        method: str,
        decision: Decision,
        *,
        snapshot: object,
        generation: int,
        usage_field: str,
        tokens: int,
    ) -> None:
        """Remember that the request presenting ``credential`` (its digest) was refused by ``decision``.

        Only denials every request presenting it there meets count: its API key's, its user's and
        the endpoint's, not its client address's or organisation's, which another request with the
        same credential need not share, nor a sharded budget's (the next request may meet another
        shard). Remembered until the denials end, or until an assignment or override starts or ends
        (that may change the checks without a new snapshot), whichever is first; and not at all if
        memory was emptied since the request was decided (``generation``).
        """
        if generation != self.generation:
            return
        prefix = self.prefix
        met = [
            (r.check.key(prefix), r.check.cost)
            for r in decision.violated
            if not r.check.policy.holds_slots
            and not r.check.policy.is_shard
            and r.check.subject.kind in CREDENTIAL_BOUND
        ]
        denials = [self._denials.get(key) for key, _ in met]
        if not met or any(d is None for d in denials):
            return
        keys, costs = zip(*met, strict=True)
        ends = max(d.ends for d in denials if d is not None)
        change = snapshot.next_change(timezone.now()) if isinstance(snapshot, PolicySnapshot) else None
        if change is not None:
            ends = min(ends, self.clock() + (change - timezone.now()).total_seconds())
        early = EarlyDenial(keys, costs, snapshot, ends, usage_field, tokens)
        with self._lock:
            if len(self._early) >= self.max_entries:
                self._early.clear()  # rebuilt by the next refusals; each costs one authenticated request
            self._early[(credential, endpoint, method)] = early
            self._early_ends = max(self._early_ends, ends)

    def refuse_credential(self, credential: str, endpoint: str, method: str) -> tuple[Decision, EarlyDenial] | None:
        """The 429 for a request presenting ``credential`` on ``endpoint``, if it is remembered as refused there."""
        if not self._early:
            return None
        early = self._early.get((credential, endpoint, method))
        if early is None or early.snapshot is not get_policy_source().snapshot():
            return None
        now = self.clock()
        if early.ends <= now:
            return None
        live = []
        for key, cost in zip(early.keys, early.costs, strict=True):
            denial = self._denials.get(key)
            if denial is None or denial.ends <= now:
                continue
            longer = denial.longer_for(cost)  # the denial may have been learned at another cost since
            if longer is not None:
                live.append((denial, denial.check, longer))
        if not live or not self.trusted():
            return None
        return self._refusal(live, now), early


def _leasable(check: Check) -> bool:
    """Whether a lease may pay for ``check``.

    Only a bucket's tokens are leased, or a fixed window's (spent within the window): not a sliding
    window's, whose count weighs on the next window too, nor a slot (counted live). Nor the
    failed-authentication limit's: it must let exactly its burst of failures through, fleet-wide.
    Nor a soft quota's, whose count past its limit is the overage billed.
    Nor a global policy's: its region's share changes under it (docs/regions.md). Nor a shadow
    policy's, which never spends.
    """
    policy = check.policy
    algorithm = policy.algorithm
    return (
        (algorithm is Algorithm.TOKEN_BUCKET or algorithm is Algorithm.FIXED_WINDOW)
        and not policy.shadow
        and not policy.soft
        and policy.role is not Role.FAILED_AUTH
        and not policy.is_global
    )


def parse_version(message: bytes | None) -> int | None:
    """The policy version a channel message announces; ``None`` for a reset, a (re)subscription or junk."""
    if message is None or message == RESET or not message.startswith(b"v"):
        return None
    try:
        return int(message[1:])
    except ValueError:
        return None


def call_weakly(method: weakref.WeakMethod[Callable[..., None]]) -> None:
    """Call a weakly held method if its object is still alive (fork hooks outlive limiters)."""
    bound = method()
    if bound is not None:
        bound()
