"""The one resolver: which checks a request is subject to, and where each one's values come from.

Every policy source loads a :class:`~.snapshot.PolicySnapshot`; :func:`explain` reads it for one
request. So settings and the admin's tables resolve alike, and the throttle, ``GET /rate_limit``,
the admin's effective policy page and the ``ratelimits_effective`` command all agree.

Resolution, for the endpoint's rule (an exempt endpoint has no checks):

1. Each of the caller's subjects (API key, user, organisation, client IP) that is assigned to a
   tier gets that tier's policies. The caller (API key, else user, else IP) gets a tier even when
   nothing assigns one: ``POLICIES['TIER_FUNC']``'s, else the default tier of anonymous or
   authenticated callers.
2. An override of a subject replaces its tier's rate: one for this endpoint beats a general one.
   A quota is never overridden; an override's concurrency limit replaces the tier's.
3. Then the per-dimension backstops, the endpoint's own limits (per caller, all callers), and the
   fleet's in-flight limit for the endpoint's priority class.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from django.utils import timezone

from .._memo import remember
from ..conf import Policies, conf
from ..exceptions import ConfigurationError
from ..identity import Identity, Subject, SubjectKind, request_method
from .snapshot import Assignment, PolicySnapshot, Resolution
from .values import (
    Check,
    EndpointRule,
    Explained,
    KeptChecks,
    Origin,
    OriginKind,
    Policy,
    Role,
    check_for,
    concurrency_policy,
)

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = ["default_assignment", "explain", "resolve", "resolve_checks"]

#: One check and where its values come from, as the resolver collects them (a plain tuple: it is
#: built for every check of every request).
Resolved = tuple[Check, Origin]

logger = logging.getLogger("ratelimits")

#: Distinct unknown tier names logged per snapshot: a ``POLICIES['TIER_FUNC']`` echoing client input
#: must not grow it for ever.
REPORTED_NAMES = 100

#: Where a tenant's cap on the fleet comes from: the one setting, whichever source the fleet's capacity has.
_FLEET_SHARE_ORIGIN = Origin(OriginKind.SETTINGS, "SHEDDING['TENANT_SHARE']: one tenant's share of the fleet")


def explain(
    snapshot: PolicySnapshot,
    request: HttpRequest,
    identity: Identity,
    *,
    now: datetime | None = None,
    method: str | None = None,
) -> list[Explained]:
    """Every check ``request`` (made by ``identity``) is subject to, in the order they are decided.

    ``method`` asks about the endpoint called with another method than the request's own.
    """
    found = resolve(snapshot, request, identity, now=now, method=method)
    return [Explained(check, origin.detail, origin.kind) for check, origin in found]


def resolve(
    snapshot: PolicySnapshot,
    request: HttpRequest,
    identity: Identity,
    *,
    now: datetime | None = None,
    method: str | None = None,
) -> list[Resolved]:
    """What :func:`explain` says, as ``(check, origin)`` pairs."""
    found = _resolution(snapshot, request, identity, now, method)
    return list(found.found) if isinstance(found, Resolution) else found


def resolve_checks(snapshot: PolicySnapshot, request: HttpRequest, identity: Identity) -> Sequence[Check]:
    """The checks :func:`resolve` finds for ``request`` now, what ``checks_for`` reads per request:
    the snapshot's :class:`~.values.KeptChecks` when it keeps the resolution (the usual request),
    else a list made for this request."""
    found = _resolution(snapshot, request, identity, None, None)
    return found.checks if isinstance(found, Resolution) else [check for check, _ in found]


def _resolution(
    snapshot: PolicySnapshot,
    request: HttpRequest,
    identity: Identity,
    now: datetime | None,
    method: str | None,
) -> Resolution | list[Resolved]:
    """The request's resolution as the snapshot keeps it, or the pairs of one it does not keep."""
    endpoint = identity.endpoint.value
    rule = snapshot.endpoint_rule(endpoint, method or request_method(request))
    if rule.exempt:
        return []
    if now is not None or snapshot.has_windows:
        now = now or timezone.now()
        return _resolve(snapshot, identity, rule, _placements(snapshot, request, identity, now), now)
    # No assignment or override (each may hold for a while only): the checks follow from the
    # rule, the caller's tier and the request's subjects, all objects made once (a snapshot's,
    # subject_of's), so a request like an earlier one is resolved by their ids. An entry holds
    # them: no id can be another's. (POLICIES['TIER_FUNC'] is asked every time, as before.)
    default = default_assignment(snapshot, request, identity)
    key = (
        id(rule),
        id(default),
        id(identity.api_key),
        id(identity.user),
        id(identity.organization),
        id(identity.ip),
        id(identity.endpoint),
    )
    kept = snapshot.resolved.get(key)
    if kept is not None:
        return kept
    found = _resolve(snapshot, identity, rule, () if default is None else ((identity.caller, default),))
    if any(check.policy.is_shard for check, _ in found):  # a sharded budget's shard is picked per request
        return found
    checks = KeptChecks(check for check, _ in found)
    return remember(snapshot.resolved, key, Resolution((rule, default, identity), tuple(found), checks))


