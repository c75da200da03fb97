"""What a backend decides: each check's result, the request's verdict, and what is left (the peek)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

from .algorithms import Algorithm

if TYPE_CHECKING:
    from .policies.values import Check

__all__ = ["UNLIMITED", "Decision", "Peek", "Result", "Spent", "Verdict", "admitted", "peek"]

US = 1_000_000


class Verdict(StrEnum):
    """What happens to the request."""

    ALLOW = "allow"
    #: 429: the caller is over one of its limits.
    LIMITED = "limited"
    #: 503: the limiter cannot decide and a policy says to fail closed.
    UNAVAILABLE = "unavailable"
    #: 503: the fleet (or this worker) is too busy for this request's priority class.
    SHED = "shed"


class Result(NamedTuple):
    """One check's part of a decision (a tuple: one is made per check of every request)."""

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
class Spent:
    """What one check spent as the store took it, and what giving it back or charging more needs.

    Tokens a request spent (its own cost, where its endpoint settles after the response:
    :mod:`ratelimits.engine.settling`), or tokens a leasing call took for the worker beyond it
    (a lease's grant). ``lua/refund.lua`` gives back no more of them than time has not yet
    refilled, and charges more in the terms they were spent in.
    """

    check: Check
    tokens: int
    #: The store's clock when it took them (us), and what the decide call reported for the check
    #: (``REFUNDABLE`` in ``lua/decide.lua``): a token bucket's arrival time after the spend and
    #: what it had been given back until then; a billing period's start, and 0; a window's, 0, 0.
    taken_us: int
    spent_tat: float
    given_back: float


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
    #: How this worker answered without asking the store: ``"denial"`` (a remembered denial) or
    #: ``"lease"`` (tokens it leased); ``None`` when the store decided (:mod:`ratelimits.engine.local`).
    local: str | None = None
    #: What each rate check spent, where the request's charge is settled after its response (its
    #: endpoint counts by outcome, or trues its cost up): empty otherwise, and when nothing was spent.
    spent: tuple[Spent, ...] = ()

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW

    @property
    def retry_after_ms(self) -> int:
        return math.ceil(self.retry_after_us / 1000)

    @property
    def violated(self) -> tuple[Result, ...]:
        """Enforced checks that deny this request."""
        return self._denied(False)

    @property
    def shadow_violated(self) -> tuple[Result, ...]:
        """Shadow checks that would have denied this request had they been enforced."""
        return self._denied(True)

    def _denied(self, shadow: bool) -> tuple[Result, ...]:
        # A loop, not a generator: read for every response, and nearly always empty.
        found: tuple[Result, ...] = ()
        for result in self.results:
            if not result.allowed and bool(result.check.policy.shadow) == shadow:
                found += (result,)
        return found

    @property
    def closest(self) -> Result | None:
        """The result to describe in headers: the violated one with the longest wait, else the
        rate policy with the smallest share of its limit left.

        The fleet's in-flight count is the platform's, not the caller's: it is never described.
        Slots are described when they deny; otherwise one request in flight would make a small
        concurrency limit look "closest" on every response and hide the rate quota.
        """
        # One pass (this is read for every response's headers). A denied rate check is always a
        # violation, so the candidates are allowed ones; the first of equals wins, as min/max say.
        worst: Result | None = None
        closest: Result | None = None
        share = (2.0, 0)
        for result in self.results:
            policy = result.check.policy
            if policy.shadow:
                continue
            if not result.allowed:
                if policy.algorithm is not Algorithm.FLEET and (worst is None or result.retry_us > worst.retry_us):
                    worst = result
            elif worst is None and not policy.holds_slots:
                left = (result.remaining / policy.capacity, result.reset_us)
                if left < share:
                    closest, share = result, left
        return worst if worst is not None else closest

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
        if not denied:  # the common case
            if cls is Decision and not degraded:
                return admitted(tuple(results), now_us, policy_version, slot, slot_keys)
            return cls(Verdict.ALLOW, tuple(results), 0, now_us, degraded, policy_version, slot, slot_keys)
        shed = all(r.check.policy.algorithm is Algorithm.FLEET for r in denied)
        verdict = Verdict.SHED if shed else Verdict.LIMITED
        return cls(verdict, tuple(results), max(r.retry_us for r in denied), now_us, degraded, policy_version)


