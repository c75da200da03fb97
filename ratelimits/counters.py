"""Usage counters: what one decision adds to its minute's counters, and how their fields are named.

The decide call increments, in the same round trip, one hash per minute. A *row* of it is one
caller on one endpoint, ``[caller kind, caller digest, organisation digest, tier, endpoint]``;
its fields are the row and a metric: allowed, limited (429), shed (503), degraded (decided
without the store) and tokens spent beyond one per allowed request.

Callers and organisations are named by their keyed digest (:attr:`Subject.digest
<ratelimits.identity.Subject.digest>`), as key names are, so the store holds no raw identity. The
digests' labels are noted here (:class:`SubjectLabels`) and written to the database off the
decision path (:mod:`ratelimits.usage.subjects`), where the drain (:mod:`ratelimits.usage`) finds
them when it moves closed minutes into ``UsageRecord`` rows.

A minute counts at most ``USAGE['MAX_SUBJECTS']`` rows: a new row beyond them is counted in the
overflow row of its caller kind and endpoint instead. :func:`count` is that rule as the memory
backend runs it; the decide script (``lua/decide.lua``) and ``lua/add_usage.lua`` mirror it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, MutableMapping
from functools import lru_cache
from typing import NamedTuple

from ._process import ProcessWide
from .identity import Subject

__all__ = [
    "ALLOWED",
    "DEGRADED",
    "EXTRA_TOKENS",
    "LIMITED",
    "METRICS",
    "OVERFLOW",
    "ROWS",
    "SHED",
    "Row",
    "SubjectLabels",
    "Usage",
    "UsageRow",
    "caller_rows",
    "count",
    "overflow_of",
    "parse_field",
    "parse_row",
    "subject_labels",
    "usage_for",
    "usage_row",
]

#: The metric suffixes of a counter field.
ALLOWED, LIMITED, SHED, DEGRADED, EXTRA_TOKENS = "a", "l", "s", "d", "x"
#: Field suffix -> UsageRecord column. Tokens are counted as the allowed requests (one each) plus
#: ``x``, the tokens beyond one that costlier requests spent: one counter less on the hot path.
METRICS = {ALLOWED: "allowed", LIMITED: "throttled", SHED: "shed", DEGRADED: "degraded", EXTRA_TOKENS: "tokens"}
#: The field counting a minute's rows. Each counted row also has a field of its own, the row
#: itself (no metric), set when it is first counted: what tells a new row from a new metric.
#: Neither ends in a metric, so :func:`parse_field` passes over both.
ROWS = "#"
#: The kind of the overflow rows (what no caller kind is); their subject is the callers' kind.
OVERFLOW = "overflow"


class Usage(NamedTuple):
    """Where one request's usage is counted: the minute, its row, and the row it overflows into."""

    minute: int
    #: The row: what each field of this request's counters starts with.
    field: str
    tokens: int
    #: The overflow row of the caller's kind on this endpoint, counted in if the minute is full.
    overflow: str


class Row(NamedTuple):
    """A counter row as :func:`parse_field` reads it back."""

    kind: str
    #: The caller's digest (an overflow row: the callers' kind).
    subject: str
    #: The organisation's digest, or "".
    organization: str
    tier: str
    endpoint: str


#: ``Usage(...)`` without the Python-level ``__new__`` a NamedTuple has: one per request.
_usage = tuple.__new__


