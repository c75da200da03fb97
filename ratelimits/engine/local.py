"""The local fast path: requests this worker can answer without the store, exactly.

Two kinds of answer are made here, never a guess:

- **Denials that nothing can end early.** A token bucket or a window that denies a request of
  cost ``c`` with a wait ``W`` cannot admit ``c`` before ``W`` has passed: other requests only
  spend, they never give back. So until then this worker refuses that check at that cost (or
  more) from memory, with the same 429, and ``Retry-After`` counted down from the store's wait.
  Slots (concurrency, the fleet's in-flight set) free early when requests finish: never cached.
- **Tokens leased from the store** (:mod:`.leases`), spent here until they run out or expire.

A request is refused locally as soon as one of its checks has a live denial (a request the store
would admit is never refused: the property ``tests/test_local_path.py`` replays). Deadlines are
this process's monotonic clock from when the call was *sent*, before the store decided: never
later than the store's own. ``Retry-After`` counts from when the answer *arrived*: never sooner.

What is remembered is trusted only while the invalidation channel is live
(:mod:`ratelimits.backends.invalidation`), or while the store is down (nothing can be published
then, and the breaker keeps the store's wait honoured). A policy change or an admin's reset
anywhere empties the memory of every process, this one at once. The memory is bounded:
:attr:`LocalPath.max_entries` denials, the expired dropped first, then the oldest.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..backends import Backend
from ..backends.invalidation import RESET
from ..conf import LocalPathSettings
from ..decisions import Decision, Result, Verdict
from ..identity import SubjectKind
from ..policies.source import get_policy_source
from ..policies.values import Check
from .breaker import BreakerState, CircuitBreaker

__all__ = ["DENIAL", "LocalPath"]

US = 1_000_000
#: :attr:`Decision.local <ratelimits.decisions.Decision.local>` of a request refused from memory.
DENIAL = "denial"
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

    def result(self, now: float) -> Result:
        wait = max(math.ceil((self.advised - now) * US), 1)
        return Result(self.check, False, self.remaining, max(math.ceil((self.reset - now) * US), wait), wait)


@dataclass(frozen=True, slots=True)
class EarlyDenial:
    """A credential's denial on one endpoint, as the pre-authentication middleware looks it up."""

    #: The state keys of the denials the credential's request met (none on its client address).
    keys: tuple[str, ...]
    #: The policies the denials were made under: a reload of them (a new snapshot) ends it.
    snapshot: object
    #: Where the refusal is counted: the usage row the authenticated request was counted in.
    usage_field: str
    tokens: int


