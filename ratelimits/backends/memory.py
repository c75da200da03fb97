"""In-process backend: the embedded default for one process, and the readable reference."""

from __future__ import annotations

import itertools
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..algorithms import Algorithm, Holes, State, charged_window_end, global_bucket, settled, slots
from ..conf import conf
from ..counters import ALLOWED, EXTRA_TOKENS, LIMITED, SHED, Usage, count, overflow_of
from ..decisions import Decision, Result, Spent, Verdict
from ..policies.values import Check
from ..shares import ShareRecord
from .base import BulletinSupport, RegionSupport, SettleSupport, UsagePeek, UsageSupport, new_slot, slot_keys

__all__ = ["MemoryBackend"]


def _wall_clock_us() -> int:
    return time.time_ns() // 1000


class MemoryBackend(SettleSupport, UsageSupport, BulletinSupport, RegionSupport):
    """Same semantics as the Redis backend, with state in a dict guarded by a lock.

    State is per process: with several workers each enforces the limits on its own, which is
    why the system checks warn when it is used outside ``DEBUG``. ``clock`` returns integer
    microseconds and is injectable for tests.
    """

    shared = False
    #: Expired entries are swept after this many writes, bounding memory for idle subjects.
    SWEEP_EVERY = 10_000

    def __init__(
        self, *, clock: Callable[[], int] = _wall_clock_us, prefix: str = "rl", usage_cap: int | None = None
    ) -> None:
        self.clock = clock
        self.prefix = prefix
        #: The most rows a minute of usage counts (``USAGE['MAX_SUBJECTS']``).
        self.usage_cap = conf.usage.max_subjects if usage_cap is None else usage_cap
        self.version: str | None = None
        self._state: dict[str, tuple[State, int]] = {}
        #: What each token bucket has been given back (us) since its state was last forgotten, and
        #: its holes (``algorithms.frontier``): what ``lua/refund.lua`` keeps in the state's value.
        self._given_back: dict[str, tuple[float, Holes]] = {}
        self._slots: dict[str, dict[str, int]] = {}
        #: Usage counters per minute, drained like Redis' (see ``ratelimits.usage``).
        self.usage_counts: dict[int, Counter[str]] = {}
        self._claimed: dict[str, tuple[int, dict[str, int]]] = {}
        #: Claimed batch -> until when (``clock``) a drain holds it.
        self._leases: dict[str, int] = {}
        self._lock = threading.Lock()
        self._writes = 0

    @classmethod
    def from_settings(cls) -> MemoryBackend:
        return cls(prefix=conf.redis.key_prefix)

    async def adecide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        # In this process's memory, under a lock held for microseconds: nothing to wait for.
        return self.decide(checks, consume=consume, usage=usage)

    def decide(self, checks: Sequence[Check], *, consume: bool = True, usage: Usage | None = None) -> Decision:
        with self._lock:
            return self._decide(checks, consume, usage, settle=False)

    def decide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        with self._lock:
            return self._decide(checks, True, usage, settle=True)

    async def adecide_to_settle(self, checks: Sequence[Check], *, usage: Usage | None = None) -> Decision:
        return self.decide_to_settle(checks, usage=usage)  # memory: nothing to wait for, as adecide

    def settle(
        self,
        changes: Sequence[tuple[Spent, int]],
        usage: Usage | None = None,
        tokens: int = 0,
        *,
        counted_by: Check | None = None,
    ) -> int:
        with self._lock:
            now = self.clock()
            changed = 0
            for spent, change in changes:
                check = spent.check
                policy, key = check.policy, check.key(self.prefix)
                entry = self._state.get(key)
                state = entry[0] if entry is not None and entry[1] > now else None
                refunded, holes = self._given_back.get(key, (0.0, ()))
                after = settled(
                    policy.algorithm,
                    state,
                    now,
                    policy.rate.limit,
                    policy.rate.period_us,
                    policy.burst,
                    change,
                    taken_us=spent.taken_us,
                    spent_tat=spent.spent_tat,
                    given_back=spent.given_back,
                    refunded=refunded,
                    holes=holes,
                    is_global=policy.is_global,
                )
                if after is None:
                    continue
                new_state, refunded, holes = after
                expires = entry[1] if entry is not None and state is not None else now
                if change > 0 and policy.algorithm is not Algorithm.TOKEN_BUCKET and policy.period is None:
                    # A window charged: kept while it counts (refund.lua's PX).
                    expires = max(expires, charged_window_end(policy.algorithm, new_state, policy.rate.period_us))
                if policy.algorithm is Algorithm.TOKEN_BUCKET and not policy.is_global:
                    # Kept until its debt is paid, and a second more (as refund.lua's PX).
                    expires = max(expires, math.ceil(new_state[0]) + 1_000_000)
                    if refunded:
                        self._given_back[key] = (refunded, holes)
                self._state[key] = (new_state, expires)
                changed += 1
            if usage is not None and tokens:
                counts = self.usage_counts.get(usage.minute)
                if counts is not None:  # as refund.lua: in the row it was counted in, while the minute is live
                    row = usage.field if usage.field in counts else usage.overflow
                    allowed = counts.get(row + ALLOWED, 0)
                    if allowed > 0:
                        counts[row + EXTRA_TOKENS] += max(tokens, -(allowed + counts.get(row + EXTRA_TOKENS, 0)))
            return changed

    def _decide(self, checks: Sequence[Check], consume: bool, usage: Usage | None, *, settle: bool) -> Decision:
        """:meth:`decide` under the lock; with ``settle``, an admission records what each rate check spent."""
        now = self.clock()
        pending: dict[str, State] = {}
        writes: list[tuple[str, State, int]] = []
        reached: list[str] = []  # token buckets given back to whose holes go with a write
        # States read in other terms (their policy changed), as the new terms read them.
        conversions: list[tuple[str, State, int]] = []
        results = []
        keys = []
        for check in checks:
            key = check.key(self.prefix)
            keys.append(key)
            policy = check.policy
            if policy.holds_slots:
                outcome, live = slots(
                    self._slots.get(key, {}), now, policy.rate.limit, policy.rate.period_us, check.cost
                )
                self._slots[key] = live
            else:
                state = pending[key] if key in pending else self._load(key, now)
                if policy.is_global:
                    # No reconciler reaches a process's memory: the region keeps its even split.
                    outcome = global_bucket(
                        state,
                        now,
                        policy.rate.limit,
                        policy.rate.period_us,
                        policy.burst,
                        check.cost,
                        policy.even_share,
                    )
                else:
                    outcome = policy.evaluate(state, now, check.cost)
                expires = now + policy.state_ttl_ms * 1000
                if outcome.allowed:
                    pending[key] = outcome.new_state
                    writes.append((key, outcome.new_state, expires))
                elif outcome.converted is not None:
                    pending[key] = outcome.converted
                if outcome.converted is not None:
                    conversions.append((key, outcome.converted, expires))
                if key in self._given_back and (outcome.converted is not None or state is None or state[0] <= now):
                    # Full again (time reached every hole), or in new terms (its refunds are past
                    # giving back): its holes go, as lua/decide.lua drops them when it writes.
                    reached.append(key)
            results.append(Result(check, outcome.allowed, outcome.remaining, outcome.reset_us, outcome.retry_us))
        slot = new_slot(checks) if consume else None
        held = slot_keys(checks, keys) if slot else ()
        admitted = consume and all(r.allowed or r.check.policy.shadow for r in results)
        if consume:
            # A converted state is kept admitted or not (it spends nothing), so that it drains
            # at the new rate from now on; an admission's write of the same key supersedes it.
            for key, state, expires in conversions:
                self._state[key] = (state, expires)
            for key in reached:
                if key in self._given_back and (admitted or any(key == k for k, _, _ in conversions)):
                    self._given_back[key] = (self._given_back[key][0], ())
        if admitted:
            for key, state, expires in writes:
                self._state[key] = (state, expires)
            for result, key in zip(results, keys, strict=True):
                # Only checks that allowed take the slot (a denied shadow check does not), as in Redis.
                if result.check.policy.holds_slots and result.allowed and slot is not None:
                    self._slots.setdefault(key, {})[slot] = now + result.check.policy.rate.period_us
            self._writes += len(writes) + len(held)
            if self._writes >= self.SWEEP_EVERY:
                self._sweep(now)
        decision = Decision.from_results(results, now_us=now, policy_version=self.version, slot=slot, slot_keys=held)
        if settle and admitted:
            decision = replace(decision, spent=self._spent(results, keys, pending, now))
        if consume and usage is not None:
            counts = self.usage_counts.setdefault(usage.minute, Counter())
            if decision.allowed:
                row = count(counts, usage.field, usage.overflow, ALLOWED, 1, self.usage_cap)
                if usage.tokens != 1:
                    counts[row + EXTRA_TOKENS] += usage.tokens - 1
            else:
                metric = SHED if decision.verdict is Verdict.SHED else LIMITED
                count(counts, usage.field, usage.overflow, metric, 1, self.usage_cap)
        return decision

    def _spent(
        self, results: Sequence[Result], keys: Sequence[str], written: Mapping[str, State], now: int
    ) -> tuple[Spent, ...]:
        """What each rate check of an admission spent, as a refundable decide call reports it: a
        token bucket's arrival time after it and what it had been given back; a billing period's start."""
        spent = []
        for result, key in zip(results, keys, strict=True):
            policy = result.check.policy
            if not result.allowed or policy.holds_slots:
                continue
            state = written.get(key)
            spent_tat, given_back = 0.0, 0.0
            if state is not None and policy.algorithm is Algorithm.TOKEN_BUCKET and not policy.is_global:
                spent_tat, given_back = state[0], self._given_back.get(key, (0.0, ()))[0]
            elif state is not None and policy.period is not None:
                spent_tat = state[0]  # the period it was counted in, named by its start
            spent.append(Spent(result.check, result.check.cost, now, spent_tat, given_back))
        return tuple(spent)

    def claim_usage(self, before_minute: int) -> list[tuple[str, int]]:
        with self._lock:
            for minute in [m for m in self.usage_counts if m < before_minute]:
                self._claimed[f"memory:{minute}:{uuid.uuid4().hex}"] = (minute, dict(self.usage_counts.pop(minute)))
            return sorted(((batch, minute) for batch, (minute, _) in self._claimed.items()), key=lambda b: b[1])

    def lease_usage(self, batch: str, seconds: float) -> dict[str, int] | None:
        with self._lock:
            now = self.clock()
            if batch not in self._claimed or self._leases.get(batch, now) > now:
                return None
            self._leases[batch] = now + max(int(seconds * 1_000_000), 1)
            return dict(self._claimed[batch][1])

    def finish_usage(self, batch: str) -> None:
        with self._lock:
            self._claimed.pop(batch, None)
            self._leases.pop(batch, None)

    def add_usage(self, counts: Mapping[tuple[int, str], int]) -> None:
        with self._lock:
            for (minute, field), n in counts.items():
                overflow = overflow_of(field)
                if overflow is not None:
                    minute_counts = self.usage_counts.setdefault(minute, Counter())
                    count(minute_counts, field[:-1], overflow, field[-1], n, self.usage_cap)

    def peek_usage(self, minutes: Sequence[int], max_fields: int, *, row_prefix: str = "") -> UsagePeek:
        counts: dict[int, dict[str, int]] = {}
        left = max_fields
        with self._lock:  # copied under the decisions' lock: at most max_fields fields, a millisecond or so
            for minute in minutes:
                held: Mapping[str, int] | None = self.usage_counts.get(minute)
                if held and row_prefix:
                    held = {name: n for name, n in held.items() if name.startswith(row_prefix)}
                if not held:
                    continue
                if len(held) > left:
                    counts[minute] = dict(itertools.islice(held.items(), left))
                    return UsagePeek({m: c for m, c in counts.items() if c}, truncated=True)
                counts[minute] = dict(held)
                left -= len(held)
        return UsagePeek(counts)

    def release(self, slot: str, keys: Sequence[str]) -> int:
        with self._lock:
            return sum(1 for key in keys if self._slots.get(key, {}).pop(slot, None) is not None)

    def renew(self, held: Mapping[str, Sequence[str]], lease_us: int) -> int:
        with self._lock:
            now = self.clock()
            renewed = 0
            for slot, keys in held.items():
                for key in keys:
                    live = self._slots.get(key, {})
                    if live.get(slot, now) > now:  # still held: an expired slot stays gone, as in Redis
                        live[slot] = now + lease_us
                        renewed += 1
            return renewed

    def clear(self, checks: Sequence[Check]) -> None:
        with self._lock:
            for check in checks:
                self._state.pop(check.key(self.prefix), None)
                self._slots.pop(check.key(self.prefix), None)
                self._given_back.pop(check.key(self.prefix), None)

    def reset(self) -> None:
        """Forget everything: every limit's state, every slot, the usage counters and the policy version."""
        with self._lock:
            self._state.clear()
            self._slots.clear()
            self._given_back.clear()
            self.usage_counts.clear()
            self._claimed.clear()
            self._leases.clear()
            self.version = None
            self._writes = 0

    def publish_version(self, version: int) -> str:
        with self._lock:
            self.version = str(max(int(self.version or 0), version))
            return self.version

    def shares(self, checks: Sequence[Check]) -> dict[str, ShareRecord]:
        """None: no reconciler reaches one process's memory, so every global policy keeps the even split."""
        return {}

    def last_reconciliation(self) -> dict[str, Any] | None:
        return None

    def _load(self, key: str, now: int) -> State | None:
        entry = self._state.get(key)
        if entry is None or entry[1] <= now:
            return None
        return entry[0]

    def _sweep(self, now: int) -> None:
        self._writes = 0
        for key in [k for k, (_, expires) in self._state.items() if expires <= now]:
            del self._state[key]
            self._given_back.pop(key, None)
        for key in [k for k, held in self._slots.items() if all(expiry <= now for expiry in held.values())]:
            del self._slots[key]
