"""Admin-managed policies as a policy source: an in-process snapshot, reloaded when the version moves.

Workers answer from a snapshot of the policy tables: no database query per request in steady
state. Every committed policy change bumps a version stamp in the limiter's store; every
decision brings the stamp back (in the same round trip), and a worker that sees a new one
reloads before its next request. While the store is unreachable, workers reload on a short
timer instead.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db.models import F
from django.utils import timezone

from .algorithms import Algorithm
from .conf import conf
from .exceptions import BackendUnavailable, ConfigurationError
from .policies import (
    Check,
    EndpointRule,
    Policy,
    _endpoint_key,
    _slug,
    check_for,
    concurrency_policy,
    fleet_checks,
    policy_from_config,
)
from .rates import Rate, parse_rate

if TYPE_CHECKING:
    from django.http import HttpRequest

    from .engine import Decision
    from .identity import Identity, Subject

__all__ = ["DatabasePolicySource", "Explained", "bump_policy_version"]

logger = logging.getLogger("ratelimits")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_DEFAULT_RULE = EndpointRule()


@dataclass(frozen=True)
class _Window:
    """When an assignment or override applies."""

    starts: datetime | None
    expires: datetime | None

    def covers(self, now: datetime) -> bool:
        return (self.starts is None or self.starts <= now) and (self.expires is None or now < self.expires)


@dataclass(frozen=True)
class _Assignment:
    tier: str
    window: _Window
    label: str


@dataclass(frozen=True)
class _Override:
    id: int
    endpoint: str
    window: _Window
    rate: Rate | None
    burst: int | None
    multiplier: float | None
    concurrency: int | None
    shadow: bool
    label: str

    def apply(self, base: Policy | None, *, name: str) -> Policy | None:
        """The policy this override makes of ``base`` (``None`` if a multiplier has nothing to scale)."""
        if self.rate is not None:
            burst = self.burst or self.rate.limit
            return Policy(
                name,
                self.rate,
                burst,
                base.algorithm if base else Algorithm.TOKEN_BUCKET,
                base.fail_mode if base else conf.default_fail_mode,
                self.shadow or bool(base and base.shadow),
            )
        if base is None or self.multiplier is None:
            return None
        limit = max(round(base.rate.limit * self.multiplier), 1)
        burst = max(round(base.burst * self.multiplier), 1)
        return Policy(
            name, Rate(limit, base.rate.period_us), burst, base.algorithm, base.fail_mode, self.shadow or base.shadow
        )


@dataclass
class Snapshot:
    """Everything a worker needs to resolve a request's checks, built from the policy tables."""

    #: The database's policy version when the tables were read.
    version: int
    loaded_at: float
    #: When the version was last compared with the database's (monotonic seconds).
    checked_at: float
    tiers: dict[str, list[Policy]] = field(default_factory=dict)
    assignments: dict[tuple[str, str], list[_Assignment]] = field(default_factory=dict)
    networks: list[tuple[IPNetwork, _Assignment]] = field(default_factory=list)
    endpoints: dict[str, EndpointRule] = field(default_factory=dict)
    overrides: dict[tuple[str, str], list[_Override]] = field(default_factory=dict)
    dimensions: dict[str, Policy] = field(default_factory=dict)
    #: The fleet's in-flight check per priority class (empty: no fleet shedding).
    fleet: dict[str, Check] = field(default_factory=dict)
    #: Policies derived from overrides, by (override id, base policy name), built on first use.
    derived: dict[tuple[int, str], Policy | None] = field(default_factory=dict)
    anonymous_tier: str | None = None
    authenticated_tier: str | None = None


@dataclass(frozen=True)
class Explained:
    """One check of a request and where its values come from (for the effective-policy page)."""

    check: Check
    origin: str


