"""The limiter: the store behind a circuit breaker, and each policy's fail mode when it cannot answer.

:class:`Limiter` asks the store for every decision. :class:`LocalLimiter` is one with this
worker's memory in front (:mod:`.local`, ``LOCAL_PATH``): it answers what memory can (a remembered
denial, tokens it leased for every check of a request), asks the store about any other request as
:class:`Limiter` does, and teaches memory from the store's answers. :func:`build_limiter` makes the
one the settings ask for.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import redis

from .._process import ProcessWide
from ..backends import Backend, PolicyFailed, get_backend
from ..backends.base import BulletinSupport, LeaseSupport, SettleSupport, UsageSupport, store_threads, takes_slots
from ..backends.memory import MemoryBackend
from ..choices import FailMode
from ..conf import LocalPathSettings, conf
from ..counters import ALLOWED, DEGRADED, EXTRA_TOKENS, LIMITED, SHED, Usage
from ..decisions import UNLIMITED, Decision, Spent, Verdict, admitted
from ..exceptions import BackendUnavailable
from ..metrics import get_recorder
from ..policies.values import Check
from .breaker import NOT_A_PROBE, BreakerState, CircuitBreaker
from .heartbeat import HEARTBEAT
from .local import LEASE, LocalPath, Spared, call_weakly

__all__ = ["Limiter", "LocalLimiter", "build_limiter", "get_limiter"]

logger = logging.getLogger("ratelimits")

#: How often the usage of requests answered from memory is added to the store's counters (seconds).
LOCAL_USAGE_EVERY_S = 1.0
#: How many counter fields this worker holds before it adds them, whenever they are due.
LOCAL_USAGE_FIELDS = 1_000
#: The usage metric a store's answer counts under, as the decide script counts it.
_COUNTED_AS = {Verdict.ALLOW: ALLOWED, Verdict.LIMITED: LIMITED, Verdict.SHED: SHED}
#: How often a worker with an adaptive capacity publishes it for the admin, and how long it is shown
#: after its worker stopped publishing.
WORKER_STATE_EVERY_S = 1.0
WORKER_STATE_TTL_S = 30.0


class Limiter:
    """A backend behind a circuit breaker, with per-policy fail modes when it cannot answer."""

    #: What this worker answers without the store (a :class:`LocalLimiter`'s); ``None``: every
    #: decision asks it.
    local_path: LocalPath | None = None

    def __init__(
        self,
        backend: Backend,
        breaker: CircuitBreaker,
        *,
        local: Backend,
        local_share: float,
        usage_every: float | None = None,
    ) -> None:
        self.backend = backend
        #: The backend's capabilities this limiter uses, ``None`` where it lacks them
        #: (:mod:`ratelimits.backends.base`): usage is counted only where it can be added to.
        self.usage_store: UsageSupport | None = backend if isinstance(backend, UsageSupport) else None
        self.leaser: LeaseSupport | None = backend if isinstance(backend, LeaseSupport) else None
        self.settler: SettleSupport | None = backend if isinstance(backend, SettleSupport) else None
        self.breaker = breaker
        #: Where checks that fail locally are decided while the store cannot answer.
        self.local = local
        self.local_share = local_share
        self.degraded_count = 0
        self._count_lock = threading.Lock()
        #: Usage of degraded decisions, per (minute, field), waiting for the store to come back.
        self._degraded_usage: Counter[tuple[int, str]] = Counter()
        #: Seconds between additions of the usage this worker counts itself (``USAGE['FLUSH_EVERY']``):
        #: then the store's answers are counted here too, not by the decide script. ``None``: by it.
        self.usage_every = usage_every
        #: Usage of decisions answered from memory (and with ``usage_every``, of every decision),
        #: added to the store's every ``usage_every`` or LOCAL_USAGE_EVERY_S.
        self._local_usage: Counter[tuple[int, str]] = Counter()
        self._local_usage_at = time.monotonic()
        self._published_at = -WORKER_STATE_EVERY_S
        #: When each failed policy was last logged (monotonic seconds): once a minute is enough.
        self._failures_logged: dict[str, float] = {}
        #: Releases that could not reach the store, oldest first; bounded, since slots expire anyway.
        self._unreleased: deque[tuple[Backend, str, tuple[str, ...]]] = deque(maxlen=10_000)

    def decide(
        self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None, settle: bool = False
    ) -> Decision:
        """Decide ``checks`` in one backend round trip, or none; degrade by fail mode if the store fails.

        ``usage`` is counted by the backend in the same call (with ``USAGE['FLUSH_EVERY']``,
        here); a degraded decision is counted here, and what is counted here is added to the
        store's counters later (:meth:`flush_usage`). ``settle``: the request's charge is settled
        after its response (:mod:`.settling`), so an admission by the store records what each
        check spent (a store without :class:`~ratelimits.backends.base.SettleSupport` records nothing).
        """
        if not checks:
            return UNLIMITED
        return self._keep_slot(self._ask_store(checks, consume=consume, usage=usage, settle=settle and consume))

    async def adecide(
        self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None, settle: bool = False
    ) -> Decision:
        """:meth:`decide` for async code: the same decision, the store asked without blocking the event loop."""
        if not checks:
            return UNLIMITED
        return self._keep_slot(await self._aask_store(checks, consume=consume, usage=usage, settle=settle and consume))

    def settle(
        self,
        changes: Sequence[tuple[Spent, int]],
        usage: Usage | None,
        tokens: int,
        counted_by: Check | None = None,
    ) -> bool:
        """Change what an admitted request spent after its response (:mod:`.settling`), and its
        usage row's tokens by ``tokens`` (``counted_by``: the check whose store call counted it);
        whether the store took it. Best effort, off the decision path, and never through a breaker
        that is not closed: what is not settled stays as it was admitted."""
        settler = self.settler
        if settler is None or not (changes or tokens):
            return False
        if self.breaker.state is not BreakerState.CLOSED:
            logger.info("ratelimits: a charge was not settled (the store is not answering): it stays as admitted")
            return False
        if usage is not None and self.usage_every is not None:
            # Counted by this worker: corrected here while it holds the row, else in the store.
            tokens = self._settle_counted(usage, tokens)
        try:
            settler.settle(changes, usage if tokens else None, tokens, counted_by=counted_by)
        except (BackendUnavailable, PolicyFailed) as exc:
            if not isinstance(exc, PolicyFailed):
                self.breaker.record_failure()
            logger.info("ratelimits: a charge was not settled, it stays as admitted: %s", exc)
            return False
        self.breaker.record_success()
        return True

    def _settle_counted(self, usage: Usage, tokens: int) -> int:
        """Change the tokens of a row this worker counts itself (``USAGE['FLUSH_EVERY']``) by
        ``tokens``, taking off no more than it still holds of the row; what is left to take off
        (the rest was added to the store's counters already, which take it)."""
        allowed, extra = (usage.minute, usage.field + ALLOWED), (usage.minute, usage.field + EXTRA_TOKENS)
        with self._count_lock:
            held = self._local_usage
            here = tokens
            if tokens < 0:
                here = max(tokens, -(held[allowed] + held[extra])) if held[allowed] > 0 else 0
            if here:
                held[extra] += here
        return tokens - here

    def _keep_slot(self, decision: Decision) -> Decision:
        """``decision``, its slot renewed by the process's heartbeat until :meth:`release`."""
        if decision.slot is not None:
            HEARTBEAT.hold(self._slot_store(decision), decision.slot, decision.slot_keys)
        return decision

    def _slot_store(self, decision: Decision) -> Backend:
        """The store a decision's slot is held in: this worker's memory for a degraded one."""
        return self.local if decision.degraded else self.backend

    def _ask_store(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        wants: list[int] | None = None,
        settle: bool = False,
    ) -> Decision:
        """Decide ``checks`` with the store (leasing ``wants`` tokens; recording what each spent, to
        ``settle``); without it if it cannot answer."""
        if not self.breaker.allow():
            return self._decide_without_store(checks, consume=consume, usage=usage)
        sent = self._note_send(consume)
        worker_usage, script_usage = self._split_usage(consume, usage)
        try:
            if settle and self.settler is not None:
                answer: Any = self.settler.decide_to_settle(checks, usage=script_usage)
            elif wants is None:
                answer = self.backend.decide(checks, consume=consume, usage=script_usage)
            else:
                answer = self._leases().lease(checks, wants, usage=script_usage)
        except PolicyFailed as exc:
            self._policy_failed(exc)
            return self._decide_without_failed(exc, checks, consume=consume, usage=usage)
        except BackendUnavailable as exc:
            return self._decide_unreachable(exc, checks, consume=consume, usage=usage)
        except BaseException:
            # Anything else (a bug, a worker timeout) must still report: a half-open breaker
            # whose probe never reports would turn every later call away for good.
            self.breaker.record_failure()
            raise
        return self._read_answer(answer, sent, wants, worker_usage=worker_usage)

    async def _aask_store(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        wants: list[int] | None = None,
        settle: bool = False,
    ) -> Decision:
        """:meth:`_ask_store`, awaiting the store."""
        ticket = self.breaker.admit()
        if ticket is None:
            return self._decide_without_store(checks, consume=consume, usage=usage)
        sent = self._note_send(consume)
        worker_usage, script_usage = self._split_usage(consume, usage)
        asked = (
            self.settler.adecide_to_settle(checks, usage=script_usage)
            if settle and self.settler is not None
            else self.backend.adecide(checks, consume=consume, usage=script_usage)
            if wants is None
            else self._leases().alease(checks, wants, usage=script_usage)
        )
        # The breaker's probe, and a call that takes slots, are shielded when they go out to the
        # store: a request given up (its client went away) leaves them to finish, so that the
        # breaker hears how the store is (else it would probe again and again, and never learn),
        # and a slot is given back once it is taken. Others are not worth the task it costs
        # (about 20 µs): given up, their tokens are spent all the same.
        shielded = self.backend.shared and (ticket != NOT_A_PROBE or (consume and takes_slots(checks)))
        call = asyncio.ensure_future(asked) if shielded else None
        try:
            answer = await (asked if call is None else asyncio.shield(call))
        except PolicyFailed as exc:
            self._policy_failed(exc)
            fallback, rest = self._decide_failed_by_mode(exc, checks, consume=consume, usage=usage)
            if rest is None:
                return fallback
            return self._with_fallback(await self.adecide(rest, consume=consume, usage=usage), fallback)
        except BackendUnavailable as exc:
            return self._decide_unreachable(exc, checks, consume=consume, usage=usage)
        except asyncio.CancelledError:
            if call is None:
                self.breaker.abandon(ticket)  # cancelled with its request: it never reports
                # Nor is it counted by this worker (USAGE['FLUSH_EVERY']): its answer is not known.
            else:
                _finishing.add(call)  # a task the loop holds only weakly
                # (Run soon if the call is done already: its answer and the cancellation crossed.)
                call.add_done_callback(lambda done: self._finish_abandoned(done, ticket, sent, wants, worker_usage))
            raise
        except BaseException:
            self.breaker.record_failure()  # as in _ask_store: a probe always reports
            raise
        return self._read_answer(answer, sent, wants, worker_usage=worker_usage)

    def _finish_abandoned(
        self,
        call: asyncio.Future[Any],
        ticket: int,
        sent: tuple[float, int] | None,
        wants: list[int] | None,
        worker_usage: Usage | None,
    ) -> None:
        """A cancelled request's shielded store call ended: the breaker, the metrics and (a
        :class:`LocalLimiter`'s) memory learn its outcome (reported with its ticket: it may come
        late), and the slots it took are given back off the loop (nobody holds them)."""
        _finishing.discard(call)
        if call.cancelled():
            # Its loop is closing: the call never reports, so a probe gives its turn back. (A slot
            # the script took is given back by the backend.)
            self.breaker.abandon(ticket)
            return
        exc = call.exception()
        if isinstance(exc, PolicyFailed):
            self._policy_failed(exc, ticket)
            return
        if isinstance(exc, BackendUnavailable):
            self._store_failed(exc, "for a cancelled request", ticket)
            if exc.stray_slot is not None:
                store_threads().submit(self._release_logged, Decision(Verdict.ALLOW, (), stray_slot=exc.stray_slot))
            return
        if exc is not None:
            self.breaker.record_failure(ticket)
            return
        # Leases it was granted are kept for others.
        decision = self._read_answer(call.result(), sent, wants, ticket, worker_usage)
        if decision.slot is not None or decision.stray_slot is not None:
            store_threads().submit(self._release_logged, decision)

    def _release_logged(self, decision: Decision) -> None:
        try:
            self.release(decision)
        except Exception:
            logger.exception("ratelimits: the slots of a cancelled request could not be released (they expire)")

    @property
    def counts_usage(self) -> bool:
        """Whether decisions are counted in the usage counters: ``USAGE`` on, and a backend that keeps them."""
        return self.usage_store is not None and conf.usage.enabled

    def _leases(self) -> LeaseSupport:
        """The backend, as it takes leases: asked for only where it does (the local path leases only then)."""
        if self.leaser is None:
            raise TypeError(f"{type(self.backend).__name__} takes no leases (no LeaseSupport)")
        return self.leaser

    def _note_send(self, consume: bool) -> tuple[float, int] | None:
        """What an answer is learnt against once it comes (a :class:`LocalLimiter`'s memory): nothing here."""
        return None

    def _split_usage(self, consume: bool, usage: Usage | None) -> tuple[Usage | None, Usage | None]:
        """Who counts a consuming call's ``usage``: ``(this worker's, the decide script's)``, one of them ``None``."""
        if usage is None or not consume or self.usage_every is None:
            return None, usage
        return usage, None

    def _read_answer(
        self,
        answer: Any,
        sent: tuple[float, int] | None,
        wants: list[int] | None,
        ticket: int | None = None,
        worker_usage: Usage | None = None,
    ) -> Decision:
        """The store answered (a decision, or a decision and its grants): the breaker learns it, and
        this worker counts ``worker_usage`` as the script would have."""
        self.breaker.record_success(ticket)
        decision: Decision = answer if wants is None else answer[0]
        if worker_usage is not None and decision.verdict in _COUNTED_AS:
            self.count_local(worker_usage, _COUNTED_AS[decision.verdict])
        return decision

    def _policy_failed(self, exc: PolicyFailed, ticket: int | None = None) -> None:
        # The store answered: a bad policy or key is not an outage, and must not open the breaker
        # for every tenant of this process.
        self.breaker.record_success(ticket)
        _count_error(exc)

    def _decide_unreachable(
        self, exc: BackendUnavailable, checks: Sequence[Check], *, consume: bool, usage: Usage | None
    ) -> Decision:
        self._store_failed(exc, "degrading")
        return self._decide_without_store(checks, consume=consume, usage=usage, stray_slot=exc.stray_slot)

    def _store_failed(self, exc: BackendUnavailable, then: str, ticket: int | None = None) -> None:
        """The store could not answer: the breaker, the metrics and the log hear of it."""
        self.breaker.record_failure(ticket)
        _count_error(exc)
        logger.warning("ratelimits: backend unavailable, %s: %s", then, exc)

    def _decide_without_store(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        stray_slot: tuple[str, tuple[str, ...]] | None = None,
    ) -> Decision:
        """The store cannot answer: each check's fail mode decides."""
        decision = self._degraded(checks, consume=consume, usage=usage)
        return decision if stray_slot is None else replace(decision, stray_slot=stray_slot)

    def return_leases(self) -> None:
        """Give back the unused tokens of ended leases: none are taken here (a :class:`LocalLimiter` takes them)."""

    def publish_worker_state(self, state: Callable[[], Mapping[str, Any]]) -> None:
        """Publish this worker's shedder ``state()`` for the admin's fleet page, every
        WORKER_STATE_EVERY_S at most (best effort, off the request path; never while the store is down)."""
        now = time.monotonic()
        if now - self._published_at < WORKER_STATE_EVERY_S or self.breaker.state is not BreakerState.CLOSED:
            return
        self._published_at = now
        snapshot = state()
        try:
            self.backend.publish_worker(str(snapshot["worker"]), snapshot, WORKER_STATE_TTL_S)
        except BackendUnavailable as exc:
            logger.info("ratelimits: worker state not published: %s", exc)

    def count_local(self, usage: Usage | None, metric: str) -> None:
        """Count ``usage`` here, to add to the store's counters later (``metric``: allowed, limited or
        shed): a request answered from memory, or with ``USAGE['FLUSH_EVERY']`` any the store answered."""
        if usage is not None:
            with self._count_lock:
                self._local_usage[(usage.minute, usage.field + metric)] += 1
                if metric == ALLOWED and usage.tokens != 1:
                    self._local_usage[(usage.minute, usage.field + EXTRA_TOKENS)] += usage.tokens - 1

    def flush_usage(self, *, now: bool = False) -> None:
        """Add usage counted in this process to the store's counters: what was decided while it was
        unreachable, once it is back, and every LOCAL_USAGE_EVERY_S (``USAGE['FLUSH_EVERY']`` if
        set), or ``now``, what was answered from memory (and with ``FLUSH_EVERY``, every decision).
        """
        if self.breaker.state is not BreakerState.CLOSED:
            return
        if self._degraded_usage:
            self._flush("_degraded_usage")
        every = LOCAL_USAGE_EVERY_S if self.usage_every is None else self.usage_every
        held = self._local_usage
        if held and (now or len(held) >= LOCAL_USAGE_FIELDS or time.monotonic() - self._local_usage_at >= every):
            self._local_usage_at = time.monotonic()
            self._flush("_local_usage")

    def flush_at_exit(self) -> int:
        """Add everything counted here, whether the breaker is open or not: the process is ending.
        How many counts could not be added (the store did not answer)."""
        for name in ("_degraded_usage", "_local_usage"):
            if getattr(self, name):
                self._flush(name)
        return sum(self._degraded_usage.values()) + sum(self._local_usage.values())

    def _flush(self, name: str) -> None:
        with self._count_lock:
            counts: Counter[tuple[int, str]] = getattr(self, name)
            setattr(self, name, Counter())
        if self.usage_store is None:
            return  # nothing to add to (the engine counts no usage then: see counts_usage)
        try:
            self.usage_store.add_usage(counts)
        except BackendUnavailable:
            with self._count_lock:
                getattr(self, name).update(counts)

    def release(self, decision: Decision) -> None:
        """Give back the slots ``decision`` holds, in the store that granted them; idempotent."""
        held = []
        if decision.slot is not None:
            HEARTBEAT.drop(decision.slot)
            held.append((self._slot_store(decision), decision.slot, decision.slot_keys))
            recorder = get_recorder()
            if recorder is not None:
                recorder.count("ratelimits_slots_released")
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
        while self._unreleased and self.breaker.state is BreakerState.CLOSED:
            backend, slot, keys = self._unreleased.popleft()
            try:
                backend.release(slot, keys)
            except BackendUnavailable:
                self._unreleased.appendleft((backend, slot, keys))
                return

    def _decide_without_failed(
        self, failure: PolicyFailed, checks: Sequence[Check], *, consume: bool, usage: Usage | None
    ) -> Decision:
        """Decide ``checks`` again without those the store could not decide; those go by their fail modes.

        The store consumed nothing for the failed call. A failed check that fails closed refuses the
        request (503); one that fails locally is decided in-process first; one that fails open is
        left out. The rest are decided by the store as usual, in a second round trip.
        """
        fallback, rest = self._decide_failed_by_mode(failure, checks, consume=consume, usage=usage)
        if rest is None:
            return fallback
        return self._with_fallback(self.decide(rest, consume=consume, usage=usage), fallback)

    def _decide_failed_by_mode(
        self, failure: PolicyFailed, checks: Sequence[Check], *, consume: bool, usage: Usage | None
    ) -> tuple[Decision, list[Check] | None]:
        """The failed checks decided by their fail modes, and the rest to ask the store (``None``: nothing to ask)."""
        self._log_failure(failure)
        failed = set(failure.checks)
        # A shadow check never denies, whatever its fail mode: a failed one is simply left out.
        fallback = self._degraded([c for c in checks if c in failed and not c.policy.shadow], consume=consume)
        rest = [c for c in checks if c not in failed]
        if not fallback.allowed or not rest:
            if consume:
                self._count_degraded(usage)  # decided without the store after all
            return fallback, None
        return fallback, rest

    def _with_fallback(self, decision: Decision, fallback: Decision) -> Decision:
        if fallback.slot is not None:
            # A decision holds slots in one store; the failed check's local slot is given back at once.
            self.local.release(fallback.slot, fallback.slot_keys)
        return replace(decision, results=decision.results + fallback.results)

    def _log_failure(self, failure: PolicyFailed) -> None:
        now = time.monotonic()
        names = sorted({check.policy.name for check in failure.checks})
        due = [name for name in names if now - self._failures_logged.get(name, -math.inf) >= 60]
        if not due:
            return
        if len(self._failures_logged) > 1_000:
            self._failures_logged.clear()
        self._failures_logged.update(dict.fromkeys(due, now))
        logger.error(
            "ratelimits: policy error in %s: %s; those checks are decided by their fail mode (logged once a minute)",
            ", ".join(due),
            failure,
        )

    def _count_degraded(self, usage: Usage | None) -> None:
        """Count ``usage`` as a request decided without the store, to be added once it answers."""
        if usage is not None:
            with self._count_lock:
                self._degraded_usage[(usage.minute, usage.field + DEGRADED)] += 1

    def _degraded(self, checks: Sequence[Check], *, consume: bool, usage: Usage | None = None) -> Decision:
        with self._count_lock:
            self.degraded_count += 1
        if consume:
            self._count_degraded(usage)
        closed = [c for c in checks if c.policy.fail_mode is FailMode.CLOSED]
        recorder = get_recorder() if consume else None
        if recorder is not None:
            decided_by = (
                FailMode.CLOSED
                if closed
                else FailMode.LOCAL
                if any(c.policy.fail_mode is FailMode.LOCAL for c in checks)
                else FailMode.OPEN
            )
            recorder.count("ratelimits_degraded", decided_by.value)
        if closed:
            wait_us = max(math.ceil(self.breaker.retry_after() * 1_000_000), 1_000_000)
            return Decision(Verdict.UNAVAILABLE, (), retry_after_us=wait_us, degraded=True)
        local = [
            Check(c.policy.scaled(self.local_share, at_least=c.cost), c.subject, c.cost)
            for c in checks
            if c.policy.fail_mode is FailMode.LOCAL
        ]
        if not local:
            return Decision(Verdict.ALLOW, (), degraded=True)
        decision = self.local.decide(local, consume=consume)
        # Keep the local slot: release() gives it back to the local backend when the request ends.
        return Decision.from_results(
            decision.results, now_us=decision.now_us, degraded=True, slot=decision.slot, slot_keys=decision.slot_keys
        )


class LocalLimiter(Limiter):
    """A :class:`Limiter` with this worker's memory in front (:mod:`.local`, ``LOCAL_PATH``).

    A consuming decision may be answered from memory: a denial remembered from the store that
    has not ended, or tokens this worker leased for each of its checks (a request some check of
    which no lease covers is the store's, whole; one this worker makes often is leased in its
    call; on a store that decides a request in several calls, a group of its checks leases
    cover may be paid from them and left out). Each answer of the store teaches memory its
    denials and installs what a leasing call took; while the store cannot answer, a remembered
    denial refuses before any fail mode decides. What memory answers is counted here, as a
    degraded decision is, and added to the store's counters within a second.
    """

    local_path: LocalPath

    def __init__(
        self,
        backend: Backend,
        breaker: CircuitBreaker,
        local_path: LocalPath,
        *,
        local: Backend,
        local_share: float,
        usage_every: float | None = None,
    ) -> None:
        super().__init__(backend, breaker, local=local, local_share=local_share, usage_every=usage_every)
        self.local_path = local_path
        # Usage answered from memory reaches the store, and ended leases' unused tokens go back,
        # within a second even if no request follows (request_finished does both too): the
        # listener's thread does it.
        tick = weakref.WeakMethod(self._tick)
        local_path.tick = lambda: call_weakly(tick)

    def _tick(self) -> None:
        self.flush_usage()
        self.return_leases()

    def decide(
        self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None, settle: bool = False
    ) -> Decision:
        """:meth:`Limiter.decide`, memory first: a consuming decision may be answered from it (a
        remembered denial, or tokens this worker leased for each check), and is then counted here.
        A peek (``consume=False``) says what is left as a lease's responses say it: the store's,
        and this worker's lease. A request to settle after its response is the store's, whole:
        what it spends must be the store's to give back or charge, and a denial remembered for it
        would not be exact (a settlement may shorten the wait it names, a true-up lengthen it)."""
        if settle or (consume and self.local_path.idle):  # memory has nothing to answer, pay or lease with
            return super().decide(checks, consume=consume, usage=usage, settle=settle)
        plan = self._plan_from_memory(checks, consume, usage)
        if isinstance(plan, Decision):
            return plan
        try:
            decision = self._settle_plan(
                plan, self._ask_store(plan.checks, consume=consume, usage=usage, wants=plan.wants)
            )
        except BaseException:
            self._put_back_plan(plan)
            raise
        return self._keep_slot(decision)

    async def adecide(
        self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None, settle: bool = False
    ) -> Decision:
        """:meth:`decide` for async code: the store asked without blocking the event loop."""
        if settle or (consume and self.local_path.idle):
            return await super().adecide(checks, consume=consume, usage=usage, settle=settle)
        plan = self._plan_from_memory(checks, consume, usage)
        if isinstance(plan, Decision):
            return plan
        try:
            decision = self._settle_plan(
                plan, await self._aask_store(plan.checks, consume=consume, usage=usage, wants=plan.wants)
            )
        except BaseException:
            self._put_back_plan(plan)
            raise
        return self._keep_slot(decision)

    def _plan_from_memory(self, checks: Sequence[Check], consume: bool, usage: Usage | None) -> Decision | _Ask:
        """What memory answers (a decision), or what the store must be asked (and leased)."""
        if not checks:
            return UNLIMITED
        if not consume:
            return _Ask(checks, None, local=False)
        local = self.local_path
        refusal = local.refuse(checks)
        if refusal is not None:
            self.count_local(usage, LIMITED)
            return refusal
        paid = local.spend(checks)
        if paid is None:
            return _Ask(*local.ask(checks), local=True)
        self.count_local(usage, ALLOWED)
        return admitted(paid, time.time_ns() // 1000, local=LEASE)

    def _settle_plan(self, plan: _Ask, decision: Decision) -> Decision:
        """The store's ``decision`` on what ``plan`` asked: the whole request's, where leases paid
        part of it; a peek's says what is left as a lease's responses do."""
        if plan.local:
            return decision if plan.spared is None else self.local_path.settle(plan.spared, decision)
        # A peek: what is left, as a lease's responses say it (the store's and this worker's lease).
        return self.local_path.with_leases(decision)

    def _put_back_plan(self, plan: _Ask) -> None:
        """Deciding ``plan`` raised (a bug, a worker timeout, a request given up): what leases paid
        of the request goes back into them. The store may still have consumed the rest (a call
        given up runs on): under-admission only, as any call given up is."""
        if plan.spared is not None:
            self.local_path.put_back(plan.spared)

    def _note_send(self, consume: bool) -> tuple[float, int] | None:
        """What memory learns a consuming call's answer against: when it was sent, and memory's generation."""
        local = self.local_path
        return (local.clock(), local.generation) if consume else None

    def _read_answer(
        self,
        answer: Any,
        sent: tuple[float, int] | None,
        wants: list[int] | None,
        ticket: int | None = None,
        worker_usage: Usage | None = None,
    ) -> Decision:
        decision = super()._read_answer(answer, sent, wants, ticket, worker_usage)
        if sent is not None:
            self.local_path.learn(decision, *sent)
            if wants is not None:
                decision = self.local_path.install(decision, answer[1], *sent)
        return decision

    def _decide_without_store(
        self,
        checks: Sequence[Check],
        *,
        consume: bool,
        usage: Usage | None,
        stray_slot: tuple[str, tuple[str, ...]] | None = None,
    ) -> Decision:
        """The store cannot answer: a denial remembered from it that has not ended, else each check's fail mode."""
        refusal = self.local_path.refuse(checks, store_down=True) if consume else None
        if refusal is None:
            return super()._decide_without_store(checks, consume=consume, usage=usage, stray_slot=stray_slot)
        self.count_local(usage, LIMITED)
        return refusal if stray_slot is None else replace(refusal, stray_slot=stray_slot)

    def return_leases(self) -> None:
        """Give the unused tokens of leases that ran out back to their buckets (best effort, off the request path)."""
        local = self.local_path
        unused = local.expired()
        if not unused:
            return
        tokens = sum(n for _, n in unused)
        if self.breaker.state is not BreakerState.CLOSED:
            local.counts["tokens_unreturned"] += tokens  # the store is down: asked no more now
            return
        try:
            self._leases().give_back(unused)
        except (BackendUnavailable, PolicyFailed) as exc:
            local.counts["tokens_unreturned"] += tokens
            logger.info("ratelimits: leased tokens not given back: %s", exc)
        else:
            local.returned(unused)


#: Shielded store calls of cancelled requests, until they end (the loop keeps tasks weakly).
_finishing: set[asyncio.Future[Any]] = set()


class _Ask(NamedTuple):
    """What a decision asks the store: ``checks``, leasing ``wants`` more tokens of each (``None``: none)."""

    checks: Sequence[Check]
    wants: list[int] | None
    #: The request's checks leases paid instead (on a store that asks them in calls of their own).
    spared: Spared | None = None
    #: Whether the local path takes part (a consuming decision, with one): else it is a peek.
    local: bool = False


def _count_error(exc: BackendUnavailable) -> None:
    """A failed store call in the metrics, by kind: the policy's, a timeout, a lost connection, or other."""
    recorder = get_recorder()
    if recorder is None:
        return
    cause = exc.__cause__
    if isinstance(exc, PolicyFailed):
        kind = "policy"
    elif isinstance(cause, (redis.TimeoutError, TimeoutError)):
        kind = "timeout"
    elif isinstance(cause, (redis.ConnectionError, ConnectionError, OSError)):
        kind = "connection"  # refused, reset, a pool with no connection free in time, a server loading
    else:
        kind = "other"
    recorder.count("ratelimits_store_errors", kind)


def build_limiter(
    backend: Backend,
    breaker: CircuitBreaker,
    settings: LocalPathSettings,
    *,
    local_share: float = 1.0,
    usage_cap: int | None = None,
    usage_every: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Limiter:
    """A limiter on ``backend`` with the local path ``settings`` ask for (``LOCAL_PATH``'s shape).

    None over a backend whose state is the process's (memory): it answers from memory already.
    ``usage_cap`` is the fallback backend's (``USAGE['MAX_SUBJECTS']`` if ``None``); ``usage_every``
    ``USAGE['FLUSH_EVERY']``; ``clock`` the local path's (monotonic seconds).
    """
    local = MemoryBackend(usage_cap=usage_cap)
    # Memory is trusted only while the store's invalidation channel is live: none, no local path.
    heard = isinstance(backend, BulletinSupport)
    if backend.shared and heard and (settings.denials or (settings.leases and isinstance(backend, LeaseSupport))):
        local_path = LocalPath(backend, breaker, settings, clock=clock)
        return LocalLimiter(backend, breaker, local_path, local=local, local_share=local_share, usage_every=usage_every)
    return Limiter(backend, breaker, local=local, local_share=local_share, usage_every=usage_every)


def _build() -> Limiter:
    return build_limiter(
        get_backend(),
        CircuitBreaker(**conf.failure.breaker),
        conf.local_path.settings,
        local_share=conf.failure.local_share,
        usage_every=conf.usage.flush_every if conf.usage.enabled else None,
    )


_limiter: ProcessWide[Limiter] = ProcessWide(_build)


def _flush_at_exit() -> None:
    """A worker that exits adds the usage it counted itself (``USAGE['FLUSH_EVERY']``); a killed one cannot."""
    limiter = _limiter.current()
    if limiter is None or limiter.usage_every is None:
        return
    try:
        lost = limiter.flush_at_exit()
    except Exception:  # a bug or a closed store: nothing to do about it now but say so
        logger.warning("ratelimits: the usage this worker counted could not be added at exit", exc_info=True)
        return
    if lost:
        logger.warning("ratelimits: %d usage counts this worker held could not be added at exit", lost)


atexit.register(_flush_at_exit)


def get_limiter() -> Limiter:
    """The process-wide limiter around the process's backend, built on first use (and after settings change)."""
    return _limiter.get()


def current_limiter() -> Limiter | None:
    """The process's limiter if one was built (``None`` before the first decision)."""
    return _limiter.current()
