"""The labels behind the digests of the usage counters: written by the workers, read by the drain.

Usage counters name callers and organisations by their keyed digest only (:mod:`ratelimits.counters`),
so the store holds no raw identity. Each worker notes the subjects it counts that the database may
not know (:class:`~ratelimits.counters.SubjectLabels`) and writes them into ``UsageSubject`` after
a response, off the decision path: at once for the first few, then about once a second, or as soon
as many wait. The drain takes a minute only a grace period after it closed, so the labels of its
last requests are in, and looks its digests up here. A write that fails is logged and tried again
after a later response, a few times; a subject without a label keeps its counts under its digest.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.core.signals import request_finished
from django.db import connection
from django.utils import timezone

from ..backends import layout
from ..conf import conf
from ..counters import SubjectLabels, subject_labels
from ..models import UsageSubject
from ..store.database import bounded_waits, migrate_hint

__all__ = ["KEEP_FOR", "chunks", "connect", "max_params", "purge", "resolve", "write_due", "write_pending"]

logger = logging.getLogger("ratelimits")

T = TypeVar("T")

#: How long a label is kept after it was last written: longer than a counter naming it lives
#: undrained, plus the hour a worker counts a subject without writing its label again.
KEEP_FOR = timedelta(seconds=layout.USAGE_TTL_S + SubjectLabels.REFRESH_S) + timedelta(days=1)


def connect() -> None:
    """Write the labels that are due after every response (called once the app is ready)."""
    request_finished.connect(write_due, dispatch_uid="ratelimits.usage.subjects.write_due")


def write_due(**kwargs: Any) -> None:
    """Write this process's waiting labels if a write is due (connected to ``request_finished``)."""
    labels = subject_labels()
    due = labels.due()
    if due:
        # On the request's thread, after Django closed its connection: the one opened here is
        # closed by the next request's start, as Django closes every request's (CONN_MAX_AGE).
        _write(labels, due)


def write_pending() -> int:
    """Write every label waiting in this process now, due or not; return how many were written."""
    labels = subject_labels()
    pending = labels.take()
    return _write(labels, pending) if pending else 0


def _write(labels: SubjectLabels, due: dict[str, tuple[str, str]]) -> int:
    now = timezone.now()
    # In one order, so that two workers writing the same labels at once never deadlock.
    rows = [
        UsageSubject(digest=d, kind=kind, value=value, first_seen=now, last_seen=now)
        for d, (kind, value) in sorted(due.items())
    ]
    try:
        # Bounded like a policy reload: a locked table must not hold the worker's threads.
        with bounded_waits(conf.policies.load_timeout):
            UsageSubject.objects.bulk_create(
                rows, update_conflicts=True, unique_fields=["digest"], update_fields=["last_seen"]
            )
    # Anything: this runs after the response, and must never fail it (a database down, a bug).
    except Exception as exc:
        dropped = labels.failed(due)
        logger.warning(
            "ratelimits: %d usage subject labels not written (%s: %s%s); %s",
            len(due),
            type(exc).__name__,
            exc,
            migrate_hint(exc),
            f"{dropped} given up, their counts stay under their digests" if dropped else "tried again later",
        )
        return 0
    labels.done(due)
    return len(rows)


def resolve(digests: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{digest: (kind, value)}`` of every digest among ``digests`` that has a label."""
    wanted = sorted(set(digests))
    table = connection.ops.quote_name(UsageSubject._meta.db_table)
    select = f"SELECT digest, kind, value FROM {table} WHERE digest"
    found: dict[str, tuple[str, str]] = {}
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One array parameter: a minute's digests bound one by one take the driver seconds.
            cursor.execute(f"{select} = ANY(%s)", [wanted])
            found.update((digest, (kind, value)) for digest, kind, value in cursor.fetchall())
            return found
        for chunk in chunks(wanted, max_params(1)):
            cursor.execute(f"{select} IN ({', '.join(['%s'] * len(chunk))})", list(chunk))
            found.update((digest, (kind, value)) for digest, kind, value in cursor.fetchall())
    return found


def purge(*, now: datetime | None = None) -> int:
    """Delete the labels not written for :data:`KEEP_FOR`: no counter left can name them."""
    deleted, _ = UsageSubject.objects.filter(last_seen__lt=(now or timezone.now()) - KEEP_FOR).delete()
    return deleted


def max_params(per_row: int) -> int:
    """Rows of ``per_row`` parameters one statement may carry on this database."""
    limit = connection.features.max_query_params or 20_000
    return max(min(limit, 20_000) // per_row, 1)


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
