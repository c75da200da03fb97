"""The decision: evaluate a request's checks in one backend call, with fail modes and a breaker."""

from __future__ import annotations

import contextvars
import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from django.utils.module_loading import import_string

from .algorithms import SLOT_RETRY_US, Algorithm
from .breaker import CircuitBreaker
from .conf import conf
from .exceptions import BackendUnavailable
from .identity import Identity, identify
from .policies import Check, PolicySource
from .shedding import WorkerShedder
from .usage import Usage, usage_for

if TYPE_CHECKING:
    from django.http import HttpRequest

    from .backends.base import Backend

__all__ = ["Decision", "Limiter", "Result", "Verdict", "evaluate", "get_limiter", "get_policy_source"]

logger = logging.getLogger("ratelimits")


class Verdict(StrEnum):
    """What happens to the request."""

    ALLOW = "allow"
    #: 429: the caller is over one of its limits.
    LIMITED = "limited"
    #: 503: the limiter cannot decide and a policy says to fail closed.
    UNAVAILABLE = "unavailable"
    #: 503: the fleet (or this worker) is too busy for this request's priority class.
    SHED = "shed"


@dataclass(frozen=True, slots=True)
class Result:
    """One check's part of a decision."""

    check: Check
    allowed: bool
    remaining: int
    reset_us: int
    retry_us: int

    @property
    def policy_name(self) -> str:
        return self.check.policy.name

    @property
    def limit(self) -> int:
        return self.check.policy.capacity

    @property
    def used(self) -> int:
        return max(self.limit - self.remaining, 0)


@dataclass(frozen=True, slots=True)
class Decision:
    """Everything decided about one request, as returned by a single backend call."""

    verdict: Verdict
    results: tuple[Result, ...]
    #: Exact wait before a retry can succeed, in microseconds; 0 when allowed.
    retry_after_us: int = 0
    #: The store's clock when it decided, in microseconds since the epoch.
    now_us: int = 0
    #: True when the store could not be reached and a fail mode decided instead.
    degraded: bool = False
    policy_version: str | None = None
    #: The slot this request holds (concurrency, fleet) and the keys it is held under, to be
    #: released when the response has left the worker. Empty unless admitted and consumed.
    slot: str | None = None
    slot_keys: tuple[str, ...] = ()
    #: A slot the store may have taken although it never answered (it timed out): released in
    #: the store when the request finishes, whatever the decision was.
    stray_slot: tuple[str, tuple[str, ...]] | None = None

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW

    @property
    def retry_after_ms(self) -> int:
        return math.ceil(self.retry_after_us / 1000)

    @property
    def violated(self) -> tuple[Result, ...]:
        """Enforced checks that deny this request."""
        return tuple(r for r in self.results if not r.allowed and not r.check.policy.shadow)

    @property
    def shadow_violated(self) -> tuple[Result, ...]:
        """Shadow checks that would have denied this request had they been enforced."""
        return tuple(r for r in self.results if not r.allowed and r.check.policy.shadow)

    @property
    def closest(self) -> Result | None:
        """The result to describe in headers: the violated one with the longest wait, else the
        rate policy with the smallest share of its limit left.

        The fleet's in-flight count is the platform's, not the caller's: it is never described.
        Slots are described when they deny; otherwise one request in flight would make a small
        concurrency limit look "closest" on every response and hide the rate quota.
        """
        violated = [r for r in self.violated if r.check.policy.algorithm is not Algorithm.FLEET]
        if violated:
            return max(violated, key=lambda r: r.retry_us)
        candidates = [r for r in self.results if not r.check.policy.shadow and not r.check.policy.holds_slots]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.remaining / r.limit, r.reset_us))

    @classmethod
    def from_results(
        cls,
        results: Sequence[Result],
        *,
        now_us: int,
        policy_version: str | None = None,
        degraded: bool = False,
        slot: str | None = None,
        slot_keys: tuple[str, ...] = (),
    ) -> Decision:
        """Combine per-check results: allowed only if every enforced check allows; the wait is the longest.

        A request over one of its own limits is LIMITED (429) even if the fleet is busy too; one
        denied only by the fleet's in-flight limit is SHED (503).
        """
        denied = [r for r in results if not r.allowed and not r.check.policy.shadow]
        if not denied:
            verdict = Verdict.ALLOW
        elif all(r.check.policy.algorithm is Algorithm.FLEET for r in denied):
            verdict = Verdict.SHED
        else:
            verdict = Verdict.LIMITED
        held = verdict is Verdict.ALLOW and slot is not None
        return cls(
            verdict=verdict,
            results=tuple(results),
            retry_after_us=max((r.retry_us for r in denied), default=0),
            now_us=now_us,
            degraded=degraded,
            policy_version=policy_version,
            slot=slot if held else None,
            slot_keys=slot_keys if held else (),
        )


