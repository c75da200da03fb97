"""DRF's throttle rates (``REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']``) as ratelimits policies.

A project that swaps DRF's throttle classes for ``RateLimitThrottle`` keeps its limits:

- ``anon`` is the anonymous callers' default tier's rate (``user`` when there is no ``anon``:
  DRF's ``UserRateThrottle`` limits anonymous callers by their address at that rate);
- ``user`` is the authenticated callers' default tier's rate;
- every other scope is the per-caller rate of the endpoint of that name, which is what a view's
  ``throttle_scope`` (and DRF 3.18's ``@throttle_scope``) names, and what a ``RateLimitThrottle``
  subclass's ``scope`` attribute adds to the views it throttles.

Each is a token bucket of the rate with a burst of its count: a caller gets the count at once, as
under DRF, then the rate. Where ``RATELIMITS`` (or, with the database source, the admin's tables)
defines that limit itself, it wins, and the system checks say which DRF rate it replaced
(:func:`replaced_rates`). A rate DRF could not read either fails the checks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from django.conf import settings

from .._process import ProcessWide
from ..choices import FailMode
from ..exceptions import ConfigurationError
from ..rates import Rate
from .snapshot import Assignment, PolicySnapshot, endpoint_key, endpoint_rule, tier_policies
from .values import Origin, OriginKind

__all__ = [
    "FIELD",
    "DrfRates",
    "add_scope_rates",
    "drf_default_tiers",
    "drf_rate",
    "field_of_scope",
    "rate_config",
    "replaced_tiers",
    "throttle_rates",
]

logger = logging.getLogger("ratelimits")

#: Where DRF keeps the rates, as messages name it.
FIELD = "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']"
#: What the check id of a rate that cannot be read is reported under (see ``ratelimits.checks``).
SETTING = "REST_FRAMEWORK.DEFAULT_THROTTLE_RATES"
#: DRF reads a period by its first letter only: "min", "minute" and "m" are all a minute.
_PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RATE = re.compile(r"\s*(?P<count>[0-9]+)\s*/\s*(?P<period>[A-Za-z]+)\s*", re.ASCII)


class DrfRates(NamedTuple):
    """The project's DRF throttle rates: ``None`` where a scope is set to no limit."""

    anon: Rate | None
    user: Rate | None
    #: Every other scope, by name.
    scopes: dict[str, Rate | None]

    @property
    def anonymous(self) -> tuple[str, Rate] | None:
        """The DRF rate anonymous callers were held to, and its scope (``anon``, else ``user``)."""
        if self.anon is not None:
            return "anon", self.anon
        return ("user", self.user) if self.user is not None else None

    @property
    def authenticated(self) -> tuple[str, Rate] | None:
        return ("user", self.user) if self.user is not None else None


def drf_rate(value: object, field: str) -> Rate | None:
    """A rate as DRF reads it (``"100/day"``, ``"5/min"``; ``None`` for no limit), as a :class:`Rate`."""
    if value is None:
        return None
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    if match is not None and match["period"][0].lower() in _PERIODS and int(match["count"]) == 0:
        raise ConfigurationError(
            f"{field}: {value!r} admits nothing: DRF refuses every request under it, and ratelimits takes no rate "
            "of 0. Give a positive rate, or remove it",
            setting=SETTING,
        )
    if match is None or match["period"][0].lower() not in _PERIODS:
        raise ConfigurationError(
            f"{field}: {value!r} is not a rate DRF or ratelimits can read: write it as 'N/period', N a positive "
            "integer and the period one of second, minute, hour or day ('100/day')",
            setting=SETTING,
        )
    seconds = _PERIODS[match["period"][0].lower()]
    return Rate(int(match["count"]), seconds * 1_000_000)


def throttle_rates(*, strict: bool = True) -> DrfRates:
    """``REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']``, read as DRF reads it.

    ``strict`` (the system checks): a :class:`ConfigurationError` names a rate DRF could not read
    either. Otherwise (loading policies, on the request path) such a rate is left out with an
    error in the log: the checks refused it at start, and it is never a 500.
    """
    rest: Any = getattr(settings, "REST_FRAMEWORK", None) or {}
    rates = rest.get("DEFAULT_THROTTLE_RATES") if isinstance(rest, Mapping) else None
    if rates is None:
        return DrfRates(None, None, {})
    if not isinstance(rates, Mapping):
        error = ConfigurationError(f"{FIELD}: expected a dict of scope to rate, got {rates!r}", setting=SETTING)
        if strict:
            raise error
        _log_once(f"{error}; DRF's rates are left out")
        return DrfRates(None, None, {})
    parsed: dict[str, Rate | None] = {}
    for scope, value in rates.items():
        try:
            parsed[str(scope)] = drf_rate(value, field_of_scope(str(scope)))
        except ConfigurationError as error:
            if strict:
                raise
            _log_once(f"{error}; that rate is left out")
    anon, user = parsed.pop("anon", None), parsed.pop("user", None)
    return DrfRates(anon, user, parsed)


