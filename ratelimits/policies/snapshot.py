"""The policy snapshot: what both policy sources load, and the builders that fill it in.

Settings and the admin's tables are two ways of writing the same things: tiers, who is on which
tier, endpoint rules, overrides, per-dimension backstops and the fleet's shedding limits. Each
source loads them into a :class:`PolicySnapshot`; one resolver (:mod:`.resolver`) turns a
snapshot and a request into checks, so both sources resolve alike.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NamedTuple

from .. import documentation
from ..algorithms import Algorithm
from ..choices import Counts, FailMode, Priority
from ..exceptions import ConfigurationError
from ..identity import SubjectKind
from ..periods import DAY_US, LONGEST_US, QuotaMode, parse_calendar_quota, zone_info
from ..rates import MAX_BURST, MAX_LIMIT, MAX_REFILL_US, Rate, parse_rate
from .values import (
    DEFAULT_RULE,
    Check,
    EndpointRule,
    KeptChecks,
    Origin,
    OriginKind,
    Policy,
    Role,
    Scope,
    concurrency_policy,
    policy_from_config,
    positive_int,
)

__all__ = [
    "Assignment",
    "OverrideRule",
    "PolicySnapshot",
    "Window",
    "endpoint_key",
    "endpoint_rule",
    "tier_policies",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: Where the fleet's limits come from, for a loader that says nothing more precise.
FLEET_ORIGIN = Origin(OriginKind.FLEET, "fleet")


@dataclass(frozen=True, slots=True)
class Window:
    """When an assignment or override applies (``None``: no bound on that side)."""

    starts: datetime | None = None
    expires: datetime | None = None

    def covers(self, now: datetime) -> bool:
        return (self.starts is None or self.starts <= now) and (self.expires is None or now < self.expires)


ALWAYS = Window()


@dataclass(frozen=True, slots=True)
class Assignment:
    """A subject placed on a tier: by an assignment row, by ``POLICIES['TIER_FUNC']`` or by default."""

    tier: str
    origin: Origin
    window: Window = ALWAYS
    #: When the subject's billing periods renew (the start of their subscription; ``None``: the
    #: calendar's own starts): the tier's quota by day, week or month is counted from it.
    anchor: datetime | None = None


@dataclass(frozen=True, slots=True)
class OverrideRule:
    """Replacement limits (or a multiplier) for one subject, optionally on one endpoint."""

    id: int
    #: The endpoint it is limited to ("" for every endpoint).
    endpoint: str
    window: Window
    rate: Rate | None
    burst: int | None
    multiplier: float | None
    concurrency: int | None
    shadow: bool
    origin: Origin
    #: The scope of the policy it makes (``None``: its base's).
    scope: Scope | None = None
    #: A replacement quota (``"2000000/month"``), for every endpoint, and its mode ("": the tier's).
    quota: str | None = None
    quota_mode: str = ""

    def quota_of(self, base: Policy | None, *, tier: str, fail_mode: FailMode, anchor: datetime | None) -> Policy:
        """The quota this override makes for a subject of ``tier`` whose quota is ``base`` (``None``:
        the tier has none). Under the tier quota's name, so that what was spent of it in the period
        carries over (as a share of the new limit); in its zone, renewing at the subject's anchor."""
        assert self.quota is not None
        zone, mode = "UTC", self.quota_mode or QuotaMode.HARD
        if parse_calendar_quota(self.quota) is not None and base is not None:
            # A calendar quota takes the tier's zone and mode; a fixed window ("500/h") has neither.
            zone = base.period.zone if base.period is not None else "UTC"
            mode = self.quota_mode or (QuotaMode.SOFT if base.soft else QuotaMode.HARD)
        policy = quota_policy(
            tier,
            self.quota,
            zone=zone,
            mode=mode,
            field=f"override #{self.id}",
            fail_mode=base.fail_mode if base is not None else fail_mode,
            shadow=self.shadow or bool(base is not None and base.shadow),
        )
        return policy.anchored(anchor) if anchor is not None else policy

    def apply(self, base: Policy | None, *, name: str, fail_mode: FailMode) -> Policy | None:
        """The policy this override makes of ``base`` (``None`` if a multiplier has nothing to scale).

        ``fail_mode`` is used when there is no base to take it from.
        """
        algorithm = base.algorithm if base else Algorithm.TOKEN_BUCKET
        scope = self.scope or (base.scope if base else Scope.REGION)
        if scope is Scope.GLOBAL and algorithm is not Algorithm.TOKEN_BUCKET:
            scope = Scope.REGION  # the admin refuses this; a row saved around it limits each region
        if self.rate is not None:
            return Policy(
                name,
                self.rate,
                self.burst or self.rate.limit,
                algorithm,
                base.fail_mode if base else fail_mode,
                self.shadow or bool(base and base.shadow),
                base.tier if base else None,
                base.role if base else Role.RATE,
                scope=scope,
            )
        if base is None or self.multiplier is None:
            return None
        # Scaled within what the store can carry: a multiplier is checked against no tier when saved.
        limit = min(max(round(base.rate.limit * self.multiplier), 1), MAX_LIMIT)
        burst = min(max(round(base.burst * self.multiplier), 1), MAX_BURST)
        burst = min(burst, MAX_REFILL_US * limit // base.rate.period_us)  # rounding can stretch the refill
        return replace(
            base,
            name=name,
            rate=Rate(limit, base.rate.period_us),
            burst=burst,
            shadow=self.shadow or base.shadow,
            scope=scope,
        )


class Resolution(NamedTuple):
    """What one request resolved to, kept by the snapshot (:func:`~.resolver.resolve`)."""

    #: The objects whose ids it is kept under: held, so that no id can be another object's.
    keeps: tuple[Any, ...]
    #: Its ``(check, origin)`` pairs.
    found: tuple[Any, ...]
    #: Its checks alone: what every request so resolved is decided on.
    checks: KeptChecks


@dataclass
class PolicySnapshot:
    """Every policy a source knows, indexed for lookups without queries.

    Loaders fill it in once; the resolver reads it on every request. ``derived``,
    ``placed``, ``resolved`` and ``reported`` are caches the resolver keeps while the snapshot lives.
    """

    #: Each tier's policies: its rate, and if it has them its quota and concurrency limit.
    tiers: dict[str, tuple[Policy, ...]] = field(default_factory=dict)
    #: The tier of callers nobody placed, for ``"anonymous"`` and ``"authenticated"`` callers.
    default_tiers: dict[str, Assignment] = field(default_factory=dict)
    #: Assignments by (subject kind, id), the first one that covers a moment wins.
    assignments: dict[tuple[SubjectKind, str], list[Assignment]] = field(default_factory=dict)
    #: Assignments of IP addresses and networks; the longest prefix that covers an address wins.
    networks: list[tuple[IPNetwork, Assignment]] = field(default_factory=list)
    #: Endpoint rules by ``"METHOD endpoint"`` or ``"endpoint"`` (any method).
    endpoints: dict[str, EndpointRule] = field(default_factory=dict)
    #: Overrides by (subject kind, id), newest first.
    overrides: dict[tuple[SubjectKind, str], list[OverrideRule]] = field(default_factory=dict)
    #: Static backstops per subject kind, with where each is configured.
    dimensions: dict[SubjectKind, tuple[Policy, Origin]] = field(default_factory=dict)
    #: The fleet's in-flight check per priority class (empty: no fleet shedding), and its origin.
    fleet: dict[Priority, Check] = field(default_factory=dict)
    fleet_origin: Origin = FLEET_ORIGIN
    #: The most of the fleet one tenant may hold in flight (``None``: no cap), checked with the fleet.
    fleet_share: Policy | None = None
    #: Where the tiers' limits are edited: the settings (``TIERS``), or the admin's tier table.
    tiers_kind: OriginKind = OriginKind.SETTINGS
    #: Where each tier is set: its row, its setting, or the DRF throttle rate it stands for.
    tier_origins: dict[str, Origin] = field(default_factory=dict)
    #: The fail mode of policies made with no other to inherit (a concurrency-only override).
    default_fail_mode: FailMode = FailMode.OPEN
    #: The policy version the snapshot was read at (0 where there is none, as with settings).
    version: int = 0
    #: When it was loaded, and when its version was last compared with the source's (monotonic seconds).
    loaded_at: float = field(default_factory=time.monotonic)
    checked_at: float = 0.0
    #: Policies derived from overrides, built on first use: a Policy validates itself when made.
    derived: dict[tuple[Any, ...], Policy | None] = field(default_factory=dict)
    #: Where ``POLICIES['TIER_FUNC']`` placed callers, by (tier, anonymous or authenticated), built on first use.
    placed: dict[tuple[str, str], Assignment] = field(default_factory=dict)
    #: What requests resolved to, while it holds no assignment or override, by the ids of what
    #: decides it (:func:`~.resolver.resolve`).
    resolved: dict[tuple[int, ...], Resolution] = field(default_factory=dict)
    #: Tier names ``POLICIES['TIER_FUNC']`` returned that are not tiers here, each logged once (up to a bound).
    reported: set[str] = field(default_factory=set)
    #: DRF throttle rates this snapshot's own policies replace: (DRF's setting, its rate, what
    #: replaces it, that policy), for the system checks to name.
    replaced: list[tuple[str, str, str, str]] = field(default_factory=list)
    #: (policy id, anchor) -> (the policy, it renewing at the anchor): a subject's quota, built on first use.
    anchored_policies: dict[tuple[int, datetime], tuple[Policy, Policy]] = field(default_factory=dict)
    _fleet_resolved: dict[Priority, tuple[Check, Origin]] | None = field(default=None, repr=False)
    #: (asked at, the answer) of :meth:`next_change`, valid until that answer.
    _next_change: tuple[datetime, datetime | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.checked_at = self.checked_at or self.loaded_at

    @property
    def fleet_resolved(self) -> dict[Priority, tuple[Check, Origin]]:
        """The fleet's check per priority class with its origin: the same for every request, so built once."""
        if self._fleet_resolved is None:
            origin = self.fleet_origin
            self._fleet_resolved = {
                priority: (check, Origin(origin.kind, f"{origin.detail}: {priority} priority"))
                for priority, check in self.fleet.items()
            }
        return self._fleet_resolved

    def endpoint_rule(self, endpoint: str, method: str) -> EndpointRule:
        """The rule for ``endpoint`` called with ``method``: a method's own beats any method's."""
        rules = self.endpoints
        return rules.get(f"{method.upper()} {endpoint}") or rules.get(endpoint) or DEFAULT_RULE

    def anchored(self, policy: Policy, anchor: datetime) -> Policy:
        """``policy`` renewing at ``anchor`` (:meth:`Policy.anchored`): one object per pair, kept."""
        key = (id(policy), anchor)
        kept = self.anchored_policies.get(key)
        if kept is None:
            kept = self.anchored_policies[key] = (policy, policy.anchored(anchor))
        return kept[1]

    @property
    def has_windows(self) -> bool:
        """Whether anything here applies only for a while (then resolving needs the time)."""
        return bool(self.assignments or self.networks or self.overrides)

    def next_change(self, now: datetime) -> datetime | None:
        """The first moment after ``now`` an assignment or override starts or ends (``None``: never).

        Until then, a request resolves to the same checks. Worked out once, then again only when
        that moment has passed.
        """
        cached = self._next_change
        if cached is not None and cached[0] <= now and (cached[1] is None or now < cached[1]):
            return cached[1]
        windows = [a.window for entries in self.assignments.values() for a in entries]
        windows += [a.window for _, a in self.networks]
        windows += [o.window for rules in self.overrides.values() for o in rules]
        bounds = [t for w in windows for t in (w.starts, w.expires) if t is not None and t > now]
        answer = min(bounds, default=None)
        self._next_change = (now, answer)
        return answer


def endpoint_key(name: str) -> str:
    """How an endpoint rule is indexed: ``"POST charges"`` (method upper-cased) or ``"charges"``."""
    method, _, rest = name.partition(" ")
    return f"{method.upper()} {rest.strip()}" if rest else name


def quota_policy(
    tier: str, quota: object, *, zone: object, mode: object, field: str, fail_mode: FailMode, shadow: bool = False
) -> Policy:
    """A tier's quota: ``"10000/month"`` per billing period in ``zone``, hard or soft; ``"500/h"`` a fixed window.

    A calendar day, week or month (``"/d"``, ``"/week"``, ``"/month"``) is counted from each
    customer's anchor (:meth:`Policy.anchored`); the plain UTC day, hard, is the epoch-aligned
    fixed window, which counts the same days. Any other period is a fixed window aligned to the
    epoch, and takes neither a zone nor the soft mode.
    """
    quota_mode = QuotaMode.parse(mode, field=f"{field}['quota_mode']")
    zone_name = str(zone)
    zone_info(zone, field=f"{field}['quota_zone']")
    calendar = parse_calendar_quota(quota, zone=zone_name, field=f"{field}['quota']")
    name = f"tier:{tier}:quota"
    soft = quota_mode is QuotaMode.SOFT
    if calendar is None:
        if zone_name != "UTC" or soft:
            raise ConfigurationError(
                f"{field}['quota']: {quota!r}: a quota in a time zone, or a soft one, renews by calendar "
                "day, week or month ('10000/d', '50000/week', '1000000/month')"
            )
        limit = parse_rate(quota, field=f"{field}['quota']")
        return Policy(name, limit, limit.limit, Algorithm.FIXED_WINDOW, fail_mode, shadow, tier, Role.QUOTA)
    count, period = calendar  # its limit already checked, as a rate's is
    if period.is_utc_day and not soft:  # the UTC day, as it has always been counted
        return Policy(name, Rate(count, DAY_US), count, Algorithm.FIXED_WINDOW, fail_mode, shadow, tier, Role.QUOTA)
    rate = Rate(count, LONGEST_US[period.unit])
    return Policy(
        name, rate, count, Algorithm.FIXED_WINDOW, fail_mode, shadow, tier, Role.QUOTA, period=period, soft=soft
    )


def endpoint_slug(name: str) -> str:
    """An endpoint name usable inside a policy name ("POST charges" becomes "POST/charges")."""
    slug = re.sub(r"[^A-Za-z0-9_.:/-]+", "/", name.strip())
    return slug[:150] or "endpoint"


def tier_policies(
    name: str, config: Any, *, field: str, fail_mode: FailMode, shadow: bool = False
) -> tuple[Policy, ...]:
    """A tier's policies from ``{"rate", "burst", "algorithm", "fail_mode", "quota", "quota_zone",
    "quota_mode", "concurrency"}``.

    The rate always; the quota (a fixed window, or a billing period: :func:`quota_policy`) and the
    concurrency limit when given. Every one carries the tier's name and its role.
    """
    rate = policy_from_config(
        f"tier:{name}",
        config,
        field=field,
        default_fail_mode=fail_mode,
        tier=name,
        extra_keys=frozenset({"quota", "quota_zone", "quota_mode", "concurrency"}),
    )
    rate = replace(rate, shadow=shadow) if shadow else rate
    policies = [rate]
    options = config if isinstance(config, Mapping) else {}
    quota = options.get("quota")
    if quota is not None and rate.is_global:
        raise ConfigurationError(
            f"{field}['quota']: a global tier cannot have a quota: a fixed window's count cannot be split "
            f"between regions without over-admitting ({documentation.page('regions', 'not-supported')}); "
            "keep the quota on a regional tier"
        )
    if quota is not None:
        policies.append(
            quota_policy(
                name,
                quota,
                zone=options.get("quota_zone") or "UTC",
                mode=options.get("quota_mode") or QuotaMode.HARD,
                field=field,
                fail_mode=rate.fail_mode,
                shadow=shadow,
            )
        )
    else:  # a zone, or the soft mode, would silently do nothing
        for option, harmless in (("quota_zone", "UTC"), ("quota_mode", QuotaMode.HARD)):
            if options.get(option) not in (None, "", harmless):
                raise ConfigurationError(f"{field}[{option!r}]: there is no quota to apply it to; give 'quota'")
    concurrency = config.get("concurrency") if isinstance(config, Mapping) else None
    if concurrency is not None:
        in_flight = positive_int(concurrency, field=f"{field}['concurrency']")
        policies.append(
            concurrency_policy(
                f"tier:{name}:concurrency", in_flight, fail_mode=rate.fail_mode, shadow=shadow, tier=name
            )
        )
    return tuple(policies)


def endpoint_rule(
    name: str,
    *,
    field: str,
    origin: Origin,
    fail_mode: FailMode,
    cost: Any = 1,
    priority: Any = Priority.NORMAL,
    per_caller: Any = None,
    endpoint_wide: Any = None,
    exempt: bool = False,
    shadow: bool = False,
    counts: Any = Counts.ALL,
    max_cost: Any = None,
) -> EndpointRule:
    """The rule of endpoint ``name``: its cost and priority, which responses it charges and how far
    a request's cost may be trued up, and its own limits (configs or ``None``)."""
    slug = endpoint_slug(name)

    def limit(policy_name: str, config: Any, where: str, role: Role) -> Policy | None:
        if config is None:
            return None
        policy = policy_from_config(policy_name, config, field=where, default_fail_mode=fail_mode, role=role)
        return replace(policy, shadow=True) if shadow else policy

    cost = positive_int(cost, field=f"{field}['cost']")
    if max_cost is not None:
        max_cost = positive_int(max_cost, field=f"{field}['max_cost']")
        if max_cost < cost:
            raise ConfigurationError(
                f"{field}['max_cost']: {max_cost} is less than the cost {cost}, which every request is "
                "admitted at: the most a view may true a request's cost up to is at least that"
            )
    return EndpointRule(
        cost=cost,
        priority=Priority.parse(priority, field=f"{field}['priority']"),
        counts=Counts.parse(counts, field=f"{field}['counts']"),
        max_cost=max_cost,
        per_caller=limit(f"endpoint:{slug}", per_caller, f"{field}['rate']", Role.ENDPOINT),
        endpoint_wide=limit(f"endpoint-all:{slug}", endpoint_wide, f"{field}['endpoint_rate']", Role.ENDPOINT_WIDE),
        exempt=bool(exempt),
        origin=origin,
    )


def exempt_rule(origin: Origin) -> EndpointRule:
    return EndpointRule(exempt=True, origin=origin)


def check_costs(snapshot: PolicySnapshot) -> None:
    """Refuse an endpoint cost above a capacity it meets: every such request would be denied."""
    general = [p for tier in snapshot.tiers.values() for p in tier] + [p for p, _ in snapshot.dimensions.values()]
    for key, rule in snapshot.endpoints.items():
        for policy in general + [p for p in (rule.per_caller, rule.endpoint_wide) if p]:
            capacity = (policy.shard or policy).capacity  # a sharded policy decides in one shard
            if rule.cost > capacity and not policy.holds_slots:
                whose = f"each shard of {policy.name}" if policy.shard else policy.name
                raise ConfigurationError(
                    f"RATELIMITS['ENDPOINTS']['{key}']['cost']: {rule.cost} exceeds the capacity "
                    f"{capacity} of {whose}; every such request would be denied",
                    setting="ENDPOINTS",
                )
