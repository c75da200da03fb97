"""The contract every backend implements: a small core, and capabilities a backend may add."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import sync_to_async

from ..decisions import Spent
from ..exceptions import BackendUnavailable

if TYPE_CHECKING:
    from ..counters import Usage
    from ..decisions import Decision
    from ..policies.values import Check
    from ..shares import ShareRecord
    from .invalidation import Subscription


T = TypeVar("T")

logger = logging.getLogger("ratelimits")

#: The threads async decisions ask a blocking store from: one pool for the process, not a loop's
#: own (a loop made for one call would make threads, and their connections, per call).
STORE_THREADS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ratelimits-store")


def _new_store_threads() -> None:
    # A forked child has none of the parent's threads, though the pool would count its idle ones.
    global STORE_THREADS
    STORE_THREADS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ratelimits-store")


os.register_at_fork(after_in_child=_new_store_threads)


def store_threads() -> ThreadPoolExecutor:
    """:data:`STORE_THREADS` as it is now (a forked child makes its own: never import the name)."""
    return STORE_THREADS


async def in_thread(
    call: Callable[[], T], undo: Callable[[T], None], *, executor: ThreadPoolExecutor | None = None
) -> T:
    """``call()`` in a thread (``executor``'s, else Django's thread-sensitive one), awaited.

    If the awaiting task is cancelled (its request was given up, or its loop is closing), the
    thread runs on, and ``undo`` gets what ``call`` returned, exactly once: in that thread once
    it is done, or in one of :data:`STORE_THREADS` if it was done already (the result was on its
    way). A call not started yet is not made. ``undo`` may block; it must not raise. A call that
    raises has nothing to undo (what a failed store call may have left, a stray slot, expires).
    """
    handoff = _Handoff()

    def run() -> T:
        if handoff.given_up:  # read without the lock: at worst the call is made, then undone
            return None  # type: ignore[return-value]  # nobody awaits it
        result = call()
        with handoff.lock:
            handoff.done, handoff.result = True, result
            given_up = handoff.given_up
        if given_up:
            undo(result)
        return result

    try:
        if executor is None:
            return await sync_to_async(run)()
        return await sync_to_async(run, thread_sensitive=False, executor=executor)()
    except asyncio.CancelledError:
        with handoff.lock:
            handoff.given_up = True
            done, result = handoff.done, handoff.result
        if done:
            STORE_THREADS.submit(undo, result)
        raise


class _Handoff:
    """What a thread and its awaiting task tell each other about who undoes ``call``'s result."""

    __slots__ = ("done", "given_up", "lock", "result")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.given_up = False
        self.result: Any = None


class PolicyFailed(BackendUnavailable):
    """The store is up, but could not decide some checks: their policy or their state is at fault.

    A key of another type where a check keeps its state, or (around the bounds every policy is
    checked against) arguments the decide script cannot use. Nothing was consumed. The limiter
    degrades only ``checks`` by their fail modes and leaves the circuit breaker alone: one bad
    policy is not an outage. Any other caller may treat it as the store error it subclasses.
    """

    def __init__(self, message: str, checks: tuple[Check, ...]) -> None:
        super().__init__(message)
        #: The checks that failed; every check of the call when the store could not say which.
        self.checks = checks


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """What a shared store says about keeping the limiter's keys; ``None`` where it would not say.

    A state key the store evicts before its TTL is indistinguishable from a subject never seen:
    its bucket restarts full, and the limit is not enforced. Nothing else shows it happening.
    """

    #: Redis' ``maxmemory-policy``: anything but ``noeviction`` may evict the limiter's keys.
    maxmemory_policy: str | None
    #: The memory limit in bytes (0: none, so nothing is evicted until one is set).
    maxmemory: int | None
    used_memory: int | None
    #: Keys evicted since the server started (``INFO stats``): the figure to alert on when it grows.
    evicted_keys: int | None

    @property
    def evicts(self) -> bool | None:
        """Whether the store may evict the limiter's keys (``volatile-*`` too: every key has a TTL)."""
        return None if self.maxmemory_policy is None else self.maxmemory_policy != "noeviction"


#: Tokens a leasing decide call took for the worker beyond a check's cost, and how to give back the
#: rest: what a check spent, as a request's own spend is recorded (the one record serves both).
Grant = Spent


@dataclass(frozen=True, slots=True)
class UsagePeek:
    """Usage counters read without claiming them (:meth:`UsageSupport.peek_usage`)."""

    #: ``{minute: {field: count}}`` of the minutes that had counters.
    counts: dict[int, dict[str, int]]
    #: Whether the store held more counters than the read was allowed: the rest were left unread.
    truncated: bool = False