class DatabasePolicySource:
    """Policies from the admin-managed tables (``RATELIMITS['POLICY_SOURCE']`` names this class)."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()

    # -- the PolicySource protocol ---------------------------------------------------------------

    def checks_for(self, request: HttpRequest, identity: Identity) -> list[Check]:
        return [e.check for e in self.explain(request, identity)]

    def endpoint_rule(self, endpoint: str, method: str) -> EndpointRule:
        return _rule(self.snapshot().endpoints, endpoint, method)

    def observe(self, decision: Decision) -> None:
        """Reload when the store's version stamp is ahead of the snapshot; repair it when behind.

        While the store is unreachable, reload every ``POLICY_POLL_INTERVAL``. And every
        ``POLICY_RECHECK_INTERVAL`` compare with the database itself (one query), for changes
        whose publication nobody saw fail (a command run while only its host lost the store).
        """
        snapshot = self._snapshot
        if snapshot is None:
            return
        now = time.monotonic()
        if decision.degraded:
            if now - snapshot.loaded_at > conf.policy_poll_interval:
                self.invalidate()
            return
        if not decision.results:
            # A decision without checks (an exempt endpoint) never reached the store: no stamp.
            return
        stamp = _version(decision.policy_version)
        if stamp > snapshot.version:
            self.invalidate()
        elif stamp < snapshot.version:
            # The store lags behind the database: a publication was lost while it was
            # unreachable, or the stamp expired or was flushed. Publish again, so workers that
            # were idle meanwhile reload too.
            _publish(snapshot.version)
        elif now - snapshot.checked_at > conf.policy_recheck_interval:
            snapshot.checked_at = now
            if _committed_version() > snapshot.version:
                self.invalidate()

    # -- resolution ------------------------------------------------------------------------------

    def explain(self, request: HttpRequest, identity: Identity, *, now: datetime | None = None) -> list[Explained]:
        """Every check for this request with the origin of its values: tier, assignment, override, endpoint."""
        snap = self.snapshot()
        endpoint = identity.endpoint.value
        rule = _rule(snap.endpoints, endpoint, request.method or "GET")
        if rule.exempt:
            return []
        now = now or timezone.now()
        cost = rule.cost
        found: list[Explained] = []
        assigned = {}
        for subject in (identity.api_key, identity.user, identity.organization, identity.ip):
            if subject is not None:
                assignment = self._assignment(snap, subject, now)
                if assignment is not None:
                    assigned[subject] = assignment
        caller = identity.caller
        if caller not in assigned:
            tier = self._default_tier(snap, request, identity)
            if tier is not None:
                assigned[caller] = _Assignment(tier, _Window(None, None), f"default tier for {_kind(identity)}")
        for subject, assignment in assigned.items():
            policies = snap.tiers.get(assignment.tier, [])
            for policy in policies:
                policy, origin = self._overridden(snap, subject, endpoint, policy, now, assignment.label)
                _add(found, policy, subject, cost, origin)
            if not any(p.holds_slots for p in policies):
                in_flight = self._concurrency_override(snap, subject, endpoint, now)
                if in_flight is not None:
                    _add(found, in_flight[0], subject, cost, in_flight[1])
        for kind, policy in snap.dimensions.items():
            subject = {
                "ip": identity.ip,
                "user": identity.user,
                "api_key": identity.api_key,
                "org": identity.organization,
            }[kind]
            if subject is not None:
                _add(found, policy, subject, cost, f"RATELIMITS['DIMENSIONS']['{kind}']")
        if rule.per_caller is not None:
            _add(found, rule.per_caller, caller, cost, "endpoint policy, per caller")
        if rule.endpoint_wide is not None:
            _add(found, rule.endpoint_wide, identity.endpoint, cost, "endpoint policy, all callers")
        fleet = snap.fleet.get(rule.priority)
        if fleet is not None:
            found.append(Explained(fleet, f"fleet settings: {rule.priority} priority"))
        return found

    def _assignment(self, snap: Snapshot, subject: Subject, now: datetime) -> _Assignment | None:
        if subject.kind == "ip":
            address = _address(subject.value)
            best: tuple[int, _Assignment] | None = None
            for network, assignment in snap.networks:
                if (
                    address is not None
                    and address.version == network.version
                    and address in network
                    and assignment.window.covers(now)
                    and (best is None or network.prefixlen > best[0])
                ):
                    best = (network.prefixlen, assignment)
            return best[1] if best else None
        for assignment in snap.assignments.get((subject.kind, subject.value), ()):
            if assignment.window.covers(now):
                return assignment
        return None

    def _default_tier(self, snap: Snapshot, request: HttpRequest, identity: Identity) -> str | None:
        func = conf.tier_func
        if func is not None:
            name = func(request, identity)
            if name is not None and name in snap.tiers:
                return str(name)
        return snap.anonymous_tier if identity.is_anonymous else snap.authenticated_tier

    def _overridden(
        self, snap: Snapshot, subject: Subject, endpoint: str, policy: Policy, now: datetime, origin: str
    ) -> tuple[Policy, str]:
        """An override for this endpoint beats a general one, which beats the tier (quotas are kept)."""
        if policy.name.endswith(":quota"):
            return policy, origin
        if policy.holds_slots:
            in_flight = self._concurrency_override(snap, subject, endpoint, now, name=policy.name)
            return in_flight if in_flight is not None else (policy, origin)
        overrides = [o for o in snap.overrides.get((subject.kind, subject.value), ()) if o.window.covers(now)]
        for wanted, name in ((endpoint, None), ("", policy.name)):
            for override in overrides:
                if override.endpoint == wanted:
                    # Built once per snapshot: a Policy validates itself on construction.
                    key = (override.id, policy.name)
                    if key not in snap.derived:
                        snap.derived[key] = override.apply(policy, name=name or f"override:{override.id}")
                    replaced = snap.derived[key]
                    if replaced is not None:
                        return replaced, override.label
        return policy, origin

    def _concurrency_override(
        self, snap: Snapshot, subject: Subject, endpoint: str, now: datetime, *, name: str | None = None
    ) -> tuple[Policy, str] | None:
        """The in-flight limit an override gives ``subject`` here (endpoint-specific first), if any."""
        overrides = [
            o
            for o in snap.overrides.get((subject.kind, subject.value), ())
            if o.concurrency and o.window.covers(now) and o.endpoint in (endpoint, "")
        ]
        if not overrides:
            return None
        override = min(overrides, key=lambda o: o.endpoint == "")  # this endpoint's beats the general one
        key = (override.id, name or "concurrency")
        if key not in snap.derived:
            policy_name = name or f"override:{override.id}:concurrency"
            snap.derived[key] = concurrency_policy(
                policy_name, override.concurrency or 1, fail_mode=conf.default_fail_mode, shadow=override.shadow
            )
        policy = snap.derived[key]
        return (policy, override.label) if policy is not None else None

    # -- the snapshot ----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        snapshot = self._snapshot
        if snapshot is None:
            with self._lock:
                snapshot = self._snapshot
                if snapshot is None:
                    snapshot = self._snapshot = load_snapshot()
        return snapshot

    def invalidate(self) -> None:
        """Drop the snapshot: the next request reloads it from the database."""
        self._snapshot = None


def load_snapshot() -> Snapshot:
    """Read every policy table once and index it for lookups without queries.

    A row that cannot be turned into a policy (saved around the admin's validation) is left
    out with an error in the log, rather than taking every request down with it.
    """
    from .models import EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier

    # Read first: a change committed while the tables are read then shows as a newer version.
    version = _committed_version()
    now = timezone.now()
    fleet = FleetSettings.objects.filter(pk=1).select_related("anonymous_tier", "authenticated_tier").first()
    default_mode = fleet.default_fail_mode if fleet else conf.default_fail_mode
    global_shadow = bool(fleet and fleet.shadow)
    loaded_at = time.monotonic()
    snap = Snapshot(version=version, loaded_at=loaded_at, checked_at=loaded_at)
    for tier in Tier.objects.filter(enabled=True):
        try:
            snap.tiers[tier.name] = tier_policies(tier, default_mode, global_shadow)
        except ConfigurationError as exc:
            logger.error("ratelimits: tier %s left out: %s", tier.name, exc)
    if fleet is not None:
        thresholds = {
            "low": fleet.shed_low_percent,
            "normal": fleet.shed_normal_percent,
            "high": fleet.shed_high_percent,
        }
        snap.fleet = fleet_checks(fleet.capacity or None, thresholds)
        snap.anonymous_tier = fleet.anonymous_tier.name if fleet.anonymous_tier else None
        snap.authenticated_tier = fleet.authenticated_tier.name if fleet.authenticated_tier else None
    defaults = conf.get("DEFAULT_TIERS")
    snap.anonymous_tier = snap.anonymous_tier or _known(snap, defaults.get("anonymous"))
    snap.authenticated_tier = snap.authenticated_tier or _known(snap, defaults.get("authenticated"))

    assignments: dict[tuple[str, str], list[_Assignment]] = defaultdict(list)
    # The newest start first; one without a start began before any other (NULLs sort first
    # in descending order on PostgreSQL, last on SQLite: say which).
    live = (
        SubjectAssignment.objects.select_related("tier")
        .exclude(expires_at__lte=now)
        .order_by(F("starts_at").desc(nulls_last=True), "-id")
    )
    for row in live:
        entry = _Assignment(
            row.tier.name, _Window(row.starts_at, row.expires_at), f"assignment #{row.pk} ({row.tier.name})"
        )
        if row.subject_kind == "ip":
            try:
                snap.networks.append((ipaddress.ip_network(row.subject_id, strict=False), entry))
            except ValueError:
                logger.error("ratelimits: assignment #%s left out: bad network %r", row.pk, row.subject_id)
        else:
            assignments[(row.subject_kind, row.subject_id)].append(entry)
    snap.assignments = dict(assignments)

    for endpoint in EndpointPolicy.objects.filter(enabled=True):
        try:
            snap.endpoints[_endpoint_key(str(endpoint))] = endpoint_rule(endpoint, default_mode, global_shadow)
        except ConfigurationError as exc:
            logger.error("ratelimits: endpoint policy %s left out: %s", endpoint, exc)
    for name in conf.get("EXEMPT_ENDPOINTS"):
        snap.endpoints[_endpoint_key(str(name))] = EndpointRule(exempt=True)

    overrides: dict[tuple[str, str], list[_Override]] = defaultdict(list)
    for row in Override.objects.filter(enabled=True, expires_at__gt=now).order_by("-created_at", "-id"):
        try:
            rate = parse_rate(row.rate, field=f"override #{row.pk} rate") if row.rate else None
        except ConfigurationError as exc:
            logger.error("ratelimits: %s", exc)
            continue
        overrides[(row.subject_kind, row.subject_id)].append(
            _Override(
                id=row.pk,
                endpoint=row.endpoint,
                window=_Window(None, row.expires_at),
                rate=rate,
                burst=row.burst,
                multiplier=float(row.multiplier) if row.multiplier is not None else None,
                concurrency=row.concurrency,
                shadow=row.shadow or global_shadow,
                label=f"override #{row.pk}: {row.reason[:80]}",
            )
        )
    snap.overrides = dict(overrides)
    for kind, cfg in conf.get("DIMENSIONS").items():
        policy = policy_from_config(
            kind, cfg, field=f"RATELIMITS['DIMENSIONS']['{kind}']", default_fail_mode=default_mode
        )
        # The fleet's shadow switch means every policy, the settings' static backstops included.
        snap.dimensions[kind] = replace(policy, shadow=True) if global_shadow else policy
    return snap


def tier_policies(tier: Any, default_mode: str, global_shadow: bool = False) -> list[Policy]:
    """A tier's rate policy and, if it has one, its quota."""
    mode = tier.fail_mode or default_mode
    config = {"rate": tier.rate, "burst": tier.burst or parse_rate(tier.rate).limit, "algorithm": tier.algorithm}
    policy = policy_from_config(f"tier:{tier.name}", config, field=f"tier {tier.name}", default_fail_mode=mode)
    shadow = tier.shadow or global_shadow
    policies = [Policy(policy.name, policy.rate, policy.burst, policy.algorithm, policy.fail_mode, shadow)]
    if tier.quota:
        quota = parse_rate(tier.quota, field=f"tier {tier.name} quota")
        policies.append(Policy(f"tier:{tier.name}:quota", quota, quota.limit, Algorithm.FIXED_WINDOW, mode, shadow))
    if tier.concurrency:
        policies.append(
            concurrency_policy(f"tier:{tier.name}:concurrency", tier.concurrency, fail_mode=mode, shadow=shadow)
        )
    return policies


def endpoint_rule(endpoint: Any, default_mode: str, global_shadow: bool = False) -> EndpointRule:
    """The rule an ``EndpointPolicy`` row stands for."""
    slug = _slug(str(endpoint))
    shadow = endpoint.shadow or global_shadow

    def limit(name: str, rate: str, burst: int | None) -> Policy | None:
        if not rate:
            return None
        parsed = parse_rate(rate, field=f"endpoint {endpoint} {name}")
        return Policy(name, parsed, burst or parsed.limit, Algorithm.TOKEN_BUCKET, default_mode, shadow)

    return EndpointRule(
        cost=endpoint.cost,
        priority=endpoint.priority,
        per_caller=limit(f"endpoint:{slug}", endpoint.per_caller_rate, endpoint.per_caller_burst),
        endpoint_wide=limit(f"endpoint-all:{slug}", endpoint.endpoint_rate, endpoint.endpoint_burst),
        exempt=endpoint.exempt,
    )


def bump_policy_version() -> None:
    """Tell every worker that policies changed (called when a change commits)."""
    from .engine import get_policy_source

    invalidate = getattr(get_policy_source(), "invalidate", None)
    if invalidate is not None:
        invalidate()
    _publish(_committed_version())


def _publish(version: int) -> None:
    from .engine import get_limiter

    try:
        get_limiter().backend.publish_version(version)
    except BackendUnavailable as exc:
        logger.warning(
            "ratelimits: could not publish policy version %s (%s); workers poll until the store returns", version, exc
        )


def _committed_version() -> int:
    from .models import PolicyVersion

    return PolicyVersion.current()


def _version(stamp: str | None) -> int:
    try:
        return int(stamp or 0)
    except ValueError:
        return 0


def _rule(endpoints: dict[str, EndpointRule], endpoint: str, method: str) -> EndpointRule:
    return endpoints.get(f"{method.upper()} {endpoint}") or endpoints.get(endpoint) or _DEFAULT_RULE


def _add(found: list[Explained], policy: Policy, subject: Subject, cost: int, origin: str) -> None:
    try:
        found.append(Explained(check_for(policy, subject, cost), origin))
    except ConfigurationError as exc:
        # Guardrails refuse such a save; a row written around them must not break requests.
        logger.error("ratelimits: check skipped: %s", exc)


def _known(snap: Snapshot, name: object) -> str | None:
    return name if isinstance(name, str) and name in snap.tiers else None


def _kind(identity: Identity) -> str:
    return "anonymous callers" if identity.is_anonymous else "authenticated callers"


def _address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_network(value, strict=False).network_address
    except ValueError:
        return None