def admitted(
    results: tuple[Result, ...],
    now_us: int,
    policy_version: str | None = None,
    slot: str | None = None,
    slot_keys: tuple[str, ...] = (),
    local: str | None = None,
) -> Decision:
    """``Decision(Verdict.ALLOW, results, 0, now_us, False, policy_version, slot, slot_keys, None,
    local, ())``: an admission, the store's or memory's, made once per request. A frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__`` (about a microsecond for these
    eleven); the slots' own descriptors set them in half that."""
    made = _new(Decision)
    _verdict(made, Verdict.ALLOW)
    _results(made, results)
    _retry_after_us(made, 0)
    _now_us(made, now_us)
    _degraded(made, False)
    _policy_version(made, policy_version)
    _slot(made, slot)
    _slot_keys(made, slot_keys)
    _stray_slot(made, None)
    _local(made, local)
    _spent(made, ())
    return made


_new = object.__new__
#: Each field's slot setter. A field added to Decision is one more here and in admitted(): until
#: then, reading it from an admission raises (tests/test_decisions.py compares the two makings).
_setters = {name: Decision.__dict__[name].__set__ for name in Decision.__dataclass_fields__}
_verdict, _results, _retry_after_us = _setters["verdict"], _setters["results"], _setters["retry_after_us"]
_now_us, _degraded, _policy_version = _setters["now_us"], _setters["degraded"], _setters["policy_version"]
_slot, _slot_keys, _stray_slot, _local, _spent = (
    _setters["slot"],
    _setters["slot_keys"],
    _setters["stray_slot"],
    _setters["local"],
    _setters["spent"],
)


#: The decision on a request no check applies to: admitted, by nothing, so its responses carry no
#: rate-limit headers (what every request gets with ``RATELIMITS['ENABLED']`` off).
UNLIMITED = Decision(Verdict.ALLOW, ())


@dataclass(frozen=True, slots=True)
class Peek:
    """What a subject has left under one check right now, as a consume-nothing decision tells it."""

    limit: int
    remaining: int
    used: int
    #: Microseconds until the limit is whole again if nothing else arrives: 0 when it is whole,
    #: ``None`` for slots (they come back as requests finish, not at a time anyone can name).
    reset_after_us: int | None
    #: That moment in whole seconds since the epoch (``None`` for slots).
    reset_at: int | None

    @property
    def reset_after_seconds(self) -> int | None:
        """The wait rounded up to whole seconds (``None`` for slots)."""
        return None if self.reset_after_us is None else math.ceil(self.reset_after_us / US)


def peek(result: Result, *, now_us: int, share: float = 1.0) -> Peek:
    """Remaining, used and reset under ``result``, a check of a decision made with ``consume=False``.

    Such a decision looks one request ahead: it reports what would be left *after* a request of
    the check's cost. The request is added back, so the peek says what is left now. The reset is
    the time until the limit is whole again: none when nothing is spent; for a bucket, the
    looked-ahead request's refill is taken off again; a window is whole when it rolls over.
    ``share``: for a global policy, the region's share of it, whose bucket refills that much slower.
    """
    check = result.check
    policy = check.policy
    limit = result.limit
    remaining = min(result.remaining + check.cost if result.allowed else result.remaining, limit)
    if policy.holds_slots:
        return Peek(limit, remaining, limit - remaining, None, None)
    if remaining >= limit:
        reset_us = 0
    elif result.allowed and policy.algorithm is Algorithm.TOKEN_BUCKET:
        reset_us = max(math.ceil(result.reset_us - check.cost * policy.rate.interval_us / share), 0)
    else:
        reset_us = result.reset_us
    return Peek(limit, remaining, limit - remaining, reset_us, math.ceil((now_us + reset_us) / US))