#: What :func:`throttle_rates` said: each said once (until the settings change), not at every
#: policy reload. A few lines at most: one per rate the project wrote wrong.
_said: ProcessWide[set[str]] = ProcessWide(set)


def _log_once(message: str) -> None:
    said = _said.get()
    if message not in said:
        said.add(message)
        logger.error("ratelimits: %s", message)


def rate_config(rate: Rate) -> dict[str, Any]:
    """A policy's settings for a DRF rate: the rate, and a burst of its count (DRF's at once)."""
    seconds = rate.period_us // 1_000_000
    return {"rate": f"{rate.limit}/{seconds}s", "burst": rate.limit}


def field_of_scope(scope: str) -> str:
    """``REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['uploads']``."""
    return f"{FIELD}[{scope!r}]"


def describe(rate: Rate) -> str:
    """A DRF rate as DRF's settings say it: ``"2/min"``."""
    period = {1: "sec", 60: "min", 3600: "hour", 86400: "day"}[rate.period_us // 1_000_000]
    return f"{rate.limit}/{period}"


def add_scope_rates(snapshot: PolicySnapshot, rates: DrfRates, fail_mode: FailMode) -> None:
    """Give every DRF scope's rate to the endpoint of that name, where no rule limits it per caller.

    A rule of the endpoint (any method's or one method's) without a per-caller limit takes the
    scope's; an endpoint with no rule of any method gets one. A rule with a per-caller limit of its
    own keeps it, and the snapshot notes which DRF rate it replaced (:attr:`PolicySnapshot.replaced`).
    """
    for scope, rate in rates.scopes.items():
        if rate is None:
            continue  # DRF's "no limit" for the scope
        field = field_of_scope(scope)
        origin = Origin(OriginKind.SETTINGS, field)
        drf = endpoint_rule(scope, field=field, origin=origin, fail_mode=fail_mode, per_caller=rate_config(rate))
        keys = [key for key in snapshot.endpoints if key.partition(" ")[2] == scope or key == scope]
        for key in keys:
            rule = snapshot.endpoints[key]
            if rule.exempt:
                continue
            if rule.per_caller is not None:
                snapshot.replaced.append(
                    (field, describe(rate), rule.per_caller_origin.detail, rule.per_caller.describe())
                )
                continue
            snapshot.endpoints[key] = replace(rule, per_caller=drf.per_caller, per_caller_from=drf.per_caller_origin)
        if endpoint_key(scope) not in keys:
            snapshot.endpoints[endpoint_key(scope)] = drf


def replaced_tiers(snapshot: PolicySnapshot, rates: DrfRates) -> None:
    """Note the DRF ``anon`` and ``user`` rates the snapshot's own default tiers replace."""
    for kind, found in (("anonymous", rates.anonymous), ("authenticated", rates.authenticated)):
        assignment = snapshot.default_tiers.get(kind)
        if found is None or assignment is None:
            continue
        scope, rate = found
        replacing = f"the tier {assignment.tier!r}, {kind} callers' default"
        # A default tier the snapshot does not hold is a disabled one: the admin chose no limits.
        policies = snapshot.tiers.get(assignment.tier)
        now = policies[0].describe() if policies else "no limits (the tier is disabled)"
        snapshot.replaced.append((field_of_scope(scope), describe(rate), replacing, now))


def drf_default_tiers(snapshot: PolicySnapshot, rates: DrfRates, fail_mode: FailMode, names: Mapping[str, str]) -> None:
    """Give the callers no tier of the snapshot places DRF's ``anon`` or ``user`` rate as their tier.

    For a source whose own tiers may leave a kind of caller without a default (the admin's tables
    with no tier the fleet settings or ``POLICIES['DEFAULT_TIERS']`` name): DRF limited them, so
    they stay limited, under the tier name ``names`` gives (``POLICIES['DEFAULT_TIERS']``). A kind
    the snapshot places at all is left alone, on a disabled tier too: that is the admin choosing
    no limits, which :func:`replaced_tiers` reports.
    """
    for kind, found in (("anonymous", rates.anonymous), ("authenticated", rates.authenticated)):
        name = names.get(kind)
        if found is None or name is None or kind in snapshot.default_tiers:
            continue
        scope, rate = found
        field = field_of_scope(scope)
        if name not in snapshot.tiers:
            snapshot.tiers[name] = tier_policies(name, rate_config(rate), field=field, fail_mode=fail_mode)
            snapshot.tier_origins[name] = Origin(OriginKind.SETTINGS, field)
        origin = Origin(OriginKind.SETTINGS, f"default tier for {kind} callers ({field})")
        snapshot.default_tiers[kind] = Assignment(name, origin)
