"""The store's key layout: the name and lifetime of every key ratelimits writes, in one place.

A check's state key is ``<prefix>:{<subject digest>}<policy suffix>`` (:meth:`Check.key
<ratelimits.policies.values.Check.key>`): hash-tagged by subject, so one subject's keys share a
Redis Cluster slot; its lifetime comes from the policy (:attr:`Policy.state_ttl_ms
<ratelimits.policies.values.Policy.state_ttl_ms>`) or, for slots, from ``SHEDDING['SLOT_TTL']``.

On a Redis Cluster a script may only touch keys of one slot, so the keys every request touches
(the version stamp, the usage counters) have a copy per slot: the same name with the slot's
:func:`slot_tag` as its hash tag. A request's group of checks in slot ``s`` reads the stamp and
counts its usage in slot ``s``; no key is touched by every request, and none pins one node.
"""

from __future__ import annotations

import functools

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = [
    "DEMAND_TTL_S",
    "REDIS_CLUSTER_HASH_SLOTS",
    "USAGE_TTL_S",
    "VERSION_TTL_S",
    "demand_key",
    "drain_key",
    "drain_prefix",
    "key_slot",
    "lease_key",
    "reconciled_key",
    "share_key",
    "slot_tag",
    "usage_key",
    "usage_prefix",
    "version_key",
    "workers_key",
]

#: How long the policy version stamp lives after its last publication. If it expires, workers
#: see it lag behind their snapshot and publish it again.
VERSION_TTL_S = 30 * 86_400
#: Usage counters nobody drains expire after this (the decide script is passed this figure).
USAGE_TTL_S = 2 * 86_400


def _base(prefix: str, tag: str | None) -> str:
    # ``#`` after the tag: a state key always has ``:`` there, and policy names cannot hold ``#``.
    return f"{prefix}:" if tag is None else f"{prefix}:{{{tag}}}#"


def version_key(prefix: str, tag: str | None = None) -> str:
    """The policy version stamp every decision reads (on a cluster, the copy of the slot ``tag`` hashes to)."""
    return f"{_base(prefix, tag)}policy-version"


def usage_prefix(prefix: str, tag: str | None = None) -> str:
    return f"{_base(prefix, tag)}usage:"


def usage_key(prefix: str, minute: int, tag: str | None = None) -> str:
    """The hash of one minute's usage counters (minutes since the epoch); on a cluster, one per slot."""
    return f"{usage_prefix(prefix, tag)}{minute}"


def drain_prefix(prefix: str, tag: str | None = None) -> str:
    return f"{_base(prefix, tag)}usage-drain:"


def drain_key(prefix: str, minute: int, batch: str, tag: str | None = None) -> str:
    """A minute's counters once a drain has claimed them (renamed out of the live set, in the same slot)."""
    return f"{drain_prefix(prefix, tag)}{minute}:{batch}"


#: How long a second's demand hash lives: the reconciler reads the last complete second.
DEMAND_TTL_S = 10


def demand_key(prefix: str, second: int, tag: str | None = None) -> str:
    """The hash of one second's demand for global policies: field a state key, value the tokens asked.

    Every request a global check meets adds its cost, admitted or not: what the region wants, for
    the reconciler to move shares toward (on a cluster, one per slot).
    """
    return f"{_base(prefix, tag)}demand:{second}"


def reconciled_key(prefix: str) -> str:
    """What the reconciler's last round did, as it wrote it into this region (JSON, for the admin)."""
    return f"{prefix}:reconciled"


def workers_key(prefix: str) -> str:
    """Every worker's shedder state (a hash: worker name -> JSON, for the admin's fleet page)."""
    return f"{prefix}:workers"


def share_key(state_key: str) -> str:
    """A global check's share record (:class:`ratelimits.shares.ShareRecord`), beside its state (same slot)."""
    return f"{state_key}#share"


def lease_key(prefix: str, batch: str) -> str:
    """Held (``SET NX PX``) by the drain applying ``batch`` (a :func:`drain_key`): no other drain takes it meanwhile.

    It expires on its own: a batch whose drain died is taken by another once the lease runs out.
    """
    return f"{prefix}:usage-lease:{batch}"


def slot_tag(slot: int) -> str:
    """A short hash tag whose keys fall in cluster slot ``slot`` (:func:`key_slot`)."""
    return _slot_tags()[slot]


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    # The first hexadecimal number to land in each slot: every slot is reached by about 315,000
    # (a tenth of a second, once per process that talks to a cluster).
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing, n = REDIS_CLUSTER_HASH_SLOTS, 0
    while missing:
        tag = f"{n:x}"
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        n += 1
    return tuple(tag for tag in tags if tag is not None)