class Limiter:
    """A backend behind a circuit breaker, with per-policy fail modes when it cannot answer."""

    def __init__(self, backend: Backend, breaker: CircuitBreaker, *, local: Backend, local_share: float) -> None:
        self.backend = backend
        self.breaker = breaker
        self.local = local
        self.local_share = local_share
        self.degraded_count = 0
        self._count_lock = threading.Lock()
        #: Usage of degraded decisions, per (minute, field), waiting for the store to come back.
        self._degraded_usage: Counter[tuple[int, str]] = Counter()
        #: Releases that could not reach the store, oldest first; bounded, since slots expire anyway.
        self._unreleased: deque[tuple[Backend, str, tuple[str, ...]]] = deque(maxlen=10_000)

    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        """Decide ``checks`` in one backend round trip; degrade by fail mode if that fails.

        ``usage`` is counted by the backend in the same call; a degraded decision is counted
        here and added to the store's counters once it answers again (:meth:`flush_usage`).
        """
        if not checks:
            return Decision(Verdict.ALLOW, ())
        if self.breaker.allow():
            try:
                decision = self.backend.decide(checks, consume=consume, usage=usage)
            except BackendUnavailable as exc:
                self.breaker.record_failure()
                logger.warning("ratelimits: backend unavailable, degrading: %s", exc)
                if exc.stray_slot is not None:
                    degraded = self._degraded(checks, consume=consume, usage=usage)
                    return replace(degraded, stray_slot=exc.stray_slot)
            except BaseException:
                # Anything else (a bug, a worker timeout) must still report: a half-open breaker
                # whose probe never reports would turn every later call away for good.
                self.breaker.record_failure()
                raise
            else:
                self.breaker.record_success()
                return decision
        return self._degraded(checks, consume=consume, usage=usage)

    def flush_usage(self) -> None:
        """Add the usage counted while the store was unreachable to its counters, once it is back."""
        if not self._degraded_usage or self.breaker.state != "closed":
            return
        with self._count_lock:
            counts, self._degraded_usage = self._degraded_usage, Counter()
        try:
            self.backend.add_usage(counts)
        except BackendUnavailable:
            with self._count_lock:
                self._degraded_usage.update(counts)

    def release(self, decision: Decision) -> None:
        """Give back the slots ``decision`` holds, in the store that granted them; idempotent."""
        held = []
        if decision.slot is not None:
            held.append((self.local if decision.degraded else self.backend, decision.slot, decision.slot_keys))
        if decision.stray_slot is not None:
            held.append((self.backend, *decision.stray_slot))
        for backend, slot, keys in held:
            try:
                backend.release(slot, keys)
            except BackendUnavailable as exc:
                # Tried again after later requests; the slot's expiry is the last resort.
                self._unreleased.append((backend, slot, keys))
                logger.info("ratelimits: slot release postponed: %s", exc)

    def retry_releases(self) -> None:
        """Retry releases that failed (the store was slow or down), once it answers again."""
        while self._unreleased and self.breaker.state == "closed":
            backend, slot, keys = self._unreleased.popleft()
            try:
                backend.release(slot, keys)
            except BackendUnavailable:
                self._unreleased.appendleft((backend, slot, keys))
                return

    def _degraded(self, checks: Sequence[Check], *, consume: bool, usage: Usage | None = None) -> Decision:
        with self._count_lock:
            self.degraded_count += 1
            if consume and usage is not None:
                self._degraded_usage[(usage.minute, usage.field + "d")] += 1
        closed = [c for c in checks if c.policy.fail_mode == "closed"]
        if closed:
            wait_us = max(math.ceil(self.breaker.retry_after() * 1_000_000), 1_000_000)
            return Decision(Verdict.UNAVAILABLE, (), retry_after_us=wait_us, degraded=True)
        local = [
            Check(c.policy.scaled(self.local_share, at_least=c.cost), c.subject, c.cost)
            for c in checks
            if c.policy.fail_mode == "local"
        ]
        if not local:
            return Decision(Verdict.ALLOW, (), degraded=True)
        decision = self.local.decide(local, consume=consume)
        # Keep the local slot: release() gives it back to the local backend when the request ends.
        return Decision.from_results(
            decision.results, now_us=decision.now_us, degraded=True, slot=decision.slot, slot_keys=decision.slot_keys
        )


_limiter: Limiter | None = None
_source: PolicySource | None = None
_shedder: WorkerShedder | None = None
_shedder_built = False
_build_lock = threading.Lock()
#: What the current request holds until it finishes: (limiter, decision, shedder). A context
#: variable, not a thread-local: under ASGI the decision and request_finished may run in different
#: threads, and asgiref carries context (and so this list) between them.
_held: contextvars.ContextVar[list[tuple[Limiter, Decision, WorkerShedder | None]] | None] = contextvars.ContextVar(
    "ratelimits_held", default=None
)


def get_limiter() -> Limiter:
    """The process-wide limiter, built from settings on first use (and after they change)."""
    global _limiter
    if _limiter is None:
        with _build_lock:
            if _limiter is None:
                _limiter = _build_limiter()
    return _limiter