class Backend(ABC):
    """The core contract: decide checks atomically, give a request's slot back, forget a subject's state.

    That is all a backend must implement (``from_settings``, :meth:`decide`, :meth:`release`,
    :meth:`renew`, :meth:`clear`; :meth:`adecide` runs :meth:`decide` in a thread unless
    overridden). Everything else a store may do is a capability, an abstract subclass of its
    own that a backend class adds to its bases (``class MyBackend(UsageSupport, BulletinSupport)``):
    :class:`LeaseSupport`, :class:`SettleSupport`, :class:`UsageSupport`, :class:`BulletinSupport`,
    :class:`RegionSupport` and :class:`HealthSupport`. The engine uses a capability only where
    the backend has it, and ``manage.py check`` refuses a setting that needs one it lacks
    (``ratelimits.E183``, naming both). ``tests/test_contract.py`` is the contract's suite.
    """

    #: Whether state is shared between processes (``memory`` is not).
    shared: bool = True
    #: What every key this backend writes starts with (``REDIS['KEY_PREFIX']``).
    prefix: str

    @classmethod
    @abstractmethod
    def from_settings(cls) -> Backend:
        """Build an instance from ``settings.RATELIMITS``."""

    @abstractmethod
    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        """Decide every check at once: consume from all of them only if all allow.

        A check that holds slots (concurrency, the fleet) takes one under a fresh slot id for
        ``check.policy.rate.period_us`` (the slot's lease, renewed by :meth:`renew` while its
        worker lives); the decision names the slot and its keys.

        With ``usage``, a consuming decision also counts itself (allowed, limited or shed, and
        the tokens spent) in that minute's usage counters, in the same call; a backend without
        :class:`UsageSupport` is never handed one.

        With ``consume=False`` nothing is written: the decision reports what a request of
        these costs would get now. Raises :class:`~ratelimits.exceptions.BackendUnavailable`
        when the store cannot answer; never retries a call that may have consumed.
        """

    async def adecide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        """:meth:`decide` for async code. Here: the blocking call in one of :data:`STORE_THREADS`, so
        the event loop runs on meanwhile; a store with an async client overrides it. Given up
        before it is done, the call gives back the slot it took."""
        return await in_thread(
            lambda: self.decide(checks, consume=consume, usage=usage), self._unheld, executor=STORE_THREADS
        )

    @abstractmethod
    def release(self, slot: str, keys: Sequence[str]) -> int:
        """Give back a request's slot under ``keys``; idempotent. Returns how many were held."""

    @abstractmethod
    def renew(self, held: Mapping[str, Sequence[str]], lease_us: int) -> int:
        """Extend the slots ``held`` (slot id -> its keys) to ``lease_us`` from now: their worker lives.

        A slot that expired or was released stays gone. Returns how many were renewed. (Part of
        the core: a slot's lease is seconds long, so without renewal a long request would lose it.)
        """

    @abstractmethod
    def clear(self, checks: Sequence[Check]) -> None:
        """Forget the state of these checks' keys (an admin's reset)."""

    def _unheld(self, decision: Decision) -> None:
        """``decision`` will be held by nobody: its slot given back."""
        if decision.slot is not None:
            self.release_quietly(decision.slot, decision.slot_keys)

    def release_quietly(self, slot: str, keys: Sequence[str]) -> None:
        """:meth:`release`, best effort, for a slot nobody holds (a cancelled call's): a failure is
        logged, and the slot expires."""
        try:
            self.release(slot, keys)
        except Exception as exc:
            logger.info("ratelimits: the slot of a cancelled decision was not given back (it expires): %s", exc)

    def publish_worker(self, worker: str, state: Mapping[str, Any], ttl_s: float) -> None:
        """Publish one worker's shedder state (JSON-able) for the admin, kept for ``ttl_s`` seconds.

        In this process by default (the admin then lists this process's workers only); a shared
        store shares it with every process."""
        self._workers[worker] = (time.time() + ttl_s, dict(state))

    def workers(self) -> list[dict[str, Any]]:
        """Every worker's last published shedder state that has not expired, by worker name."""
        now = time.time()
        return [state for _, (expires, state) in sorted(self._workers.items()) if expires > now]

    @cached_property
    def _workers(self) -> dict[str, tuple[float, dict[str, Any]]]:
        return {}


