"""What to check: policies, the checks a request is subject to, endpoint rules, and where each came from."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple

from .._memo import remember
from .._numbers import ceil_div
from ..algorithms import ALGORITHMS, RATE_ALGORITHMS, Algorithm, Outcome, State, period_window
from ..choices import SHEDDABLE, Counts, FailMode, Priority
from ..conf import Shedding, conf
from ..exceptions import ConfigurationError
from ..identity import Subject, SubjectKind, subject_of
from ..periods import DAY_US, LONGEST_US, BillingPeriod, Unit
from ..rates import MAX_LIMIT, MAX_PERIOD_US, Rate, check_burst, parse_rate

__all__ = [
    "Check",
    "EndpointRule",
    "Explained",
    "KeptChecks",
    "Origin",
    "OriginKind",
    "Policy",
    "Role",
    "Scope",
    "check_for",
    "concurrency_policy",
    "every_shard",
    "fleet_checks",
    "fleet_share_policy",
    "policy_from_config",
    "positive_int",
]

# Policy names appear in Redis keys and headers: keep them to characters that need no quoting
# and can never form a Redis Cluster hash tag.
_POLICY_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,200}", re.ASCII)
#: The layout of the state values ``lua/decide.lua`` writes, per algorithm: the last part of
#: the state key's name. A new layout is a new letter, so the script never reads a value of
#: another layout: the old keys expire unread (their subjects start afresh once, as after a
#: Redis restart). ``b``: packed doubles, where the keys without a letter held decimal strings.
#: ``c``: a token bucket's arrival time with the capacity it was written under. A new layout a
#: worker of the previous release could misread (during a rolling deploy) is a new letter too;
#: a longer window value, which that release reads by its prefix, kept its letter.
STATE_LAYOUTS = {
    Algorithm.TOKEN_BUCKET: "c",
    Algorithm.SLIDING_WINDOW: "b",
    Algorithm.FIXED_WINDOW: "b",
    Algorithm.CONCURRENCY: "",
    Algorithm.FLEET: "",
}
#: The state layout letter of a global token bucket (tokens, time, share: ``lua/decide.lua``).
GLOBAL_LAYOUT = "g"
#: The state layout letter of a quota counted by billing period: a fixed window's layout, the window
#: named by its start (us) where an epoch-aligned window is named by its index. A key of its own, so
#: neither ever reads the other's count as its own.
PERIOD_LAYOUT = "p"
#: The billing period of a plain day quota (``"10000/d"``): the UTC calendar day.
UTC_DAY = BillingPeriod(Unit.DAY)


class Scope(StrEnum):
    """Where a policy's limit holds: in each region on its own, or once across every region."""

    #: Each region's store enforces the whole limit (the only scope of a one-region deployment).
    REGION = "region"
    #: One limit for every region together: each region enforces its share of the rate and
    #: burst, and the reconciler moves the shares toward demand (docs/regions.md).
    GLOBAL = "global"

    @classmethod
    def parse(cls, value: object, *, field: str) -> Scope:
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        raise ConfigurationError(f"{field}: {value!r} must be 'region' or 'global'")


class Role(StrEnum):
    """What a policy limits, so nobody has to parse its name."""

    #: A request rate: a tier's, an override's replacement, or one given directly.
    RATE = "rate"
    #: A tier's long-period quota (a fixed window of, say, a day); overrides leave it alone.
    QUOTA = "quota"
    #: Requests in flight per subject.
    CONCURRENCY = "concurrency"
    #: A static backstop on one subject kind (``RATELIMITS['DIMENSIONS']``).
    DIMENSION = "dimension"
    #: An endpoint's limit per caller.
    ENDPOINT = "endpoint"
    #: An endpoint's limit for all callers together.
    ENDPOINT_WIDE = "endpoint_wide"
    #: The fleet's in-flight limit for one priority class (the load shedder).
    FLEET = "fleet"
    #: Failed authentications per client IP or credential prefix (``RATELIMITS['IDENTITY']['FAILED_AUTH']``).
    FAILED_AUTH = "failed_auth"


