"""Policies: what a request is checked against, where the policies come from, and the one resolver.

Nothing imported here touches the database: policies and checks, the snapshot both sources
load, the resolver, the ``PolicySource`` protocol and the settings source. (The process's source,
``get_policy_source()``, is whichever class ``POLICIES['SOURCE']`` names, imported when first asked
for.) The admin-managed source, the policy version, the audit trail, import/export and expiry read the
database: they are :mod:`ratelimits.store`, a layer above (this package imports nothing of it).
"""

from .settings import SettingsPolicySource
from .snapshot import PolicySnapshot
from .source import PolicySource, SnapshotPolicySource, get_policy_source
from .values import (
    Check,
    EndpointRule,
    Explained,
    Origin,
    OriginKind,
    Policy,
    Role,
    check_for,
    concurrency_policy,
    fleet_checks,
)

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
