"""What to check: policies, the checks a request is subject to, and where policies come from."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from .algorithms import RATE_ALGORITHMS, Algorithm
from .conf import conf, fail_mode
from .exceptions import ConfigurationError
from .rates import MAX_LIMIT, Rate, parse_rate

if TYPE_CHECKING:
    from django.http import HttpRequest

    from .engine import Decision
    from .identity import Identity, Subject

__all__ = [
    "PRIORITIES",
    "Check",
    "EndpointRule",
    "Policy",
    "PolicySource",
    "SettingsPolicySource",
    "check_for",
    "concurrency_policy",
    "fleet_checks",
]

PRIORITIES = ("critical", "high", "normal", "low")

# Policy names appear in Redis keys and headers: keep them to characters that need no quoting
# and can never form a Redis Cluster hash tag.
_POLICY_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,200}", re.ASCII)


@dataclass(frozen=True, slots=True)
class Policy:
    """A named limit: ``rate`` with ``burst`` capacity, counted by ``algorithm``."""

    name: str
    rate: Rate
    burst: int
    algorithm: Algorithm = Algorithm.TOKEN_BUCKET
    fail_mode: str = "open"
    #: Evaluated and counted, reported when it would deny, but never denies.
    shadow: bool = False

    #: The most a subject can spend at once: the burst for a bucket, the limit for windows.
    capacity: int = field(init=False, repr=False, compare=False)
    #: The policy's part of the decide script's ARGV, as strings built once (see ``lua/decide.lua``).
    script_args: tuple[str, ...] = field(init=False, repr=False, compare=False)
    #: What follows the subject in this policy's state keys.
    key_suffix: str = field(init=False, repr=False, compare=False)
    #: Whether a check of this policy holds a slot until its request finishes (read per request).
    holds_slots: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _POLICY_NAME.fullmatch(self.name):
            raise ConfigurationError(f"policy name {self.name!r} must match {_POLICY_NAME.pattern}")
        positive_int(self.burst, field=f"{self.name}: burst")
        fail_mode(self.fail_mode, field=f"{self.name}: fail_mode")
        # Derived once here: both are read on every decision.
        capacity = self.burst if self.algorithm is Algorithm.TOKEN_BUCKET else self.rate.limit
        object.__setattr__(self, "capacity", capacity)
        args = (self.algorithm.code, self.rate.limit, self.rate.period_us, self.burst, self.state_ttl_ms)
        object.__setattr__(self, "script_args", (*(str(arg) for arg in args), "1" if self.shadow else "0"))
        object.__setattr__(self, "key_suffix", f":{self.name}:{self.algorithm.code}")
        object.__setattr__(self, "holds_slots", self.algorithm.holds_slots)

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
            span = -(-self.burst * period // self.rate.limit)
        elif self.algorithm is Algorithm.SLIDING_WINDOW:
            span = 2 * period
        else:
            span = period
        return -(-span // 1000) + 1000

    @property
    def window_seconds(self) -> int:
        """Seconds over which ``capacity`` is granted (refill time of a full bucket), rounded up."""
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            return max(-(-self.burst * self.rate.period_us // (self.rate.limit * 1_000_000)), 1)
        return max(-(-self.rate.period_us // 1_000_000), 1)

    def describe(self) -> str:
        if self.algorithm.holds_slots:
            return f"{self.rate.limit} in flight"
        text = self.rate.describe()
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            return f"{text}, burst {self.burst}"
        return f"{text} ({self.algorithm.value.replace('_', ' ')})"

    def scaled(self, share: float, *, at_least: int = 1) -> Policy:
        """This policy cut down to ``share`` of its rate and burst (for per-process fallback).

        The capacity never drops below ``at_least``: a request whose cost fits the real policy
        must still fit this worker's share of it, or it could never be admitted.
        """
        if share >= 1:
            return self
        limit = max(int(self.rate.limit * share), 1)
        burst = max(int(self.burst * share), 1)
        if self.algorithm is Algorithm.TOKEN_BUCKET:
            burst = max(burst, at_least)
        else:
            limit = max(limit, at_least)
        return replace(self, rate=Rate(limit, self.rate.period_us), burst=burst)


@dataclass(frozen=True, slots=True)
class Check:
    """One policy applied to one subject, spending ``cost`` tokens."""

    policy: Policy
    subject: Subject
    cost: int = 1

    def __post_init__(self) -> None:
        if type(self.cost) is int and 0 < self.cost <= self.policy.capacity:
            return  # the common case, checked in one expression: checks are built per request
        positive_int(self.cost, field=f"{self.policy.name}: cost")
        if self.cost > self.policy.capacity:
            raise ConfigurationError(
                f"{self.policy.name}: cost {self.cost} exceeds its capacity {self.policy.capacity}; "
                "such a request could never be admitted"
            )

    def key(self, prefix: str) -> str:
        """The state key: hash-tagged by subject, so one subject's keys share a Cluster slot."""
        return f"{prefix}:{{{self.subject.digest}}}{self.policy.key_suffix}"


