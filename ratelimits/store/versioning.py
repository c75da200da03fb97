"""The policy version: raised with every committed policy change, published to the limiter's store.

The database's :class:`~ratelimits.models.PolicyVersion` holds the truth; the store keeps a copy
that every decision brings back, so a worker learns of a change on its next request at no extra
round trip (:meth:`~.database.DatabasePolicySource.observe`).
"""

from __future__ import annotations

import logging

from django.db import transaction

from ..backends import BulletinSupport, get_backend
from ..exceptions import BackendUnavailable
from ..models import PolicyVersion
from ..policies.source import get_policy_source

__all__ = ["advance_on_commit", "bump_policy_version", "committed_version", "publish_version", "stamp_version"]

logger = logging.getLogger("ratelimits")


def committed_version() -> int:
    """The version in the database (0 before any change)."""
    return PolicyVersion.current()


def advance_on_commit(using: str) -> None:
    """Raise the version once in the current transaction, and publish it when the transaction commits.

    However many rows a transaction changes (an import changes many), the version moves once.
    A pending publication survives whenever this change does: rolling back a savepoint discards
    the callbacks registered inside it, and any savepoint still open now encloses this change too.
    """
    connection = transaction.get_connection(using)
    if connection.in_atomic_block and any(entry[1] is bump_policy_version for entry in connection.run_on_commit):
        return
    PolicyVersion.advance(using)
    transaction.on_commit(bump_policy_version, using=using)


def bump_policy_version() -> None:
    """Tell every worker that policies changed (called when a change commits): this one at once."""
    get_policy_source().invalidate()
    publish_version(committed_version())


def publish_version(version: int) -> None:
    """Raise the store's copy of the version to ``version``; if the store is down, workers poll.

    A backend without the bulletin (no :class:`~ratelimits.backends.BulletinSupport`) has no copy:
    workers learn of the change at their next recheck (``manage.py check`` refuses the database
    source with it, ``ratelimits.E183``)."""
    backend = get_backend()
    if not isinstance(backend, BulletinSupport):
        return
    try:
        backend.publish_version(version)
    except BackendUnavailable as exc:
        logger.warning(
            "ratelimits: could not publish policy version %s (%s); workers poll until the store returns", version, exc
        )


def stamp_version(stamp: str | None) -> int:
    """The version a decision brought back (0 when the store has none)."""
    try:
        return int(stamp or 0)
    except ValueError:
        return 0
