"""The store's key layout: the name and lifetime of every key ratelimits writes, in one place.

A check's state key is ``<prefix>:{<subject digest>}<policy suffix>`` (:meth:`Check.key
<ratelimits.policies.values.Check.key>`): hash-tagged by subject, so one subject's keys share a
Redis Cluster slot; its lifetime comes from the policy (:attr:`Policy.state_ttl_ms
<ratelimits.policies.values.Policy.state_ttl_ms>`) or, for slots, from ``SLOT_TTL``.
"""

from __future__ import annotations

__all__ = [
    "USAGE_TTL_S",
    "VERSION_TTL_S",
    "drain_key",
    "drain_prefix",
    "lease_key",
    "usage_key",
    "usage_prefix",
    "version_key",
]

#: How long the policy version stamp lives after its last publication. If it expires, workers
#: see it lag behind their snapshot and publish it again.
VERSION_TTL_S = 30 * 86_400
#: Usage counters nobody drains expire after this (the decide script is passed this figure).
USAGE_TTL_S = 2 * 86_400


def version_key(prefix: str) -> str:
    """The policy version stamp every decision reads."""
    return f"{prefix}:policy-version"


def usage_prefix(prefix: str) -> str:
    return f"{prefix}:usage:"


def usage_key(prefix: str, minute: int) -> str:
    """The hash of one minute's usage counters (minutes since the epoch)."""
    return f"{usage_prefix(prefix)}{minute}"


def drain_prefix(prefix: str) -> str:
    return f"{prefix}:usage-drain:"


def drain_key(prefix: str, minute: int, batch: str) -> str:
    """A minute's counters once a drain has claimed them (renamed out of the live set)."""
    return f"{drain_prefix(prefix)}{minute}:{batch}"


def lease_key(prefix: str, batch: str) -> str:
    """Held (``SET NX PX``) by the drain applying ``batch`` (a :func:`drain_key`): no other drain takes it meanwhile.

    It expires on its own: a batch whose drain died is taken by another once the lease runs out.
    """
    return f"{prefix}:usage-lease:{batch[len(drain_prefix(prefix)) :]}"