@dataclass(frozen=True, slots=True)
class EndpointRule:
    """How one endpoint is treated: its cost, priority and its own limits."""

    cost: int = 1
    priority: str = "normal"
    per_caller: Policy | None = None
    endpoint_wide: Policy | None = None
    exempt: bool = False


class PolicySource(Protocol):
    """Where the checks for a request come from (settings today, the admin's models later)."""

    def checks_for(self, request: HttpRequest, identity: Identity) -> list[Check]:
        """Every check that applies to this request, each with its cost."""

    def endpoint_rule(self, endpoint: str, method: str) -> EndpointRule:
        """The rule for an endpoint and HTTP method (a default rule if none is configured)."""

    def observe(self, decision: Decision) -> None:
        """Called with every decision: a source that caches can notice a new policy version."""


def policy_from_config(
    name: str, config: Any, *, field: str, default_fail_mode: str, extra_keys: frozenset[str] = frozenset()
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
    unknown = set(config) - {"rate", "burst", "algorithm", "fail_mode"} - extra_keys
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}")
    if "rate" not in config:
        raise ConfigurationError(f"{field}: 'rate' is required")
    rate = parse_rate(config["rate"], field=rate_field)
    burst = positive_int(config.get("burst", rate.limit), field=f"{field}['burst']")
    algorithm_name = config.get("algorithm", Algorithm.TOKEN_BUCKET.value)
    if algorithm_name not in [a.value for a in RATE_ALGORITHMS]:
        names = ", ".join(a.value for a in RATE_ALGORITHMS)
        raise ConfigurationError(f"{field}['algorithm']: {algorithm_name!r} must be one of {names}")
    algorithm = Algorithm(algorithm_name)
    mode = fail_mode(config.get("fail_mode", default_fail_mode), field=f"{field}['fail_mode']")
    try:
        return Policy(name=name, rate=rate, burst=burst, algorithm=algorithm, fail_mode=mode)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{field}: {exc}") from None


def concurrency_policy(name: str, limit: int, *, fail_mode: str, shadow: bool = False) -> Policy:
    """At most ``limit`` requests of one subject in flight; slots expire after ``SLOT_TTL``."""
    return Policy(name, Rate(limit, conf.slot_ttl_us), limit, Algorithm.CONCURRENCY, fail_mode, shadow)