class LeaseSupport(Backend):
    """Capability: token leases, tokens taken in a decide call for a worker to spend itself.

    What the local path's leases need (``LOCAL_PATH['LEASES']``, :mod:`ratelimits.engine.local`).
    """

    @abstractmethod
    def lease(
        self, checks: Sequence[Check], wants: Sequence[int], *, usage: Usage | None = None
    ) -> tuple[Decision, list[Grant]]:
        """Decide and consume as :meth:`Backend.decide` does, and in the same call take up to ``wants[i]`` more
        tokens from check ``i`` (token buckets and fixed windows only) for the worker to spend itself; what each
        check gave, in the order of the checks.
        """

    async def alease(
        self, checks: Sequence[Check], wants: Sequence[int], *, usage: Usage | None = None
    ) -> tuple[Decision, list[Grant]]:
        """:meth:`lease` for async code (as :meth:`Backend.adecide` is :meth:`Backend.decide`'s)."""
        return await in_thread(
            lambda: self.lease(checks, wants, usage=usage),
            lambda answer: self._unheld(answer[0]),
            executor=STORE_THREADS,
        )

    @abstractmethod
    def give_back(self, grants: Sequence[tuple[Grant, int]]) -> int:
        """Give unused leased tokens back, ``(grant, tokens)`` each; how many buckets took something back."""

    def call_groups(self, checks: Sequence[Check]) -> list[list[int]] | None:
        """Which of ``checks`` (their indices) one decision asks together, call by call, when it
        makes several: a Redis Cluster's slot groups, the first check's group first. ``None``: one call.
        """
        return None


class SettleSupport(Backend):
    """Capability: a request's spend settled after its response: given back, or charged more.

    What an endpoint that counts by outcome or trues its cost up needs (``count``, ``max_cost``:
    :mod:`ratelimits.engine.settling`). The request is decided as any is, and its decision
    records what each rate check spent (:attr:`~ratelimits.decisions.Decision.spent`); after the
    response, :meth:`settle` gives back what the endpoint does not count, or charges what the view
    said the request really cost beyond its estimate.
    """

    @abstractmethod
    def decide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        """Decide and consume as :meth:`Backend.decide` does; an admission also records what each
        rate check spent (``Decision.spent``, in the order of the checks; a slot is not a spend)."""

    async def adecide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        """:meth:`decide_to_settle` for async code (as :meth:`Backend.adecide` is :meth:`Backend.decide`'s)."""
        return await in_thread(lambda: self.decide_to_settle(checks, usage=usage), self._unheld, executor=STORE_THREADS)

    @abstractmethod
    def settle(
        self,
        changes: Sequence[tuple[Spent, int]],
        usage: Usage | None = None,
        tokens: int = 0,
        *,
        counted_by: Check | None = None,
    ) -> int:
        """Change what each spend cost by ``(spent, tokens)``: fewer tokens give back, more charge.

        Given back: no more than the state still holds of the spend (what time refilled since is
        not given twice), as ``lua/refund.lua`` gives back. Charged: whether or not the limit has
        room, in the window the spend was made in while it still counts (a bucket's debt makes
        its next requests wait for it). A state written in other terms since (its policy changed)
        is left as it is. ``usage``: the request's usage row, whose tokens change by ``tokens``
        (its counts stay; a row's tokens never fall below none), where ``counted_by`` (the check
        whose call counted it; the first change's if not said) had it counted. Returns how many
        states changed.
        """


class UsageSupport(Backend):
    """Capability: the per-minute usage counters decisions count into, drained into the database.

    What ``USAGE`` needs (on by default): the usage report, ``GET /v1/usage`` and the digest read
    what is drained (:mod:`ratelimits.usage`).
    """

    @abstractmethod
    def add_usage(self, counts: Mapping[tuple[int, str], int]) -> None:
        """Add counts made without the store (degraded decisions) to the usage counters.

        ``counts`` maps ``(minute, field)`` to a count; each new row is capped as a decision's is.
        """

    @abstractmethod
    def claim_usage(self, before_minute: int) -> list[tuple[str, int]]:
        """Take the counters of every minute before ``before_minute`` out of the live set.

        Returns ``(batch id, minute)`` of every claimed batch, oldest first, including batches
        claimed earlier and not finished: a drain that crashed, or one applying them right now.
        They stay until :meth:`finish_usage`; :meth:`lease_usage` says which a drain may apply.
        """

    @abstractmethod
    def lease_usage(self, batch: str, seconds: float) -> dict[str, int] | None:
        """Hold ``batch`` for ``seconds`` and return its ``{field: count}``.

        ``None`` if another drain holds it, or it is finished. While the lease lasts no other
        drain is handed the batch; once it runs out (its drain died), another may take it.
        """

    @abstractmethod
    def finish_usage(self, batch: str) -> None:
        """Forget a claimed batch, and its lease, once its counts are safely in the database."""

    @abstractmethod
    def peek_usage(self, minutes: Sequence[int], max_fields: int, *, row_prefix: str = "") -> UsagePeek:
        """The counters of ``minutes`` still in the live set, read without claiming or changing them.

        ``row_prefix``: only the fields that start with it (one caller's rows,
        :func:`ratelimits.counters.caller_rows`), filtered by the store where it can.

        For the usage report's minutes not drained yet, off the decision path. Minutes are read in
        the order given, and at most ``max_fields`` fields in all: a busy store costs the reader a
        bounded read, and the rest is reported unread. Batches a drain has claimed are not read:
        they are in the database, or about to be.
        """


