"""The usage report's live minutes: what the store has counted that the drain has not moved into the database yet.

The drain takes a minute only once it has closed (and :data:`~.records.GRACE_S` after), so the
current minute, and any minute the drain has not reached, are in the store's counters only. The
report reads those of its last :data:`LIVE_MINUTES` minutes with :meth:`UsageSupport.peek_usage
<ratelimits.backends.base.UsageSupport.peek_usage>`, which claims nothing: the drain still moves them,
exactly once. Nothing is counted twice: the drain renames a minute's hash out of the live set
before it applies it, so a count is either still in the live set or in the database (or, for the
second or so a batch is applied, in neither). A report reads at most :data:`MAX_FIELDS` counters,
off the decision path, and a store that cannot be read leaves the report without its live part.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from ..backends import UsageSupport, get_backend
from ..conf import conf
from ..counters import caller_rows
from ..exceptions import BackendUnavailable
from ..identity import Subject
from .records import usage_rows

__all__ = ["LIVE_MINUTES", "MAX_FIELDS", "STALE_S", "Live", "LiveRow", "live_minutes", "read_live", "stale_since"]

#: How many of the latest minutes a report reads from the store: the drain (every 30 s in the
#: demo's schedule) normally leaves only the current minute and the one before it.
LIVE_MINUTES = 60
#: A minute still in the live set this long after it closed is one nothing drains: a drain takes
#: each minute :data:`~.records.GRACE_S` after it closed (30 s apart, with the schedule's default).
STALE_S = 300
#: The most counter fields one report reads: 10,000 is some 2,500 to 5,000 rows (a row has a
#: marker field and one per metric it counted), a few milliseconds of Redis.
MAX_FIELDS = 10_000


@dataclass(frozen=True, slots=True)
class LiveRow:
    """One subject's usage on one endpoint in one minute, as the store counts it: not in the database yet."""

    period_start: datetime
    subject_kind: str
    subject_id: str
    endpoint: str
    organization: str = ""
    tier: str = ""
    allowed: int = 0
    throttled: int = 0
    shed: int = 0
    degraded: int = 0
    tokens: int = 0

    @property
    def requests(self) -> int:
        return self.allowed + self.throttled + self.shed + self.degraded


@dataclass(frozen=True, slots=True)
class Live:
    """What a report read of its minutes not drained yet."""

    rows: tuple[LiveRow, ...] = ()
    #: The minutes looked for (their starts, oldest first); none when the range has no recent minute.
    minutes: tuple[datetime, ...] = ()
    #: Why the store was not read ("" when it was, or did not need to be).
    error: str = ""
    #: The store held more than :data:`MAX_FIELDS` counters in those minutes: the rest were left out.
    truncated: bool = False


def live_minutes(start: datetime, end: datetime, now: float) -> list[int]:
    """The minutes (since the epoch) of ``[start, end)`` among the last :data:`LIVE_MINUTES` to ``now``, newest first.

    Newest first: when a store holds more than a report may read, the current minute is read.
    """
    current = int(now // 60)
    first = max(math.ceil(start.timestamp() / 60), current - LIVE_MINUTES + 1)
    last = min(current, math.ceil(end.timestamp() / 60) - 1)
    return list(range(last, first - 1, -1))


def read_live(
    start: datetime,
    end: datetime,
    *,
    caller: Subject | None = None,
    backend: UsageSupport | None = None,
    now: float | None = None,
) -> Live:
    """The counters of the minutes starting in ``[start, end)`` that the store still holds, as rows.

    Subjects are named by the labels the workers wrote, as the drain names them (a subject counted
    in the last second or so may still be under its digest). ``caller``: that caller's rows only,
    picked out by the store (the customer API's read: the bound is then on their rows alone).
    """
    minutes = live_minutes(start, end, time.time() if now is None else now)
    if not minutes:
        return Live()
    if not conf.enabled:  # switched off, nothing is counted, and the store is not asked
        return Live(minutes=tuple(datetime.fromtimestamp(m * 60, tz=UTC) for m in reversed(minutes)))
    starts = tuple(datetime.fromtimestamp(minute * 60, tz=UTC) for minute in reversed(minutes))
    store = backend or get_backend()
    if not isinstance(store, UsageSupport):
        return Live(minutes=starts, error=f"{type(store).__name__} keeps no usage counters")
    try:
        prefix = caller_rows(caller) if caller is not None else ""
        peek = store.peek_usage(minutes, MAX_FIELDS, row_prefix=prefix)
    except BackendUnavailable as exc:
        return Live(minutes=starts, error=f"the limiter's store could not be read ({exc})")
    except NotImplementedError as exc:  # a read the store does not make (a cluster's, for one caller)
        return Live(minutes=starts, error=str(exc))
    rows: list[LiveRow] = []
    for minute in reversed(minutes):
        counts = peek.counts.get(minute)
        if counts:
            moment = datetime.fromtimestamp(minute * 60, tz=UTC)
            records, _ = usage_rows(counts)
            rows += [
                LiveRow(moment, kind, subject, endpoint, **values)
                for (kind, subject, endpoint), values in sorted(records.items())
            ]
    return Live(tuple(rows), starts, truncated=peek.truncated)


def stale_since(*, backend: UsageSupport | None = None, now: float | None = None) -> datetime | None:
    """Where the oldest minute the store still holds, of those that closed :data:`STALE_S` ago or more, starts.

    ``None`` when there is none among the last :data:`LIVE_MINUTES`: the drain keeps up (or there
    was no traffic). One bounded read of the store: it stops at the first field found, oldest first.
    """
    now = time.time() if now is None else now
    current = int(now // 60)
    newest = int((now - STALE_S) // 60) - 1  # minute m closed at (m + 1) * 60
    minutes = list(range(current - LIVE_MINUTES + 1, newest + 1))
    store = backend or get_backend()
    if not minutes or not isinstance(store, UsageSupport):
        return None
    found = [minute for minute, fields in store.peek_usage(minutes, 1).counts.items() if fields]
    return datetime.fromtimestamp(min(found) * 60, tz=UTC) if found else None
