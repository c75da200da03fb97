"""In-process backend: the embedded default for one process, and the readable reference."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..algorithms import State, global_bucket, slots
from ..conf import conf
from ..counters import ALLOWED, EXTRA_TOKENS, LIMITED, SHED, Usage, count, overflow_of
from ..decisions import Decision, Result, Verdict
from ..policies.values import Check
from ..shares import ShareRecord
from .base import BulletinSupport, RegionSupport, UsagePeek, UsageSupport, new_slot, slot_keys

__all__ = ["MemoryBackend"]


def _wall_clock_us() -> int:
    return time.time_ns() // 1000


class MemoryBackend(UsageSupport, BulletinSupport, RegionSupport):
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
            now = self.clock()
            pending: dict[str, State] = {}
            writes: list[tuple[str, State, int]] = []
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
                results.append(Result(check, outcome.allowed, outcome.remaining, outcome.reset_us, outcome.retry_us))
            slot = new_slot(checks) if consume else None
            held = slot_keys(checks, keys) if slot else ()
            admitted = consume and all(r.allowed or r.check.policy.shadow for r in results)
            if consume:
                # A converted state is kept admitted or not (it spends nothing), so that it drains
                # at the new rate from now on; an admission's write of the same key supersedes it.
                for key, state, expires in conversions:
                    self._state[key] = (state, expires)
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
            decision = Decision.from_results(
                results, now_us=now, policy_version=self.version, slot=slot, slot_keys=held
            )
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

    def reset(self) -> None:
        """Forget everything: every limit's state, every slot, the usage counters and the policy version."""
        with self._lock:
            self._state.clear()
            self._slots.clear()
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
        for key in [k for k, held in self._slots.items() if all(expiry <= now for expiry in held.values())]:
            del self._slots[key]