class BulletinSupport(Backend):
    """Capability: the policy version every decision brings back, and the channel that announces changes.

    What the database policy source needs (``POLICIES['SOURCE'] = "database"``): a committed
    change raises the version, and each worker learns of it on its next decision, at no extra
    round trip (:mod:`ratelimits.store.versioning`).
    """

    @abstractmethod
    def publish_version(self, version: int) -> str:
        """Raise the policy version stamp every decision returns to at least ``version``.

        Never lowers it (two publishers may race); returns the stamp now stored.
        """

    def subscribe(
        self,
        on_message: Callable[[bytes | None], None],
        *,
        wait: bool = True,
        on_tick: Callable[[], None] | None = None,
    ) -> Subscription | None:
        """Hear every invalidation (a new policy version, a reset) published from now on, anywhere.

        ``on_message`` is called with each message, and with ``None`` whenever the subscription
        (re)starts: messages may have been missed. With ``wait``, the first subscription is made
        before this returns. ``on_tick`` is called in the listener's thread at least every second
        while subscribed. ``None``: this backend publishes nothing, and the local fast path
        (:mod:`ratelimits.engine.local`) stays off.
        """
        return None


class RegionSupport(Backend):
    """Capability: a region's share of each global policy, as the reconciler writes it into this store.

    What ``REGIONS`` needs ([regions](regions.md)). Its :meth:`Backend.decide` enforces a global
    policy (``policy.is_global``) at this region's share of it, the even split where no share is
    written (:func:`ratelimits.algorithms.global_bucket`); these methods say what it enforces.
    """

    @abstractmethod
    def shares(self, checks: Sequence[Check]) -> dict[str, ShareRecord]:
        """The share records of these checks' global policies in this region's store, by state key.

        A check without one holds the even split.
        """

    @abstractmethod
    def last_reconciliation(self) -> dict[str, Any] | None:
        """What the reconciler's last round did, as it wrote it into this region's store (``None``: none yet)."""


class HealthSupport(Backend):
    """Capability: what a shared store says about keeping the limiter's keys (its eviction policy, its memory).

    Nothing needs it: the admin's store page and ``manage.py check`` (``ratelimits.W004``) report it where a
    backend has it.
    """

    @abstractmethod
    def store_health(self) -> StoreHealth | None:
        """Whether the store may evict the limiter's keys, and how many it has; ``None``: nothing to report.

        One that cannot reach its store raises :class:`~ratelimits.exceptions.BackendUnavailable`.
        """


#: Every capability a backend may have, and what it is called in messages.
CAPABILITIES: dict[type[object], str] = {
    LeaseSupport: "token leases",
    SettleSupport: "settling a charge after the response",
    UsageSupport: "usage counters",
    BulletinSupport: "the policy version bulletin",
    RegionSupport: "region shares",
    HealthSupport: "store health",
}


def takes_slots(checks: Sequence[Check]) -> bool:
    """Whether a consuming decision of ``checks`` takes a slot (any of them holds slots)."""
    return any(c.policy.holds_slots for c in checks)


def new_slot(checks: Sequence[Check]) -> str | None:
    """A fresh slot id if any check holds slots (one id serves all of a request's slot checks)."""
    return uuid.uuid4().hex if takes_slots(checks) else None


def slot_keys(checks: Sequence[Check], keys: Sequence[str]) -> tuple[str, ...]:
    """The keys, among ``keys`` (one per check), under which the request holds its slot."""
    return tuple(key for check, key in zip(checks, keys, strict=True) if check.policy.holds_slots)
