"""Policies: what a request is checked against, where the policies come from, and the one resolver.

Everything imported here is a value or needs only the settings: policies and checks, the
snapshot both sources load, the resolver, and the settings source. The admin-managed source,
the policy version, the audit trail and import/export read the database: they are the modules
``database``, ``versioning``, ``audit`` and ``portability`` of this package.
"""

from .resolver import Explained
from .settings import SettingsPolicySource
from .snapshot import PolicySnapshot
from .source import PolicySource, SnapshotPolicySource, get_policy_source
from .values import Check, EndpointRule, Origin, OriginKind, Policy, Role, check_for, concurrency_policy, fleet_checks

__all__ = [
    "Check",
    "EndpointRule",
    "Explained",
    "Origin",
    "OriginKind",
    "Policy",
    "PolicySnapshot",
    "PolicySource",
    "Role",
    "SettingsPolicySource",
    "SnapshotPolicySource",
    "check_for",
    "concurrency_policy",
    "fleet_checks",
    "get_policy_source",
]
