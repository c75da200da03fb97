"""A caller's current limits, consuming nothing: ``GET /rate_limit``, the admin's page and the command.

All three read :func:`effective_limits`: the policy source explains the request's checks, one
consume-nothing decision reads what is left, and :func:`~ratelimits.decisions.peek` turns each
result into remaining, used and reset. So they list the same checks with the same figures.

A call of ``GET /rate_limit`` itself is limited by :func:`limit_status_call`: by limits of its own,
never by the caller's, which it reports.

The admin page and the ``ratelimits_effective`` command have no request of the caller's: they
build one (:func:`stand_in`) carrying the credential and user objects a real request would, so
``POLICIES['TIER_FUNC']`` and ``IDENTITY['ORGANIZATION_FUNC']`` place the caller as they would place
its requests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import ValidationError
from django.db.models import Model
from django.http import HttpRequest
from rest_framework.request import Request

from .backends import RegionSupport
from .choices import FailMode
from .conf import conf
from .decisions import UNLIMITED, US, Decision, Peek, peek
from .engine import get_limiter
from .exceptions import BackendUnavailable
from .identity import Identity, Subject, SubjectKind, identify, normalize_ip
from .policies.snapshot import endpoint_slug
from .policies.source import get_policy_source
from .policies.values import Check, OriginKind, Policy, Role, policy_from_config
from .usage import today_usage

__all__ = [
    "Caller",
    "EffectiveCheck",
    "EffectiveLimits",
    "RegionShare",
    "current_limits",
    "effective_limits",
    "limit_status_call",
    "quota_checks",
    "stand_in",
]


@dataclass(frozen=True, slots=True)
class RegionShare:
    """This region's part of a global policy (``scope`` ``global``): what it enforces of the limit."""

    region: str | None
    #: The share of the global rate and burst this region enforces now (decayed, if stale).
    share: float
    #: The burst this region holds of the global one (``share`` of it, rounded down).
    capacity: int
    #: When the reconciler last wrote the share (``None``: never: the even split).
    reconciled_at: datetime | None


@dataclass(frozen=True, slots=True)
class EffectiveCheck:
    """One check a caller is subject to, where its values come from, and what is left under it."""

    check: Check
    origin: str
    kind: OriginKind
    #: ``None`` when the store could not be read (the limiter is degraded).
    peek: Peek | None
    #: For a global policy: this region's share of it (``None`` for a regional one).
    region_share: RegionShare | None = None

    @property
    def limit(self) -> int:
        """The capacity the figures are out of: the policy's, or this worker's share of it when decided locally."""
        return self.peek.limit if self.peek is not None else self.check.policy.capacity


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """Every check of one caller on one endpoint, as :func:`effective_limits` found them."""

    identity: Identity
    checks: tuple[EffectiveCheck, ...]
    #: The store could not be read: the checks are listed, what is left is not known.
    degraded: bool


def effective_limits(request: HttpRequest, identity: Identity, *, method: str | None = None) -> EffectiveLimits:
    """Every check ``request`` (called with ``method``) is subject to, and what is left under each; spends nothing.

    None with ``RATELIMITS['ENABLED']`` off: no request is limited then, and the store is not asked.
    """
    if not conf.enabled:
        return EffectiveLimits(identity, (), degraded=False)
    source = get_policy_source()
    explained = source.explain(request, identity, method=method)
    decision = get_limiter().decide([e.check for e in explained], consume=False)
    source.observe(decision)
    # Matched by policy and subject: a degraded decision has results only for the checks it could
    # decide in this process (fail mode "local"), under the same names.
    results = {(r.check.policy.name, r.check.subject): r for r in decision.results}
    shares = _region_shares([e.check for e in explained if e.check.policy.is_global], decision.now_us)
    checks = []
    for entry in explained:
        result = results.get((entry.check.policy.name, entry.check.subject))
        share = shares.get(entry.check) if entry.check.policy.is_global else None
        part = share.share if share is not None and share.share > 0 else 1.0
        seen = peek(result, now_us=decision.now_us, share=part) if result is not None else None
        checks.append(EffectiveCheck(entry.check, entry.origin, entry.kind, seen, share))
    return EffectiveLimits(identity, tuple(checks), decision.degraded)