class UsageRow(NamedTuple):
    """Where a caller's requests to one endpoint are counted, whatever the minute: made once,
    read for every request (:meth:`now`)."""

    caller: Subject
    organization: Subject | None
    field: str
    tokens: int
    overflow: str

    def now(self) -> Usage:
        """The usage of one request made now (minutes since the epoch on this process's clock).

        Notes the labels of the digests its row carries, for :mod:`ratelimits.usage.subjects` to
        write (the labels forget what they wrote once an hour: each request notes them again).
        """
        labels = _labels.get()
        labels.note(self.caller)
        if self.organization is not None:
            labels.note(self.organization)
        return _usage(Usage, (int(time.time() // 60), self.field, self.tokens, self.overflow))


def usage_row(caller: Subject, organization: Subject | None, tier: str, endpoint: str, tokens: int) -> UsageRow:
    """The row ``caller``'s requests to ``endpoint`` (with ``organization`` and ``tier``, each
    spending ``tokens``) are counted in."""
    row = _row(caller.kind, caller.digest, organization.digest if organization else "", tier, endpoint)
    return UsageRow(caller, organization, row, tokens, _overflow(caller.kind, endpoint))


def usage_for(caller: Subject, organization: Subject | None, tier: str, endpoint: str, tokens: int) -> Usage:
    """The usage of one request made now: :func:`usage_row`'s :meth:`~UsageRow.now`."""
    return usage_row(caller, organization, tier, endpoint, tokens).now()


@lru_cache(maxsize=65_536)
def _row(kind: str, subject: str, organization: str, tier: str, endpoint: str) -> str:
    # JSON, because tiers and endpoints are the host's strings: no separator is safe.
    return json.dumps([kind, subject, organization, tier, endpoint], separators=(",", ":"))


def caller_rows(caller: Subject) -> str:
    """What every counter field of ``caller``'s rows starts with (their kind and digest)."""
    # The row's JSON list (:func:`_row`) up to its third element: open, so every row of theirs matches.
    return json.dumps([caller.kind, caller.digest], separators=(",", ":"))[:-1] + ","


@lru_cache(maxsize=4096)
def _overflow(kind: str, endpoint: str) -> str:
    return _row(OVERFLOW, kind, "", "", endpoint)


@lru_cache(maxsize=65_536)
def overflow_of(field: str) -> str | None:
    """The overflow row of a counter field's row (``None`` if the field is no counter's).

    Asked for every field a worker adds to the store (``add_usage``): the same callers' fields
    come back flush after flush, and reading a row back (JSON) costs about 4 µs.
    """
    parsed = parse_field(field)
    return None if parsed is None else _overflow(parsed[0].kind, parsed[0].endpoint)


def parse_field(field: str) -> tuple[Row, str] | None:
    """The row of a counter field and its metric column; ``None`` for anything else."""
    metric = METRICS.get(field[-1:])
    if metric is None:
        return None
    row = parse_row(field[:-1])
    return None if row is None else (row, metric)


def parse_row(row: str) -> Row | None:
    """A counter row read back (``None`` if ``row`` is none)."""
    try:
        parts = json.loads(row)
    except ValueError:
        return None
    if not isinstance(parts, list) or len(parts) != 5 or not all(isinstance(p, str) for p in parts):
        return None
    return Row(*parts)


def count(counts: MutableMapping[str, int], row: str, overflow: str, metric: str, n: int, cap: int) -> str:
    """Add ``n`` to ``metric`` of ``row`` in one minute's ``counts``; return the row counted in.

    The store's rule, step for step as the scripts run it: a field that is new may be the first
    of a new row; a new row beyond ``cap`` is taken out again and ``n`` counted in ``overflow``.
    Only a new field costs more than the one increment.
    """
    field = row + metric
    total = counts[field] = counts.get(field, 0) + n
    if total == n and row not in counts:
        counts[row] = 1
        rows = counts[ROWS] = counts.get(ROWS, 0) + 1
        if rows > cap:
            del counts[field], counts[row]
            row = overflow
            counts[row + metric] = counts.get(row + metric, 0) + n
    return row


class SubjectLabels:
    """The subjects this process counted usage for, as far as the database may not know them yet.

    :meth:`note` is on the decision path: a set lookup for a subject already written. A new one
    waits in ``pending`` until :mod:`ratelimits.usage.subjects` takes it (:meth:`due`) after a
    response: at once for the first few writes, then about once a second, or as soon as
    ``BATCH`` wait. Written digests are remembered (``written``) until ``REFRESH_S`` have passed
    or ``WRITTEN_MAX`` are held, then forgotten whole: each active subject is written again now
    and then, which keeps its ``last_seen`` fresh. Everything is bounded; a label that could not
    be kept leaves its counts under the digest, never dropped.
    """

    #: Writes that may follow each other at once, and the pace after them (seconds apart).
    BURST = 5
    INTERVAL_S = 1.0
    #: A write is due, whatever the pace, once this many labels wait.
    BATCH = 1000
    #: Labels waiting at most; more are noted again by their subject's next request.
    PENDING_MAX = 10_000
    WRITTEN_MAX = 100_000
    REFRESH_S = 3600.0
    #: After a failed write: the wait before the next, and how many times a label is tried.
    RETRY_AFTER_S = 10.0
    ATTEMPTS = 3
    #: Longer values are not kept (the database's column holds no more).
    VALUE_MAX = 200

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.pending: dict[str, tuple[str, str]] = {}
        self.written: set[str] = set()
        self._lock = threading.Lock()
        self._written_since = clock()
        self._allowance = float(self.BURST)
        self._paced_at = self._written_since
        self._not_before = self._written_since
        self._failures = 0

    def note(self, subject: Subject) -> None:
        """Remember ``subject``'s label if the database may not have it."""
        digest = subject.digest
        if digest in self.written or digest in self.pending:
            return
        if len(subject.value) > self.VALUE_MAX:
            return
        with self._lock:
            if len(self.pending) < self.PENDING_MAX:
                self.pending[digest] = (subject.kind.value, subject.value)

    def due(self) -> dict[str, tuple[str, str]]:
        """The labels to write now, taken out of ``pending``; empty if no write is due yet.

        Called after every response: this is also where ``written`` is forgotten once
        ``REFRESH_S`` have passed, so that a subject counted all along is written again too.
        """
        now = self.clock()
        if not self.pending and now - self._written_since <= self.REFRESH_S:
            return {}  # the common case, read without the lock: nothing waits, nothing to forget
        with self._lock:
            if now - self._written_since > self.REFRESH_S:
                self._forget_written(now)
            if not self.pending or now < self._not_before:
                return {}
            self._allowance = min(self.BURST, self._allowance + (now - self._paced_at) / self.INTERVAL_S)
            self._paced_at = now
            if self._allowance < 1 and len(self.pending) < self.BATCH:
                return {}
            self._allowance = max(self._allowance - 1, 0.0)
            return self._take()

    def take(self) -> dict[str, tuple[str, str]]:
        """Every label waiting, due or not."""
        with self._lock:
            return self._take()

    def done(self, labels: dict[str, tuple[str, str]]) -> None:
        """``labels`` are in the database."""
        with self._lock:
            self._failures = 0
            if len(self.written) + len(labels) > self.WRITTEN_MAX:
                self._forget_written(self.clock())
            self.written.update(labels)

    def failed(self, labels: dict[str, tuple[str, str]]) -> int:
        """Writing ``labels`` failed: keep them for a later try, unless tried enough; return how many are dropped."""
        with self._lock:
            self._failures += 1
            self._not_before = self.clock() + self.RETRY_AFTER_S
            if self._failures >= self.ATTEMPTS:
                self._failures = 0
                return len(labels)
            room = self.PENDING_MAX - len(self.pending)
            kept = dict(list(labels.items())[:room])
            self.pending = {**kept, **self.pending}
            return len(labels) - len(kept)

    def _forget_written(self, now: float) -> None:
        self.written = set()
        self._written_since = now

    def _take(self) -> dict[str, tuple[str, str]]:
        taken, self.pending = self.pending, {}
        return taken


_labels: ProcessWide[SubjectLabels] = ProcessWide(SubjectLabels)


def subject_labels() -> SubjectLabels:
    """The process's labels waiting to be written (new after the settings change: digests may have too)."""
    return _labels.get()