@dataclass(frozen=True, slots=True)
class Policy:
    """A named limit: ``rate`` with ``burst`` capacity, counted by ``algorithm``."""

    name: str
    rate: Rate
    burst: int
    algorithm: Algorithm = Algorithm.TOKEN_BUCKET
    fail_mode: FailMode = FailMode.OPEN
    #: Evaluated and counted, reported when it would deny, but never denies.
    shadow: bool = False
    #: The tier this policy belongs to (its rate, quota or concurrency, or an override of them).
    tier: str | None = None
    role: Role = Role.RATE
    #: Hot-key sharding: one subject's budget split into this many sub-buckets, each holding its
    #: share, each under a key of its own (so they spread over a cluster's nodes); a request is
    #: decided by one of them, picked at random. For a limit every request meets (an endpoint's
    #: for all callers, a big organisation's, the fleet's in-flight set).
    shards: int = 1
    #: Whether this is one sub-bucket of a sharded policy (:attr:`shard`), not a policy of its own.
    is_shard: bool = False
    #: ``GLOBAL``: one limit across every region, each region enforcing its share (token buckets only).
    scope: Scope = Scope.REGION
    #: A quota counted by calendar day, week or month in a zone from a customer's anchor (a fixed
    #: window whose ``rate.period_us`` is the unit's longest period); ``None``: windows of the rate's period.
    period: BillingPeriod | None = None
    #: A quota that admits past its limit and counts the overage (billed) instead of refusing.
    soft: bool = False

    #: The most a subject can spend at once: the burst for a bucket, the limit for windows.
    capacity: int = field(init=False, repr=False, compare=False)
    #: Whether each region enforces only its share of this policy (``scope`` ``global``).
    is_global: bool = field(init=False, repr=False, compare=False)
    #: A global policy's share in a region the reconciler has written none to: an even split,
    #: 1 / the number of regions (1 for a regional policy).
    even_share: float = field(init=False, repr=False, compare=False)
    #: What follows the subject in this policy's state keys.
    key_suffix: str = field(init=False, repr=False, compare=False)
    #: Whether a check of this policy holds a slot until its request finishes (read per request).
    holds_slots: bool = field(init=False, repr=False, compare=False)
    #: With ``shards`` > 1: the policy of each sub-bucket (its share of the rate and burst).
    shard: Policy | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _POLICY_NAME.fullmatch(self.name):
            raise ConfigurationError(f"policy name {self.name!r} must match {_POLICY_NAME.pattern}")
        check_burst(self.rate, self.burst, field=f"{self.name}: burst")  # every policy fits the store
        if self.scope is not Scope.REGION:
            self._check_global()
        if self.period is not None or self.soft:
            self._check_quota()
        if type(self.fail_mode) is not FailMode:
            object.__setattr__(self, "fail_mode", FailMode.parse(self.fail_mode, field=f"{self.name}: fail_mode"))
        # Derived once here: all of them are read on every decision.
        capacity = self.burst if self.algorithm is Algorithm.TOKEN_BUCKET else self.rate.limit
        object.__setattr__(self, "capacity", capacity)
        is_global = self.scope is Scope.GLOBAL
        object.__setattr__(self, "is_global", is_global)
        object.__setattr__(self, "even_share", 1 / conf.regions.count if is_global else 1.0)
        layout = GLOBAL_LAYOUT if is_global else PERIOD_LAYOUT if self.period else STATE_LAYOUTS[self.algorithm]
        object.__setattr__(self, "key_suffix", f":{self.name}:{self.algorithm.code}{layout}")
        object.__setattr__(self, "holds_slots", self.algorithm.holds_slots)
        object.__setattr__(self, "shard", self._shard() if not self.is_shard else None)

    def _check_global(self) -> None:
        if type(self.scope) is not Scope:
            object.__setattr__(self, "scope", Scope.parse(self.scope, field=f"{self.name}: scope"))
        if self.scope is Scope.GLOBAL and self.algorithm is not Algorithm.TOKEN_BUCKET:
            raise ConfigurationError(
                f"{self.name}: scope 'global' needs the token_bucket algorithm, not {self.algorithm.value} "
                "(a window's count cannot be split between regions and moved without over-admitting)"
            )
        if self.scope is Scope.GLOBAL and self.shards != 1:
            raise ConfigurationError(f"{self.name}: a global policy cannot be sharded (shards {self.shards})")

    def evaluate(self, state: State | None, now: int, cost: int) -> Outcome:
        """This policy's arithmetic (:mod:`ratelimits.algorithms`) on a stored state, at ``now`` (us).

        What a backend calls for a check that counts (not a slot, nor a global policy's share of a
        region): the algorithm's function, with a quota's billing period where it has one.
        """
        limit, period_us = self.rate.limit, self.rate.period_us
        if self.period is not None:
            return period_window(state, now, limit, period_us, cost, self.period.bounds(now), self.soft)
        return ALGORITHMS[self.algorithm](state, now, limit, period_us, self.burst, cost)

    @property
    def billing_period(self) -> BillingPeriod | None:
        """A quota's billing period: its own, or the plain UTC day an epoch-aligned day quota counts
        (``None`` for a quota of another period, or a policy that is no quota)."""
        if self.role is not Role.QUOTA:
            return None
        if self.period is not None:
            return self.period
        return UTC_DAY if self.rate.period_us == DAY_US else None

    def anchored(self, anchor: datetime) -> Policy:
        """This quota renewing at a customer's ``anchor`` (the start of their subscription).

        A quota by calendar day, week or month: its period from the anchor. The plain UTC day,
        counted as an epoch-aligned window, becomes a calendar day from the anchor's time of day.
        Any other policy (a rate, a quota of hours) has no billing period: itself.
        """
        if self.period is not None:
            return replace(self, period=self.period.with_anchor(anchor))
        if self.role is Role.QUOTA and self.algorithm is Algorithm.FIXED_WINDOW and self.rate.period_us == DAY_US:
            day = BillingPeriod(Unit.DAY, "UTC", anchor)
            return replace(self, rate=Rate(self.rate.limit, LONGEST_US[Unit.DAY]), period=day)
        return self

    def _check_quota(self) -> None:
        if self.algorithm is not Algorithm.FIXED_WINDOW:
            raise ConfigurationError(
                f"{self.name}: a billing period or a soft limit needs the fixed_window algorithm, "
                f"not {self.algorithm.value}"
            )
        if self.period is not None and self.rate.period_us != LONGEST_US[self.period.unit]:
            raise ConfigurationError(
                f"{self.name}: a calendar {self.period.unit.value}'s rate period must be its longest, "
                f"{LONGEST_US[self.period.unit]} us, not {self.rate.period_us}"
            )
        if self.period is None:
            raise ConfigurationError(f"{self.name}: a soft limit is a quota by billing period (day, week or month)")
        if self.shards != 1 or self.scope is not Scope.REGION:
            raise ConfigurationError(f"{self.name}: a quota by billing period is neither sharded nor global")

    def _shard(self) -> Policy | None:
        """One sub-bucket's policy: a token bucket's period ``shards`` times longer (the rate split
        exactly) and its burst split; a window's or a slot limit's count split. Rounded down: the
        sub-buckets together never hold more than the policy.
        """
        n = self.shards
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigurationError(f"{self.name}: shards {n!r} must be a positive integer")
        if n == 1:
            return None
        if self.capacity < n:
            raise ConfigurationError(
                f"{self.name}: shards {n} exceeds its capacity {self.capacity}; each shard must hold at least one"
            )
        limit, period = self.rate.limit, self.rate.period_us
        if self.algorithm is Algorithm.TOKEN_BUCKET and period * n <= MAX_PERIOD_US:
            rate = Rate(limit, period * n)
        elif limit >= n:
            rate = Rate(limit // n, period)
        else:  # a bucket's period too long to stretch, and too few tokens per period to split
            raise ConfigurationError(f"{self.name}: shards {n} exceeds its rate's {limit} per period")
        burst = self.burst // n if self.algorithm is Algorithm.TOKEN_BUCKET else rate.limit
        return replace(self, rate=rate, burst=burst, is_shard=True)

    @property
    def state_ttl_ms(self) -> int:
        """How long a subject's state is kept after its last admitted request, in milliseconds.

        An upper bound of what the state can still matter for (a full bucket's refill time, or
        the rest of the current and the next window) plus one second of slack: Redis expires
        keys in real time, and with the app's clock a slow clock must not drop spent tokens.
        State kept longer decides exactly like no state.
        """
        period = self.rate.period_us
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            span = ceil_div(self.burst * period, self.rate.limit)
            if self.scope is Scope.GLOBAL:
                # A region's bucket refills at its share of the rate, at worst the reconciler's
                # floor: kept until even that has refilled it (then it reads as full, as it is).
                span = int(span / conf.regions.reconcile.floor)
        elif self.algorithm is Algorithm.SLIDING_WINDOW:
            span = 2 * period
        else:  # a fixed window; by billing period, its longest
            span = period
        return ceil_div(span, 1000) + 1000

    @property
    def window_seconds(self) -> int:
        """Seconds over which ``capacity`` is granted (refill time of a full bucket), rounded up.

        A quota by billing period: the length of the period in force now (a month of 28 to 31 days).
        """
        if self.period is not None:
            return ceil_div(self.period.length_us(time.time_ns() // 1000), 1_000_000)
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            return max(ceil_div(self.burst * self.rate.period_us, self.rate.limit * 1_000_000), 1)
        return max(ceil_div(self.rate.period_us, 1_000_000), 1)

    def describe(self) -> str:
        text = self._describe()
        return f"{text}, in {self.shards} shards" if self.shards > 1 and not self.is_shard else text

    def _describe(self) -> str:
        if self.algorithm is Algorithm.FLEET and self.rate.limit >= MAX_LIMIT:
            return "never shed (counted in flight)"
        if self.algorithm.holds_slots:
            return f"{self.rate.limit} in flight"
        if self.period is not None:
            text = f"{self.rate.limit} per {self.period.describe()}"
            return f"{text}, soft (overage counted)" if self.soft else text
        text = self.rate.describe()
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            return f"{text}, burst {self.burst}"
        text = f"{text} ({self.algorithm.value.replace('_', ' ')})"
        return f"{text}, soft (overage counted)" if self.soft else text

    def scaled(self, share: float, *, at_least: int = 1) -> Policy:
        """This policy cut down to ``share`` of its rate and burst (for per-process fallback).

        The capacity never drops below ``at_least``: a request whose cost fits the real policy
        must still fit this worker's share of it, or it could never be admitted.
        """
        if share >= 1:
            return self
        # The degraded path asks on every request while Redis is out: the same object each time
        # keeps the memos keyed by policy (the headers') from filling with copies.
        memo = (id(self), share, at_least)
        try:
            return _scaled[memo][1]
        except KeyError:
            pass
        limit = max(int(self.rate.limit * share), 1)
        burst = max(int(self.burst * share), 1)
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            burst = max(burst, at_least)
        else:
            limit = max(limit, at_least)
        return remember(_scaled, memo, (self, replace(self, rate=Rate(limit, self.rate.period_us), burst=burst)))[1]


#: (policy id, share, at least) -> (the policy, its share): an entry holds its policy, so the id stays its own.
_scaled: dict[tuple[int, float, int], tuple[Policy, Policy]] = {}


@dataclass(frozen=True, slots=True)
class Check:
    """One policy applied to one subject, spending ``cost`` tokens."""

    policy: Policy
    subject: Subject
    cost: int = 1
    #: ``(prefix, key)`` once :meth:`key` has been asked (checks are reused: see :func:`check_for`).
    _key: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (type(self.cost) is int and 0 < self.cost <= self.policy.capacity):
            positive_int(self.cost, field=f"{self.policy.name}: cost")
            if self.cost > self.policy.capacity:
                raise ConfigurationError(
                    f"{self.policy.name}: cost {self.cost} exceeds its capacity {self.policy.capacity}; "
                    "such a request could never be admitted"
                )

    def key(self, prefix: str) -> str:
        """The state key: hash-tagged by subject, so one subject's keys share a Cluster slot."""
        cached = self._key
        if cached is not None and cached[0] == prefix:
            return cached[1]
        key = f"{prefix}:{{{self.subject.digest}}}{self.policy.key_suffix}"
        object.__setattr__(self, "_key", (prefix, key))
        return key


class KeptChecks(tuple[Check, ...]):
    """A request's checks as its policy snapshot keeps them: one object for every request that
    resolves alike (:func:`~ratelimits.policies.resolver.resolve_checks`).

    What is made of a request's checks and nothing else (its usage row, its backend call's keys
    and packed records) can then be made once and kept under this object's id, by whoever holds
    it: the decision is compiled once per resolution, and each request fills in only its own
    parts (the minute, the clock, the slot). A plain list or tuple of checks is made per request
    and is not kept by anyone.
    """

    __slots__ = ()


class OriginKind(StrEnum):
    """Where a check's values are edited: an admin table, or the settings."""

    TIER = "tier"
    ASSIGNMENT = "assignment"
    OVERRIDE = "override"
    ENDPOINT = "endpoint"
    FLEET = "fleet"
    SETTINGS = "settings"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a value comes from: its kind and the row or setting, in words (``"override #4: ..."``)."""

    kind: OriginKind
    detail: str


@dataclass(frozen=True, slots=True)
class EndpointRule:
    """How one endpoint is treated: its cost, priority and its own limits."""

    cost: int = 1
    priority: Priority = Priority.NORMAL
    per_caller: Policy | None = None
    endpoint_wide: Policy | None = None
    exempt: bool = False
    #: Which responses are charged: the others' cost is given back after them.
    counts: Counts = Counts.ALL
    #: The most a view may true a request's cost up to (``request.ratelimit_cost``); ``None``: the
    #: cost is fixed. Charged at ``cost`` when admitted, settled after the response.
    max_cost: int | None = None
    #: The endpoint policy row or setting the rule was made from.
    origin: Origin = Origin(OriginKind.ENDPOINT, "endpoint rule")
    #: Where the per-caller limit comes from, when not from ``origin`` (a DRF throttle rate).
    per_caller_from: Origin | None = field(default=None, repr=False, compare=False)
    #: Where the per-caller and the all-callers limit come from, said once here, not per request.
    per_caller_origin: Origin = field(init=False, repr=False, compare=False)
    endpoint_wide_origin: Origin = field(init=False, repr=False, compare=False)

    @property
    def settles(self) -> bool:
        """Whether a request's charge is settled after its response: by its outcome, or its true cost."""
        return self.counts is not Counts.ALL or self.max_cost is not None

    def __post_init__(self) -> None:
        kind, detail = self.origin.kind, self.origin.detail
        own = self.per_caller_from or Origin(kind, f"{detail}, per caller")
        object.__setattr__(self, "per_caller_origin", own)
        object.__setattr__(self, "endpoint_wide_origin", Origin(kind, f"{detail}, all callers"))


class Explained(NamedTuple):
    """One check of a request, and where its values come from."""

    check: Check
    #: In words: ``"override #4: launch week"``, ``"RATELIMITS['DIMENSIONS']['ip']"``.
    origin: str
    #: Where it is edited: an admin table, or the settings.
    kind: OriginKind


#: What an endpoint nobody configured gets.
DEFAULT_RULE = EndpointRule()


#: Checks made by :func:`check_for`, by the ids of their policy and subject and their cost. An
#: entry holds its policy and subject, so neither id can be another object's while it is here.
_checks: dict[tuple[int, int, int], Check] = {}


def check_for(policy: Policy, subject: Subject, cost: int) -> Check:
    """A check of ``policy`` on ``subject``: a request takes one slot, whatever its cost in tokens.

    Made once and handed out again while policy and subject are the same objects (the resolver
    reads both from a snapshot and :func:`~ratelimits.identity.subject_of`): a check validates
    itself when made, and keeps its key (and the Redis backends its packed record,
    :func:`~ratelimits.backends.codec.check_record`). Bounded like the identity memos.
    A sharded policy's check is of one of its sub-buckets, picked at random: uniform picks spread
    the load evenly over the shards' keys, and over the nodes those live on.
    """
    shard = policy.shard
    if shard is not None:
        subject = shard_subject(subject, random.randrange(policy.shards))
        policy = shard
    cost = 1 if policy.holds_slots else cost
    memo = (id(policy), id(subject), cost)
    try:
        return _checks[memo]
    except KeyError:
        return remember(_checks, memo, Check(policy, subject, cost))


#: What separates a subject's value from its shard number: no identity's value holds it.
_SHARD_MARK = "\x00shard:"


def shard_subject(subject: Subject, index: int) -> Subject:
    """The subject of sub-bucket ``index`` of ``subject``'s sharded budget: its own digest, so its own slot."""
    return subject_of(subject.kind, f"{subject.value}{_SHARD_MARK}{index}")


def whole_subject(check: Check) -> Subject:
    """The subject ``check`` limits: a shard's is the subject whose budget it is one part of."""
    if not check.policy.is_shard:
        return check.subject
    return subject_of(check.subject.kind, check.subject.value.rpartition(_SHARD_MARK)[0])


def every_shard(check: Check) -> list[Check]:
    """``check``, or every sub-bucket of the sharded budget it is one shard of (what a reset must clear)."""
    policy = check.policy
    if not policy.is_shard:
        return [check]
    whole = whole_subject(check)
    return [Check(policy, shard_subject(whole, i), check.cost) for i in range(policy.shards)]


def concurrency_policy(
    name: str, limit: int, *, fail_mode: FailMode, shadow: bool = False, tier: str | None = None
) -> Policy:
    """At most ``limit`` requests of one subject in flight; a slot lasts its lease (:func:`slot_lease_us`)."""
    return Policy(
        name,
        Rate(limit, slot_lease_us()),
        limit,
        Algorithm.CONCURRENCY,
        fail_mode,
        shadow,
        tier,
        Role.CONCURRENCY,
    )


def slot_lease_us() -> int:
    """How long a slot lasts past its last renewal (a slot check's period): ``SHEDDING['SLOT_LEASE']``.

    The worker holding it renews it while its request runs, up to ``SHEDDING['SLOT_TTL']``
    (:mod:`ratelimits.engine.heartbeat`), so a killed worker's slots come back within the lease. Never
    longer than ``SLOT_TTL``, the bound on a request's slots however it is renewed.
    """
    return min(conf.shedding.slot_lease_us, conf.shedding.slot_ttl_us)


#: The one subject every fleet check counts under.
FLEET_SUBJECT = Subject(SubjectKind.FLEET, "in-flight")


def fleet_checks(capacity: int | None, thresholds: Mapping[Priority, int], shards: int = 1) -> dict[Priority, Check]:
    """The fleet's in-flight check per priority class: lower classes are shed at a lower share.

    Critical requests are never shed, but still hold a slot: they take capacity too. Without a
    capacity there is no fleet shedding at all. With ``shards`` (``SHEDDING['FLEET_SHARDS']``), the in-flight
    set is split over that many keys, each counting its share of every class's limit.
    """
    if capacity is None:
        return {}
    checks = {}
    for priority in Priority:
        percent = thresholds.get(priority) if priority in SHEDDABLE else None
        limit = MAX_LIMIT if percent is None else min(max(capacity * percent // 100, 1), MAX_LIMIT)
        rate = Rate(limit, slot_lease_us())
        try:
            # Fails open: without Redis the fleet cannot be counted; the worker shedder still works.
            policy = Policy("fleet", rate, limit, Algorithm.FLEET, FailMode.OPEN, role=Role.FLEET, shards=shards)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"{Shedding.fleet_shards.field}: {shards} shards leave the {priority} class less than one slot each "
                f"({exc}); use fewer shards or a larger fleet capacity",
                setting=Shedding.fleet_shards.name,
            ) from None
        checks[priority] = Check(policy, FLEET_SUBJECT, 1)
    return checks


def fleet_share_policy(capacity: int | None, percent: int) -> Policy | None:
    """The most of the fleet's in-flight slots one tenant may hold (``SHEDDING['TENANT_SHARE']``), or ``None``.

    A concurrency limit (429) on the tenant, decided with the fleet's check: the fleet sheds by
    priority, but no one customer can fill it and have everyone else's requests shed.
    """
    if capacity is None or percent >= 100:
        return None
    return concurrency_policy("fleet-share", max(capacity * percent // 100, 1), fail_mode=FailMode.OPEN)


def policy_from_config(
    name: str,
    config: Any,
    *,
    field: str,
    default_fail_mode: FailMode,
    role: Role = Role.RATE,
    tier: str | None = None,
    extra_keys: frozenset[str] = frozenset(),
) -> Policy:
    """Build a :class:`Policy` from ``{"rate": "100/s", "burst": 200}`` or just ``"100/s"``.

    ``extra_keys`` are keys the caller handles itself (a tier's ``quota``); any other unknown
    key is an error rather than silently ignored.
    """
    rate_field = field if isinstance(config, str) else f"{field}['rate']"
    if isinstance(config, str):
        config = {"rate": config}
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"{field}: expected a dict with at least 'rate', got {config!r}")
    unknown = set(config) - {"rate", "burst", "algorithm", "fail_mode", "shards", "scope"} - extra_keys
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}")
    if "rate" not in config:
        raise ConfigurationError(f"{field}: 'rate' is required")
    rate = parse_rate(config["rate"], field=rate_field)
    burst = check_burst(rate, config.get("burst", rate.limit), field=f"{field}['burst']")
    algorithm_name = config.get("algorithm", Algorithm.TOKEN_BUCKET.value)
    if algorithm_name not in [a.value for a in RATE_ALGORITHMS]:
        names = ", ".join(a.value for a in RATE_ALGORITHMS)
        raise ConfigurationError(f"{field}['algorithm']: {algorithm_name!r} must be one of {names}")
    algorithm = Algorithm(algorithm_name)
    mode = FailMode.parse(config.get("fail_mode", default_fail_mode), field=f"{field}['fail_mode']")
    shards = positive_int(config.get("shards", 1), field=f"{field}['shards']")
    scope = Scope.parse(config.get("scope", Scope.REGION.value), field=f"{field}['scope']")
    try:
        return Policy(
            name=name,
            rate=rate,
            burst=burst,
            algorithm=algorithm,
            fail_mode=mode,
            tier=tier,
            role=role,
            shards=shards,
            scope=scope,
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"{field}: {exc}") from None


def positive_int(value: object, *, field: str) -> int:
    """``value`` if it is an integer of at least 1 (booleans are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{field}: {value!r} must be a positive integer")
    return value