def _build_limiter() -> Limiter:
    from .backends import load_backend
    from .backends.memory import MemoryBackend

    return Limiter(
        load_backend(conf.backend),
        CircuitBreaker(**conf.breaker),
        local=MemoryBackend(),
        local_share=conf.local_fallback_share,
    )


def get_policy_source() -> PolicySource:
    """The process-wide policy source named by ``RATELIMITS['POLICY_SOURCE']``."""
    global _source
    if _source is None:
        with _build_lock:
            if _source is None:
                _source = import_string(conf.policy_source)()
    return _source


def reset() -> None:
    """Forget the limiter, policy source and shedder so the next request rebuilds them from settings."""
    global _limiter, _source, _shedder, _shedder_built
    with _build_lock:
        _limiter = None
        _source = None
        _shedder = None
        _shedder_built = False


def _usage(identity: Identity, checks: Sequence[Check]) -> Usage:
    caller = identity.caller
    tier = ""
    tokens = 1
    for check in checks:
        if not check.policy.holds_slots:
            tokens = check.cost  # every rate check of a request spends the endpoint's cost
        if not tier and check.policy.name.startswith("tier:"):
            tier = check.policy.name.split(":", 2)[1]
    organization = identity.organization.value if identity.organization else ""
    return usage_for(caller.kind, caller.value, organization, tier, identity.endpoint.value, tokens)


def _hold(limiter: Limiter, decision: Decision, shedder: WorkerShedder | None) -> None:
    if decision.slot is None and decision.stray_slot is None and shedder is None:
        return
    held = _held.get()
    if held is None:
        held = []
        _held.set(held)
    held.append((limiter, decision, shedder))


def release_held(**kwargs: Any) -> None:
    """Release what the finished request holds (connected to ``request_finished``).

    The signal is sent when the response has been closed, after a streaming body too, so slots
    are held exactly as long as the worker is busy with the request. A release that cannot reach
    the store is retried after later requests (the slot's expiry is the last resort), and usage
    counted during an outage is added to the store's counters once it answers.
    """
    held = _held.get()
    if held:
        # Emptied in place: the list is shared with every context copied from the request's.
        items = list(held)
        held.clear()
        for limiter, decision, shedder in items:
            if shedder is not None:
                shedder.finish()
            limiter.release(decision)
    # After the response, off the decision path: catch up on what an outage left behind.
    if _limiter is not None:
        _limiter.retry_releases()
        _limiter.flush_usage()


def get_worker_shedder() -> WorkerShedder | None:
    """This process's utilisation shedder, or ``None`` when ``WORKER_CAPACITY`` is not set."""
    global _shedder, _shedder_built
    if not _shedder_built:
        with _build_lock:
            if not _shedder_built:
                capacity = conf.worker_capacity
                _shedder = WorkerShedder(capacity, conf.shed_thresholds) if capacity else None
                _shedder_built = True
    return _shedder


def evaluate(
    request: HttpRequest, *, endpoint: str, auth: Any = None, user: Any = None, consume: bool = True
) -> tuple[Identity, Decision]:
    """Identify ``request``, collect its checks and decide them in one backend call.

    A consuming decision that admits the request holds its slots (and this worker's in-flight
    count) until ``request_finished``; see :func:`release_held`.
    """
    identity = identify(request, endpoint=endpoint, auth=auth, user=user)
    source = get_policy_source()
    shedder = get_worker_shedder() if consume else None
    if shedder is not None and not shedder.admit(source.endpoint_rule(endpoint, request.method or "GET").priority):
        return identity, Decision(Verdict.SHED, (), retry_after_us=SLOT_RETRY_US)
    try:
        checks = source.checks_for(request, identity)
        limiter = get_limiter()
        usage = _usage(identity, checks) if consume and conf.usage_counting else None
        decision = limiter.decide(checks, consume=consume, usage=usage)
    except BaseException:
        if shedder is not None:
            shedder.finish()  # counted in above, and nothing is held for request_finished to count out
        raise
    if decision.allowed and consume:
        _hold(limiter, decision, shedder)
    else:
        if shedder is not None:
            shedder.finish()
        if decision.stray_slot is not None:
            _hold(limiter, decision, None)
    # After holding: if observing fails, request_finished still releases what this request holds.
    source.observe(decision)
    if decision.shadow_violated:
        logger.info(
            "ratelimits: shadow policies would deny %s: %s",
            identity.caller,
            ", ".join(r.policy_name for r in decision.shadow_violated),
        )
    return identity, decision


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "RATELIMITS":
        reset()


def _connect() -> None:
    from django.core.signals import request_finished, setting_changed

    setting_changed.connect(_on_setting_changed, dispatch_uid="ratelimits.engine.reset")
    request_finished.connect(release_held, dispatch_uid="ratelimits.engine.release_held")


_connect()