def _region_shares(checks: list[Check], now_us: int) -> dict[Check, RegionShare]:
    """This region's share of each global check (the even split where the reconciler wrote none)."""
    if not checks:
        return {}
    backend = get_limiter().backend
    if not isinstance(backend, RegionSupport):
        return {}  # no reconciler writes to it: every region keeps the even split
    try:
        records = backend.shares(checks)
    except BackendUnavailable:
        return {}
    found = {}
    for check in checks:
        record = records.get(check.key(backend.prefix))
        share = record.effective(now_us) if record else check.policy.even_share
        written = datetime.fromtimestamp(record.written_us / US, UTC) if record else None
        found[check] = RegionShare(conf.regions.current, share, int(check.policy.burst * share + 1e-9), written)
    return found


def current_limits(request: Request, *, endpoint: str, method: str | None = None) -> dict[str, Any]:
    """``GET /rate_limit``: every policy that applies to the caller of ``request`` calling ``method endpoint``.

    ``method`` defaults to the request's own.
    """
    identity = identify(request, endpoint=endpoint, auth=request.auth, user=request.user)
    method = method or request.method or "GET"
    limits = effective_limits(request, identity, method=method)
    resources = []
    for entry in limits.checks:
        policy = entry.check.policy
        seen = entry.peek
        resources.append(
            {
                "policy": policy.name,
                "subject": entry.check.subject.kind,
                "description": policy.describe(),
                "algorithm": policy.algorithm.value,
                "limit": entry.limit,
                "remaining": seen.remaining if seen else None,
                "used": seen.used if seen else None,
                "reset": seen.reset_at if seen else None,
                "window_seconds": policy.window_seconds,
                "cost": entry.check.cost,
                "scope": policy.scope.value,
                # Where it is set: a tier, an assignment or an override (the admin's tables), an
                # endpoint policy, the fleet, or the settings. The detail (an override's reason, a
                # setting's name) is the operator's: the admin's page and the command show it.
                "origin": str(entry.kind),
                **(_region_fields(entry.region_share) if entry.region_share else {}),
                **_period_fields(policy),
            }
        )
    return {
        "endpoint": endpoint,
        "method": method,
        "degraded": limits.degraded,
        "resources": resources,
        "today": today_usage(identity.caller),
    }


def quota_checks(request: HttpRequest, identity: Identity) -> list[Check]:
    """The caller's quotas by billing period, as the policy source resolves its requests (spends nothing).

    Those on the caller or its organisation: the subjects usage is recorded under (a quota placed
    on a user whose requests carry API keys is counted in the store, not in the usage records).
    """
    source = get_policy_source()
    counted = {identity.caller, identity.organization}
    explained = source.explain(request, identity)
    return [
        entry.check
        for entry in explained
        if entry.check.policy.billing_period is not None and entry.check.subject in counted
    ]


def _period_fields(policy: Policy) -> dict[str, Any]:
    """A quota by billing period: the period in force now, in the caller's zone, from their anchor."""
    period = policy.billing_period
    if period is None:
        return {}
    now = datetime.now(UTC)
    return {
        "period_unit": period.unit.value,
        "period_zone": period.zone,
        "period_start": period.start(now).isoformat(),
        "period_end": period.next_start(now).isoformat(),
        "soft": policy.soft,
    }


def _region_fields(share: RegionShare) -> dict[str, Any]:
    """A global policy's figures in this region: ``limit`` stays the global burst, ``remaining`` is this region's."""
    return {
        "region": share.region,
        "region_share": round(share.share, 6),
        "region_limit": share.capacity,
        "reconciled_at": share.reconciled_at.isoformat() if share.reconciled_at else None,
    }