def _resolve(
    snapshot: PolicySnapshot,
    identity: Identity,
    rule: EndpointRule,
    placements: Iterable[tuple[Subject, Assignment]],
    now: datetime | None = None,
) -> list[Resolved]:
    """The checks of a request to ``rule``'s endpoint: each of ``placements``' tier's policies on
    its subject (overridden as of ``now``; ``None``: nothing is overridden), then the
    dimensions, the endpoint's own limits and the fleet's."""
    endpoint = identity.endpoint.value
    cost = rule.cost
    caller = identity.caller
    found: list[Resolved] = []
    for subject, assignment in placements:
        policies = snapshot.tiers.get(assignment.tier, ())
        anchor = assignment.anchor
        for policy in policies:
            if anchor is not None and policy.role is Role.QUOTA:
                policy = snapshot.anchored(policy, anchor)  # the subject's own billing periods
            if now is None:  # nothing can override it
                _add(found, policy, assignment.origin, subject, cost)
            elif policy.role is Role.QUOTA:
                quota = _quota_override(snapshot, subject, now, policy, tier=assignment.tier, anchor=anchor)
                _add(found, *(quota or (policy, assignment.origin)), subject, cost)
            else:
                _add(found, *_overridden(snapshot, subject, endpoint, policy, now, assignment.origin), subject, cost)
        if now is not None and not any(p.role is Role.QUOTA for p in policies):
            # A quota an override gives a subject whose tier has none.
            quota = _quota_override(snapshot, subject, now, None, tier=assignment.tier, anchor=anchor)
            if quota is not None:
                _add(found, *quota, subject, cost)
        if now is not None and not any(p.holds_slots for p in policies):
            in_flight = _concurrency_override(snapshot, subject, endpoint, now, tier=assignment.tier)
            if in_flight is not None:
                _add(found, *in_flight, subject, cost)
    for kind, (policy, origin) in snapshot.dimensions.items():
        dimension = identity.subject(kind)
        if dimension is not None:
            _add(found, policy, origin, dimension, cost)
    if rule.per_caller is not None:
        _add(found, rule.per_caller, rule.per_caller_origin, caller, cost)
    if rule.endpoint_wide is not None:
        _add(found, rule.endpoint_wide, rule.endpoint_wide_origin, identity.endpoint, cost)
    fleet = snapshot.fleet_resolved.get(rule.priority)
    if fleet is not None:
        check, origin = fleet
        # A sharded in-flight set: this request's shard, picked per request.
        found.append(fleet if check.policy.shard is None else (check_for(check.policy, check.subject, 1), origin))
        if snapshot.fleet_share is not None:
            # The tenant's own cap on the fleet: its organisation's requests together, else the caller's.
            _add(found, snapshot.fleet_share, _FLEET_SHARE_ORIGIN, identity.organization or caller, 1)
    return found


def _placements(
    snapshot: PolicySnapshot, request: HttpRequest, identity: Identity, now: datetime
) -> Iterable[tuple[Subject, Assignment]]:
    """Each subject of the request that is on a tier, with its assignment; the caller always is, if it can be."""
    caller = identity.caller
    assigned: dict[Subject, Assignment] = {}
    for subject in (identity.api_key, identity.user, identity.organization, identity.ip):
        if subject is not None:
            assignment = _assignment(snapshot, subject, now)
            if assignment is not None:
                assigned[subject] = assignment
    if caller not in assigned:
        default = default_assignment(snapshot, request, identity)
        if default is not None:
            assigned[caller] = default
    return assigned.items()


def default_assignment(snapshot: PolicySnapshot, request: HttpRequest, identity: Identity) -> Assignment | None:
    """The tier of a caller nothing assigns: ``POLICIES['TIER_FUNC']``'s if it names a tier here, else the default.

    A name that is not a tier here (a typo, a disabled tier) is logged once per snapshot and the
    default tier applies: a bad ``POLICIES['TIER_FUNC']`` result never takes requests down.
    """
    kind = "anonymous" if identity.is_anonymous else "authenticated"
    default = snapshot.default_tiers.get(kind)
    func = conf.policies.tier_func
    if func is not None:
        name = func(request, identity)
        if name is not None:
            if isinstance(name, str) and name in snapshot.tiers:
                placed = snapshot.placed.get((name, kind))
                if placed is None:  # built once per snapshot: POLICIES['TIER_FUNC'] names the same few tiers all day
                    # Named for what placed the caller (not the default it stands in for), and edited where tiers are.
                    origin = Origin(snapshot.tiers_kind, f"{Policies.tier_func.field} returned {name!r}")
                    placed = snapshot.placed[(name, kind)] = Assignment(name, origin)
                return placed
            if repr(name) not in snapshot.reported and len(snapshot.reported) < REPORTED_NAMES:
                snapshot.reported.add(repr(name))
                logger.error(
                    "ratelimits: RATELIMITS['POLICIES']['TIER_FUNC'] returned %r, which is not an enabled tier; "
                    "the callers it names get the default tier instead",
                    name,
                )
    return default