def fleet_checks(capacity: int | None, thresholds: Mapping[str, int]) -> dict[str, Check]:
    """The fleet's in-flight check per priority class: lower classes are shed at a lower share.

    Critical requests are never shed, but still hold a slot: they take capacity too. Without a
    capacity there is no fleet shedding at all.
    """
    if capacity is None:
        return {}
    from .identity import Subject

    subject = Subject("fleet", "in-flight")
    checks = {}
    for priority in PRIORITIES:
        percent = thresholds.get(priority)
        limit = MAX_LIMIT if percent is None else max(capacity * percent // 100, 1)
        # Fails open: without Redis the fleet cannot be counted; the worker shedder still works.
        policy = Policy("fleet", Rate(limit, conf.slot_ttl_us), limit, Algorithm.FLEET, "open")
        checks[priority] = Check(policy, subject, 1)
    return checks


def check_for(policy: Policy, subject: Subject, cost: int) -> Check:
    """A check of ``policy`` on ``subject``: a request takes one slot, whatever its cost in tokens."""
    return Check(policy, subject, 1 if policy.holds_slots else cost)


def positive_int(value: object, *, field: str) -> int:
    """``value`` if it is an integer of at least 1 (booleans are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{field}: {value!r} must be a positive integer")
    return value


class SettingsPolicySource:
    """Policies from ``settings.RATELIMITS``: tiers, per-dimension limits and endpoint rules.

    The whole configuration is parsed and validated once (errors name the setting), then
    each request costs dictionary look-ups only.
    """

    def __init__(self) -> None:
        self.default_fail_mode = conf.default_fail_mode
        tiers = conf.get("TIERS")
        if not isinstance(tiers, Mapping) or not tiers:
            raise ConfigurationError("RATELIMITS['TIERS'] must be a non-empty dict of tier name to policy")
        self.tiers: dict[str, list[Policy]] = {name: self._tier(name, cfg) for name, cfg in tiers.items()}
        defaults = conf.get("DEFAULT_TIERS")
        if not isinstance(defaults, Mapping):
            raise ConfigurationError("RATELIMITS['DEFAULT_TIERS'] must be a dict with 'anonymous' and 'authenticated'")
        for kind in ("anonymous", "authenticated"):
            if defaults.get(kind) not in self.tiers:
                raise ConfigurationError(
                    f"RATELIMITS['DEFAULT_TIERS']['{kind}']: {defaults.get(kind)!r} is not in RATELIMITS['TIERS']"
                )
        self.default_tiers: dict[str, str] = {kind: str(name) for kind, name in defaults.items()}
        dimensions = conf.get("DIMENSIONS")
        if not isinstance(dimensions, Mapping):
            raise ConfigurationError("RATELIMITS['DIMENSIONS'] must be a dict of subject kind to policy")
        self.dimensions: dict[str, Policy] = {}
        for kind, cfg in dimensions.items():
            if kind not in ("ip", "user", "api_key", "org"):
                raise ConfigurationError(f"RATELIMITS['DIMENSIONS']: {kind!r} must be one of ip, user, api_key, org")
            self.dimensions[kind] = self._policy(f"{kind}", cfg, f"RATELIMITS['DIMENSIONS']['{kind}']")
        self.endpoints = self._endpoints(conf.get("ENDPOINTS"), conf.get("EXEMPT_ENDPOINTS"))
        self._validate_costs()
        self.fleet = fleet_checks(conf.fleet_capacity, conf.shed_thresholds)

    def _policy(self, name: str, cfg: Any, field: str, extra_keys: frozenset[str] = frozenset()) -> Policy:
        return policy_from_config(
            name, cfg, field=field, default_fail_mode=self.default_fail_mode, extra_keys=extra_keys
        )

    def _tier(self, name: str, cfg: Any) -> list[Policy]:
        field = f"RATELIMITS['TIERS']['{name}']"
        policies = [self._policy(f"tier:{name}", cfg, field, frozenset({"quota", "concurrency"}))]
        quota = cfg.get("quota") if isinstance(cfg, Mapping) else None
        if quota is not None:
            rate = parse_rate(quota, field=f"{field}['quota']")
            policies.append(
                Policy(f"tier:{name}:quota", rate, rate.limit, Algorithm.FIXED_WINDOW, policies[0].fail_mode)
            )
        concurrency = cfg.get("concurrency") if isinstance(cfg, Mapping) else None
        if concurrency is not None:
            limit = positive_int(concurrency, field=f"{field}['concurrency']")
            policies.append(concurrency_policy(f"tier:{name}:concurrency", limit, fail_mode=policies[0].fail_mode))
        return policies

    def _endpoints(self, config: Any, exempt: Any) -> dict[str, EndpointRule]:
        if not isinstance(config, Mapping):
            raise ConfigurationError("RATELIMITS['ENDPOINTS'] must be a dict of endpoint to rule")
        rules: dict[str, EndpointRule] = {}
        for name, cfg in config.items():
            field = f"RATELIMITS['ENDPOINTS']['{name}']"
            if not isinstance(cfg, Mapping):
                raise ConfigurationError(f"{field}: expected a dict, got {cfg!r}")
            unknown = set(cfg) - {"cost", "priority", "rate", "endpoint_rate", "exempt"}
            if unknown:
                raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}")
            cost = positive_int(cfg.get("cost", 1), field=f"{field}['cost']")
            priority = cfg.get("priority", "normal")
            if priority not in PRIORITIES:
                raise ConfigurationError(f"{field}['priority']: {priority!r} must be one of {', '.join(PRIORITIES)}")
            slug = _slug(name)
            per_caller = cfg.get("rate")
            endpoint_wide = cfg.get("endpoint_rate")
            rules[_endpoint_key(name)] = EndpointRule(
                cost=cost,
                priority=priority,
                per_caller=self._policy(f"endpoint:{slug}", per_caller, f"{field}['rate']")
                if per_caller is not None
                else None,
                endpoint_wide=self._policy(f"endpoint-all:{slug}", endpoint_wide, f"{field}['endpoint_rate']")
                if endpoint_wide is not None
                else None,
                exempt=bool(cfg.get("exempt", False)),
            )
        if isinstance(exempt, str) or not isinstance(exempt, (list, tuple)):
            raise ConfigurationError("RATELIMITS['EXEMPT_ENDPOINTS'] must be a list of endpoint names")
        for name in exempt:
            rules[_endpoint_key(str(name))] = EndpointRule(exempt=True)
        return rules

    def _validate_costs(self) -> None:
        """A cost above any capacity it meets would deny every such request: refuse it now."""
        general = [p for tier in self.tiers.values() for p in tier] + list(self.dimensions.values())
        for key, rule in self.endpoints.items():
            for policy in general + [p for p in (rule.per_caller, rule.endpoint_wide) if p]:
                if rule.cost > policy.capacity and not policy.holds_slots:
                    raise ConfigurationError(
                        f"RATELIMITS['ENDPOINTS']['{key}']['cost']: {rule.cost} exceeds the capacity "
                        f"{policy.capacity} of {policy.name}; every such request would be denied"
                    )

    def endpoint_rule(self, endpoint: str, method: str) -> EndpointRule:
        rules = self.endpoints
        return rules.get(f"{method.upper()} {endpoint}") or rules.get(endpoint) or _DEFAULT_RULE

    def observe(self, decision: Decision) -> None:
        """Settings only change with a restart (or ``override_settings``): nothing to notice."""

    def tier_for(self, request: HttpRequest, identity: Identity) -> str:
        """The caller's tier: ``TIER_FUNC`` if it names one, else the default for its kind."""
        func = conf.tier_func
        if func is not None:
            name = func(request, identity)
            if name is not None:
                if name not in self.tiers:
                    raise ConfigurationError(f"RATELIMITS['TIER_FUNC'] returned unknown tier {name!r}")
                return str(name)
        return self.default_tiers["anonymous" if identity.is_anonymous else "authenticated"]

    def checks_for(self, request: HttpRequest, identity: Identity) -> list[Check]:
        endpoint = identity.endpoint.value
        rule = self.endpoint_rule(endpoint, request.method or "GET")
        if rule.exempt:
            return []
        cost = rule.cost
        caller = identity.caller
        checks = [check_for(policy, caller, cost) for policy in self.tiers[self.tier_for(request, identity)]]
        subjects = {"ip": identity.ip, "user": identity.user, "api_key": identity.api_key, "org": identity.organization}
        for kind, policy in self.dimensions.items():
            subject = subjects[kind]
            if subject is not None:
                checks.append(Check(policy, subject, cost))
        if rule.per_caller is not None:
            checks.append(Check(rule.per_caller, caller, cost))
        if rule.endpoint_wide is not None:
            checks.append(Check(rule.endpoint_wide, identity.endpoint, cost))
        fleet = self.fleet.get(rule.priority)
        if fleet is not None:
            checks.append(fleet)
        return checks


_DEFAULT_RULE = EndpointRule()


def _endpoint_key(name: str) -> str:
    method, _, rest = name.partition(" ")
    return f"{method.upper()} {rest.strip()}" if rest else name


def _slug(name: str) -> str:
    """An endpoint name usable inside a policy name ("POST charges" becomes "POST/charges")."""
    slug = re.sub(r"[^A-Za-z0-9_.:/-]+", "/", name.strip())
    return slug[:150] or "endpoint"