class LocalPath:
    """What this worker answers from memory, and what it remembers of the store's answers."""

    def __init__(self, backend: Backend, breaker: CircuitBreaker, settings: LocalPathSettings) -> None:
        self.backend = backend
        self.breaker = breaker
        self.settings = settings
        self.prefix: str = getattr(backend, "prefix", "rl")
        self.max_entries = settings.max_entries
        #: State key -> its live denial.
        self._denials: dict[str, Denial] = {}
        #: (credential digest, endpoint, method) -> what the credential's requests there were refused by.
        self._early: dict[tuple[str, str, str], EarlyDenial] = {}
        self._lock = threading.Lock()
        #: Local answers and the leases' bookkeeping, for the status page, the logs and the bench.
        self.counts: Counter[str] = Counter()
        self._pid = os.getpid()
        self._subscription = backend.subscribe(self.on_message)

    # -- trust ---------------------------------------------------------------------------------

    def trusted(self, store_down: bool = False) -> bool:
        """Whether memory may answer: the invalidation channel is live, or the store is down.

        While the store is down nothing can be published, and memory is the best this worker knows
        of it (``store_down``: a call just failed; else the breaker says so).
        """
        if self._pid != os.getpid():
            self._after_fork()
            return False
        subscription = self._subscription
        if subscription is None:
            return False
        return store_down or subscription.live or self.breaker.state is not BreakerState.CLOSED

    def on_message(self, message: bytes | None) -> None:
        """An invalidation: a policy change or a reset somewhere (or a new subscription): forget everything."""
        self.forget()
        if message is not None and message != RESET:
            # A new policy version: reload before the next request, rather than after it.
            get_policy_source().invalidate()

    def forget(self) -> None:
        with self._lock:
            self._denials.clear()
            self._early.clear()

    def _after_fork(self) -> None:
        # A forked child has the parent's memory but not its listener thread: start afresh.
        self._pid = os.getpid()
        self._denials, self._early, self.counts = {}, {}, Counter()
        self._lock = threading.Lock()
        self._subscription = self.backend.subscribe(self.on_message)

    # -- denials -------------------------------------------------------------------------------

    def refuse(self, checks: Sequence[Check], *, store_down: bool = False) -> Decision | None:
        """The 429 for ``checks`` if one of them has a live denial at its cost; else ``None``."""
        denials = self._denials
        if not denials:
            return None
        now = time.monotonic()
        met = None
        prefix = self.prefix
        for check in checks:
            denial = denials.get(check.key(prefix))
            if denial is None or denial.ends <= now or check.cost < denial.check.cost:
                continue
            policy = denial.check.policy
            if policy is not check.policy and policy != check.policy:
                continue  # remembered under policies that have changed since
            if met is None:
                met = [denial]
            else:
                met.append(denial)
        if met is None or not self.trusted(store_down):
            return None
        return self._refusal(met, now)

    def _refusal(self, met: Sequence[Denial], now: float) -> Decision:
        results = [denial.result(now) for denial in met]
        with self._lock:
            self.counts["denial_hits"] += 1
        return Decision(
            Verdict.LIMITED,
            tuple(results),
            max(r.retry_us for r in results),
            time.time_ns() // 1000,
            local=DENIAL,
        )

    def learn(self, decision: Decision, sent: float) -> None:
        """Remember the denials of ``decision``, a consuming answer of the store to a call sent at ``sent``."""
        if decision.verdict is not Verdict.LIMITED or decision.degraded:
            return
        arrived = time.monotonic()
        prefix = self.prefix
        for result in decision.violated:
            check = result.check
            if check.policy.holds_slots:
                continue  # slots free when requests finish: a denial of them can end early
            wait = result.retry_us / US
            denial = Denial(check, sent + wait, arrived + wait, arrived + result.reset_us / US, result.remaining)
            self._remember(check.key(prefix), denial, arrived)

    def _remember(self, key: str, denial: Denial, now: float) -> None:
        with self._lock:
            denials = self._denials
            if key not in denials and len(denials) >= self.max_entries:
                expired = [k for k, d in denials.items() if d.ends <= now]
                # Expired first; if few have, the oldest tenth (a dict keeps insertion order).
                for k in expired if len(expired) * 10 >= self.max_entries else list(denials)[: self.max_entries // 10]:
                    del denials[k]
                early = self._early
                for request in [r for r, e in early.items() if not all(k in denials for k in e.keys)]:
                    del early[request]
            denials[key] = denial

    # -- before authentication -----------------------------------------------------------------

    @property
    def refuses_credentials(self) -> bool:
        """Whether any credential is remembered as refused (the pre-authentication check's shortcut)."""
        return bool(self._early)

    def note_credential(
        self, credential: str, endpoint: str, method: str, decision: Decision, usage_field: str, tokens: int
    ) -> None:
        """Remember that the request presenting ``credential`` (its digest) was refused by ``decision``.

        Only denials every request presenting it there meets count: its API key's, its user's and
        the endpoint's, not its client address's or organisation's, which another request with the
        same credential need not share.
        """
        prefix = self.prefix
        keys = tuple(
            r.check.key(prefix)
            for r in decision.violated
            if not r.check.policy.holds_slots and r.check.subject.kind in CREDENTIAL_BOUND
        )
        if not keys or not all(key in self._denials for key in keys):
            return
        early = EarlyDenial(keys, get_policy_source().snapshot(), usage_field, tokens)
        with self._lock:
            if len(self._early) >= self.max_entries:
                self._early.clear()  # rebuilt by the next refusals; each costs one authenticated request
            self._early[(credential, endpoint, method)] = early

    def refuse_credential(self, credential: str, endpoint: str, method: str) -> tuple[Decision, EarlyDenial] | None:
        """The 429 for a request presenting ``credential`` on ``endpoint``, if it is remembered as refused there."""
        if not self._early:
            return None
        early = self._early.get((credential, endpoint, method))
        if early is None or early.snapshot is not get_policy_source().snapshot():
            return None
        now = time.monotonic()
        met = [self._denials.get(key) for key in early.keys]
        live = [d for d in met if d is not None and d.ends > now]
        if not live or not self.trusted():
            return None
        return self._refusal(live, now), early