def limit_status_call(request: Request, *, endpoint: str, rate: str, burst: int) -> Decision:
    """Decide a call of the status endpoint ``endpoint`` against its own limits only; consume from them.

    Asking what is left must not spend it (GitHub's ``GET /rate_limit`` does not count either), so
    the caller's tiers, overrides and backstops are left alone. Yet each call costs a store round
    trip and a database sum: it is limited per caller by its endpoint policy's per-caller limit, or
    by ``rate`` and ``burst`` when that gives none, and by the policy's all-callers limit if it has
    one. An exempt endpoint policy exempts it. Not counted in usage: it reads usage, it is not use.
    With ``RATELIMITS['ENABLED']`` off it is not limited either.
    """
    if not conf.enabled:
        return UNLIMITED
    identity = identify(request, endpoint=endpoint, auth=request.auth, user=request.user)
    source = get_policy_source()
    rule = source.endpoint_rule(endpoint, request.method or "GET")
    checks = []
    if not rule.exempt:
        own = rule.per_caller or _status_policy(endpoint, rate, max(burst, rule.cost), conf.failure.default_mode)
        checks.append(Check(own, identity.caller, rule.cost))
        if rule.endpoint_wide is not None:
            checks.append(Check(rule.endpoint_wide, identity.endpoint, rule.cost))
    decision = get_limiter().decide(checks)
    source.observe(decision)
    return decision


@functools.lru_cache(maxsize=16)
def _status_policy(endpoint: str, rate: str, burst: int, fail_mode: FailMode) -> Policy:
    """The built-in per-caller limit, named as an endpoint policy's would be: built once, not per call."""
    config = {"rate": rate, "burst": burst}
    name = f"endpoint:{endpoint_slug(endpoint)}"
    return policy_from_config(name, config, field=f"{name} (built in)", default_fail_mode=fail_mode, role=Role.ENDPOINT)


@dataclass(frozen=True, slots=True)
class Caller:
    """A request as a caller would make it, for explaining its limits without one."""

    request: HttpRequest
    identity: Identity
    #: The API key object found for the caller's API key identifier (``IDENTITY['API_KEY_MODEL']``), if any.
    credential: Model | None


def stand_in(
    *,
    endpoint: str,
    method: str = "GET",
    api_key: str = "",
    user: str = "",
    org: str = "",
    ip: str = "",
) -> Caller:
    """The request and identity of a caller given by its identities (as the admin page takes them).

    The request carries ``auth`` (the API key's object, when ``IDENTITY['API_KEY_MODEL']`` finds one
    whose ``IDENTITY['API_KEY_FUNC']`` identifier is ``api_key``), ``user`` and the client address,
    so functions that place callers see what they would see in the caller's requests. An identity
    given here (an organisation typed in) wins over what they derive.
    """
    request = HttpRequest()
    request.method = method.upper()
    credential = find_credential(api_key) if api_key else None
    user_object = get_user_model()._default_manager.filter(pk=user).first() if user.isdigit() else None
    address = normalize_ip(ip) if ip else None
    if address is not None:
        request.META["REMOTE_ADDR"] = str(address)
    request.auth = credential  # type: ignore[attr-defined]  # what DRF's authentication sets
    request.user = user_object or AnonymousUser()
    identity = identify(request, endpoint=endpoint, auth=credential, user=user_object)
    identity = replace(
        identity,
        api_key=Subject(SubjectKind.API_KEY, api_key) if api_key else identity.api_key,
        user=Subject(SubjectKind.USER, user) if user else identity.user,
        organization=Subject(SubjectKind.ORG, org) if org else identity.organization,
    )
    return Caller(request, identity, credential)


def find_credential(identifier: str) -> Model | None:
    """The ``IDENTITY['API_KEY_MODEL']`` object ``identifier`` names, if there is one.

    The default identifier is ``"<model name>:<primary key>"``; any other must still come back
    from ``IDENTITY['API_KEY_FUNC']`` for the object found, or nothing is found.
    """
    model = conf.identity.api_key_model
    name, _, pk = identifier.partition(":")
    if model is None or name != model.__name__ or not pk:
        return None
    try:
        found = model._default_manager.filter(pk=pk).first()
    except (ValueError, TypeError, ValidationError):
        return None
    return found if found is not None and str(conf.identity.api_key_func(found)) == identifier else None
