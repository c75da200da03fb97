"""Policies from ``settings.RATELIMITS``: tiers, dimensions, endpoints and fleet limits, loaded into a snapshot.

The whole configuration is parsed and validated when the source is built (so ``manage.py check``
reports a bad value under its setting's id); each request then costs dictionary look-ups only.
The backstops (``DIMENSIONS``) and exempt endpoints apply under the database source too: its
loader takes them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..choices import FailMode, Priority
from ..conf import Policies, Settings, Shedding, conf
from ..exceptions import ConfigurationError, about_setting
from ..identity import SubjectKind
from ..rates import Rate
from .snapshot import Assignment, PolicySnapshot, check_costs, endpoint_key, endpoint_rule, exempt_rule, tier_policies
from .source import SnapshotPolicySource
from .throttle_rates import DrfRates, add_scope_rates, field_of_scope, rate_config, replaced_tiers, throttle_rates
from .values import EndpointRule, Origin, OriginKind, Policy, Role, fleet_checks, fleet_share_policy, policy_from_config

__all__ = ["SettingsPolicySource", "dimensions_from_settings", "exempt_rules_from_settings"]

_ENDPOINT_KEYS = {"cost", "priority", "rate", "endpoint_rate", "exempt", "counts", "max_cost"}


class SettingsPolicySource(SnapshotPolicySource):
    """Policies from ``settings.RATELIMITS`` (the default ``POLICIES['SOURCE']``, short name ``"settings"``)."""

    def __init__(self) -> None:
        super().__init__()
        # Loaded now, not on the first request: a bad setting fails where the source is built.
        self._snapshot = self._last_good = self.load()

    def load(self) -> PolicySnapshot:
        mode = conf.failure.default_mode
        snapshot = PolicySnapshot(default_fail_mode=mode)
        drf = throttle_rates(strict=False)
        # DRF's anon and user rates stand in for the default tiers' until TIERS is the project's own.
        from_drf = {} if conf.is_set(Settings.tiers) else _drf_tiers(drf)
        with about_setting("TIERS"):
            for name, config in conf.tiers.items():
                field = f"RATELIMITS['TIERS']['{name}']"
                if name in from_drf:
                    scope, rate = from_drf[name]
                    config, field = rate_config(rate), field_of_scope(scope)
                snapshot.tiers[name] = tier_policies(name, config, field=field, fail_mode=mode)
                snapshot.tier_origins[name] = Origin(OriginKind.SETTINGS, field)
        with about_setting(Policies.default_tiers.name):
            for kind in ("anonymous", "authenticated"):
                default = conf.policies.default_tiers.get(kind)
                if default is None or default not in snapshot.tiers:
                    names = ", ".join(map(repr, sorted(snapshot.tiers))) or "none"
                    raise ConfigurationError(
                        f"{Policies.default_tiers.field}['{kind}']: {default!r} is not in {Settings.tiers.field} "
                        f"(its tiers: {names}). A project's TIERS replaces the default tiers whole: name one of its "
                        f"tiers here, or add a tier {default!r}"
                    )
                where = field_of_scope(from_drf[default][0]) if default in from_drf else Policies.default_tiers.field
                detail = f"default tier for {kind} callers ({where})"
                snapshot.default_tiers[kind] = Assignment(default, Origin(OriginKind.SETTINGS, detail))
        if not from_drf:
            replaced_tiers(snapshot, drf)
        snapshot.dimensions = dimensions_from_settings(mode)
        with about_setting("ENDPOINTS"):
            for name, config in conf.endpoints.items():
                snapshot.endpoints[endpoint_key(name)] = _endpoint(name, config, mode)
        add_scope_rates(snapshot, drf, mode)
        snapshot.endpoints.update(exempt_rules_from_settings())
        check_costs(snapshot)
        snapshot.fleet = fleet_checks(
            conf.shedding.fleet_capacity, conf.shedding.thresholds, conf.shedding.fleet_shards
        )
        snapshot.fleet_origin = Origin(OriginKind.SETTINGS, Shedding.fleet_capacity.field)
        snapshot.fleet_share = fleet_share_policy(conf.shedding.fleet_capacity, conf.shedding.tenant_share)
        return snapshot


def _drf_tiers(drf: DrfRates) -> dict[str, tuple[str, Rate]]:
    """The default tiers DRF's ``anon`` and ``user`` rates set, by tier name: (DRF's scope, its rate)."""
    found: dict[str, tuple[str, Rate]] = {}
    for kind, rate in (("anonymous", drf.anonymous), ("authenticated", drf.authenticated)):
        name = conf.policies.default_tiers.get(kind)
        if rate is not None and name is not None:
            found.setdefault(name, rate)
    return found


def _endpoint(name: str, config: object, mode: FailMode) -> EndpointRule:
    field = f"RATELIMITS['ENDPOINTS']['{name}']"
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"{field}: expected a dict, got {config!r}")
    unknown = set(config) - _ENDPOINT_KEYS
    if unknown:
        raise ConfigurationError(f"{field}: unknown keys {', '.join(sorted(unknown))}")
    return endpoint_rule(
        name,
        field=field,
        origin=Origin(OriginKind.SETTINGS, field),
        fail_mode=mode,
        cost=config.get("cost", 1),
        priority=config.get("priority", Priority.NORMAL),
        per_caller=config.get("rate"),
        endpoint_wide=config.get("endpoint_rate"),
        exempt=bool(config.get("exempt", False)),
        counts=config.get("counts", "all"),
        max_cost=config.get("max_cost"),
    )


def dimensions_from_settings(mode: FailMode, *, shadow: bool = False) -> dict[SubjectKind, tuple[Policy, Origin]]:
    """``RATELIMITS['DIMENSIONS']``: one static backstop per subject kind (all shadowed if ``shadow``)."""
    dimensions = {}
    with about_setting("DIMENSIONS"):
        for kind, config in conf.dimensions.items():
            field = f"RATELIMITS['DIMENSIONS']['{kind}']"
            policy = policy_from_config(kind, config, field=field, default_fail_mode=mode, role=Role.DIMENSION)
            dimensions[SubjectKind(kind)] = (
                replace(policy, shadow=True) if shadow else policy,
                Origin(OriginKind.SETTINGS, field),
            )
    return dimensions


def exempt_rules_from_settings() -> dict[str, EndpointRule]:
    """``POLICIES['EXEMPT_ENDPOINTS']``: endpoints never limited."""
    origin = Origin(OriginKind.SETTINGS, Policies.exempt_endpoints.field)
    return {endpoint_key(name): exempt_rule(origin) for name in conf.policies.exempt_endpoints}