def _assignment(snapshot: PolicySnapshot, subject: Subject, now: datetime) -> Assignment | None:
    if subject.kind is SubjectKind.IP:
        address = _address(subject.value)
        best: tuple[int, Assignment] | None = None
        if address is not None:
            for network, assignment in snapshot.networks:
                if (
                    address.version == network.version
                    and address in network
                    and assignment.window.covers(now)
                    and (best is None or network.prefixlen > best[0])
                ):
                    best = (network.prefixlen, assignment)
        return best[1] if best else None
    for assignment in snapshot.assignments.get((subject.kind, subject.value), ()):
        if assignment.window.covers(now):
            return assignment
    return None


def _overridden(
    snapshot: PolicySnapshot, subject: Subject, endpoint: str, policy: Policy, now: datetime, origin: Origin
) -> tuple[Policy, Origin]:
    """An override for this endpoint beats a general one, which beats the tier (a quota is replaced
    only by an override's own quota: :func:`_quota_override`)."""
    if policy.role is Role.QUOTA:
        return policy, origin
    if policy.holds_slots:
        in_flight = _concurrency_override(snapshot, subject, endpoint, now, tier=policy.tier, name=policy.name)
        return in_flight if in_flight is not None else (policy, origin)
    overrides = [o for o in snapshot.overrides.get((subject.kind, subject.value), ()) if o.window.covers(now)]
    for wanted, name in ((endpoint, None), ("", policy.name)):
        for override in overrides:
            if override.endpoint == wanted:
                key = (override.id, policy.name)
                if key not in snapshot.derived:
                    snapshot.derived[key] = override.apply(
                        policy, name=name or f"override:{override.id}", fail_mode=snapshot.default_fail_mode
                    )
                replaced = snapshot.derived[key]
                if replaced is not None:
                    return replaced, override.origin
    return policy, origin


def _quota_override(
    snapshot: PolicySnapshot,
    subject: Subject,
    now: datetime,
    base: Policy | None,
    *,
    tier: str,
    anchor: datetime | None,
) -> tuple[Policy, Origin] | None:
    """The newest live override of ``subject`` that gives a quota, made of the tier's (``base``)."""
    for override in snapshot.overrides.get((subject.kind, subject.value), ()):
        if override.quota and not override.endpoint and override.window.covers(now):
            key = (override.id, "quota", tier)
            if key not in snapshot.derived:
                snapshot.derived[key] = override.quota_of(
                    base, tier=tier, fail_mode=snapshot.default_fail_mode, anchor=anchor
                )
            derived = snapshot.derived[key]
            assert derived is not None
            return derived, override.origin
    return None


def _concurrency_override(
    snapshot: PolicySnapshot,
    subject: Subject,
    endpoint: str,
    now: datetime,
    *,
    tier: str | None,
    name: str | None = None,
) -> tuple[Policy, Origin] | None:
    """The in-flight limit an override gives ``subject`` here (endpoint-specific first), if any."""
    overrides = [
        o
        for o in snapshot.overrides.get((subject.kind, subject.value), ())
        if o.concurrency and o.window.covers(now) and o.endpoint in (endpoint, "")
    ]
    if not overrides:
        return None
    override = min(overrides, key=lambda o: o.endpoint == "")  # this endpoint's beats the general one
    key = (override.id, name or "concurrency", tier)
    if key not in snapshot.derived:
        snapshot.derived[key] = concurrency_policy(
            name or f"override:{override.id}:concurrency",
            override.concurrency or 1,
            fail_mode=snapshot.default_fail_mode,
            shadow=override.shadow,
            tier=tier,
        )
    policy = snapshot.derived[key]
    return (policy, override.origin) if policy is not None else None


def _add(found: list[Resolved], policy: Policy, origin: Origin, subject: Subject, cost: int) -> None:
    try:
        found.append((check_for(policy, subject, cost), origin))
    except ConfigurationError as exc:
        # Guardrails refuse such a save; a row written around them must not break requests.
        logger.error("ratelimits: check skipped: %s", exc)


def _address(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_network(value, strict=False).network_address
    except ValueError:
        return None
