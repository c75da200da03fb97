"""The reconciler: a round moves each global subject's regional shares toward where its demand is.

A Celery beat task (``ratelimits.reconcile_regions``) runs :func:`reconcile` every
``REGIONS['RECONCILE_INTERVAL']`` (1 s). Demand is counted in a hash per second, so the rounds are
aligned to the seconds, not to beat's ticks (which fall anywhere in a second, and drift): a round
waits for just after its second's end (:func:`rounds_due`). Each round then reads a second of
demand as soon as it is whole, and a share follows demand within about 1.1 s, instead of 1-2 s.
A round:

1. reads every region's demand of the second it is for (``lua/decide.lua`` counts it), and the
   share records of every subject that had demand somewhere;
2. gives each subject's reachable regions new shares: the floor each, the rest in proportion to
   demand, out of what the unreachable regions do not hold (each is assumed to hold the most it
   can come to without a write: ``max(its last share as decayed, 1 / regions)``), so the shares
   never sum above the limit;
3. writes the regions whose share goes down first, then, only if all of those were written, the
   others: at no moment do the written shares sum above the limit. Each write names the epoch it
   read (compare and set): a round racing another loses the subjects the other wrote first, and
   takes nothing from them.

Two rounds at once (two beats after a failover, a duplicate delivery) are kept apart by a
PostgreSQL advisory lock held for the round (on another database only the compare and set guards
them). docs/regions.md derives the bounds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from django.db import connection, transaction

from .backends.regions import RegionStore, ShareWrite
from .conf import conf
from .exceptions import BackendUnavailable
from .shares import RECORD_TTL_EXTRA_S, ShareRecord, target_shares

__all__ = ["Round", "reconcile", "region_stores", "rounds_due"]

logger = logging.getLogger("ratelimits.reconciler")
T = TypeVar("T")

#: How long the reconciler waits on one region's store, at most: a region slower than this is
#: unreachable for the round (it keeps its share). Well under the interval, so rounds keep time.
STORE_TIMEOUT_S = 0.5
#: How long a round's share writes have to run in their store: room for a whole pipelined write
#: (10,000 subjects take about 0.15 s of a store's time). A write not answered is waited out.
WRITE_WINDOW_S = 1.0
#: How far the reconciler's clock and a store's may disagree, waited on top of a write's deadline.
CLOCK_MARGIN_S = 0.1
#: How long the last round's summary stays in each region's store for the admin.
STATUS_TTL_S = 86_400
#: A round reads a second this long after its end, by the reconciler's clock: room for the
#: decisions the app's clock named in that second to land in their stores (``lua/decide.lua``
#: counts a decision in the second its process named, a round trip before the script runs), and
#: for the clocks to disagree (as ``CLOCK_MARGIN_S``). The rounds align to this moment.
READ_AFTER_S = CLOCK_MARGIN_S
#: A round whose task came at most this late after its second's moment reads that second at once.
ON_TIME_S = 0.1
#: A task later than ``ON_TIME_S`` and by at most this reads the second at once, then waits for the
#: next second's moment and reads that one too: beat's ticks drift later (each is due an interval
#: after the last one *ran*), so the task before may have read the second before this one, and
#: waiting for the next alone would leave this one unread (a round missing). Later still, the task
#: before has waited for this second already: the task waits for the next one alone.
CATCH_UP_S = 0.25


@dataclass
class Round:
    """What one round did."""

    #: When it started (Unix seconds).
    at: float
    #: The second whose demand it read.
    second: int
    reached: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    #: Global subjects with demand in a reachable region.
    subjects: int = 0
    #: Share records written; refused because another round had written them since they were read;
    #: refused because they ran after their deadline.
    written: int = 0
    conflicts: int = 0
    late: int = 0
    #: Another round held the lock: this one did nothing.
    skipped: bool = False
    seconds: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)

    def summary(self) -> dict[str, Any]:
        """What the round did, for JSON: the task's result, and each region's ``<prefix>:reconciled``."""
        summary = {k: v for k, v in asdict(self).items() if k != "started"}
        return {**summary, "at": datetime.fromtimestamp(self.at, UTC).isoformat()}


def store_timeout() -> float:
    """How long a round waits on one region's store (``STORE_TIMEOUT_S``, or half the interval if less)."""
    return min(STORE_TIMEOUT_S, conf.regions.reconcile.interval / 2)


def region_stores() -> dict[str, RegionStore]:
    """A store client per region of ``REGIONS['STORES']`` (one per process and URL, reused by every round)."""
    timeout = store_timeout()
    return {
        name: RegionStore.from_url(
            name, url, prefix=conf.redis.key_prefix, timeout=timeout, options=conf.redis.address[1]
        )
        for name, url in conf.regions.stores.items()
    }


def rounds_due(now: float) -> list[tuple[float, int]]:
    """The rounds a task started at ``now`` runs (Unix seconds): when each starts, and the second it reads.

    A second is read ``READ_AFTER_S`` after its end (its *moment*). A task reads the last second
    whose moment has passed at once if it is at most ``ON_TIME_S`` late for it; at most
    ``CATCH_UP_S`` late, at once and the next second at its moment too; later, the next second
    alone, at its moment (it waits for at most ``1 - CATCH_UP_S`` s). With beat's ticks about a
    second apart, drifting later, and no task more than ``CATCH_UP_S - ON_TIME_S`` later in its
    second than the task before, every second is read, and each at most ``CATCH_UP_S`` after its
    moment (usually at it): ``tests/test_regions.py`` runs such a beat for an hour.
    """
    second = math.floor(now - READ_AFTER_S) - 1  # the last second whose moment has passed
    moment = second + 1 + READ_AFTER_S
    late = now - moment  # in [0, 1)
    following = (moment + 1, second + 1)
    if late <= ON_TIME_S:
        return [(now, second)]
    if late <= CATCH_UP_S:
        return [(now, second), following]
    return [following]


def reconcile(*, stores: Mapping[str, RegionStore] | None = None, now: float | None = None, lock: bool = True) -> Round:
    """Run a round (``stores``: by region name, every region of ``REGIONS['STORES']`` by default).

    With ``now`` (Unix seconds): one round, at once, as of ``now``, reading the second before
    ``now``'s. Without, as beat's task calls it: the round waits for its second's moment, and a
    task late enough runs two (:func:`rounds_due`); the last round is returned. The wait is taken
    before the round: the lock is not held meanwhile, and a write's deadline counts from the write.
    """
    stores = region_stores() if stores is None else stores
    if now is not None:
        return _reconcile(stores, Round(at=now, second=int(now) - 1), lock)
    at = time.time()
    result = Round(at=at, second=math.floor(at - READ_AFTER_S) - 1)
    if len(stores) < 2:
        return result  # one region: a global limit is its own, and nothing to wait for
    for start, second in rounds_due(at):
        time.sleep(max(start - time.time(), 0))  # the second's moment: a wait of under a second
        result = _reconcile(stores, Round(at=time.time(), second=second), lock)
    return result


def _reconcile(stores: Mapping[str, RegionStore], result: Round, lock: bool) -> Round:
    if len(stores) < 2:
        return result  # one region: a global limit is its own
    with _round_lock(lock) as held:
        if not held:
            result.skipped = True
            logger.info("ratelimits: reconciliation skipped: another round holds the lock")
            return result
        _round(result, dict(sorted(stores.items())))
    logger.info(
        "ratelimits: reconciled %d global subjects in %.0f ms: %d shares written, %d conflicts; unreachable: %s",
        result.subjects,
        result.seconds * 1000,
        result.written,
        result.conflicts,
        ", ".join(result.unreachable) or "none",
    )
    return result


def _round(result: Round, stores: dict[str, RegionStore]) -> None:
    names = list(stores)
    count = len(names)
    settings = conf.regions.reconcile
    even = 1 / count
    now_us = result.at * 1_000_000
    demand = _in_each(stores, lambda store: store.demand(result.second))
    subjects = sorted({key for seen in demand.values() for key in seen.asked})
    policies = {key: numbers for seen in demand.values() for key, numbers in seen.policies.items()}
    records = _in_each({name: stores[name] for name in demand}, lambda store: store.records(subjects))
    demand = {name: asked for name, asked in demand.items() if name in records}
    reached = [name for name in names if name in demand]
    result.reached, result.unreachable = reached, [name for name in names if name not in demand]
    result.subjects = len(subjects)
    if len(reached) == 0 or not subjects:
        _publish_status(result, stores)
        return
    # Phase 1 writes every reached region: its new share where it goes down or stays, its current
    # one where it goes up; every record with the round's whole vector (so that whichever region is
    # read later, its vector bounds every other). Phase 2 raises, once all of phase 1 landed.
    first: dict[str, list[ShareWrite]] = {name: [] for name in reached}
    raises: dict[str, list[ShareWrite]] = {name: [] for name in reached}
    for key in subjects:
        seen = {name: records[name][key] for name in reached if key in records[name]}
        assumed = {}
        for index, name in enumerate(names):
            if name not in demand:  # unreachable: the most it can hold until it is written again
                bounds = [r.most_of(index, now_us) for r in seen.values() if len(r.shares) == count]
                assumed[name] = max(bounds, default=even)
        current = {name: seen[name].effective(now_us) if name in seen else even for name in reached}
        budget = max(1.0 - sum(assumed.values()), 0.0)
        floor = min(settings.floor, even)
        shares = target_shares({name: demand[name].asked.get(key, 0.0) for name in reached}, budget, floor, current)
        vector = tuple(shares.get(name, assumed.get(name, even)) for name in names)
        epoch = max((record.epoch for record in seen.values()), default=0) + 1
        rate, burst, state_ttl = policies.get(key, (0.0, 0.0, 0.0))
        stale, decay = settings.stale_after * 1e6, settings.decay * 1e6
        for name in reached:
            held = min(shares[name], current[name])
            record = ShareRecord(held, now_us, stale, decay, even, epoch, vector)
            first[name].append(ShareWrite(key, seen[name].epoch if name in seen else 0, record, rate, burst, state_ttl))
            if shares[name] > held:
                raised = ShareRecord(shares[name], now_us, stale, decay, even, epoch + 1, vector)
                raises[name].append(ShareWrite(key, epoch, raised, rate, burst, state_ttl))
    ttl_ms = int((settings.stale_after + settings.decay + RECORD_TTL_EXTRA_S) * 1000)
    settled = _write(first, stores, ttl_ms, result)
    # Only a subject whose every phase-1 write landed may be raised: otherwise the raise could take
    # what a region not yet lowered still holds, or a region not yet told the vector could be read
    # later as a bound of this one.
    missed = {e.state_key for name, batch in first.items() for e in batch if settled[name].get(e.state_key) != "w"}
    _write(
        {name: [e for e in batch if e.state_key not in missed] for name, batch in raises.items()},
        stores,
        ttl_ms,
        result,
    )
    _publish_status(result, stores)


def _write(
    entries: Mapping[str, Sequence[ShareWrite]],
    stores: Mapping[str, RegionStore],
    ttl_ms: int,
    result: Round,
) -> dict[str, dict[str, str]]:
    """Write each region's entries; per region, each subject's outcome (missing: unknown)."""
    busy = {name: stores[name] for name, batch in entries.items() if batch}
    # A write runs by its deadline or not at all. One whose answer did not come (it may still be
    # on its way) is waited out: the round ends after the deadline, so no later round (rounds hold
    # the lock one after the other) reads the region before the write has run or been refused.
    deadline = time.time() + WRITE_WINDOW_S
    written: dict[str, dict[str, str]] = {}
    try:
        written = _in_each(busy, lambda store: store.write(entries[store.name], ttl_ms, deadline))
    finally:
        if set(written) != set(busy):
            time.sleep(max(deadline + CLOCK_MARGIN_S - time.time(), 0))
    settled = {name: written.get(name, {}) for name in entries}
    for name, outcomes in settled.items():
        late = sum(outcome == "l" for outcome in outcomes.values())
        if late:
            logger.warning(
                "ratelimits: reconciliation: region %s ran %d share writes after their deadline and refused them: "
                "is its clock ahead of the reconciler's?",
                name,
                late,
            )
        result.written += sum(outcome == "w" for outcome in outcomes.values())
        result.conflicts += sum(outcome == "c" for outcome in outcomes.values())
        result.late += late
    return settled


def _in_each(stores: Mapping[str, RegionStore], work: Callable[[RegionStore], T]) -> dict[str, T]:
    """``work`` on every region's store at once (a thread each: the regions are far apart, and
    each waits on its own network); the regions that answered, by name.
    """
    if not stores:
        return {}
    done: dict[str, T] = {}
    with ThreadPoolExecutor(max_workers=len(stores), thread_name_prefix="ratelimits-reconcile") as pool:
        futures = {name: pool.submit(work, store) for name, store in stores.items()}
        for name, future in futures.items():
            try:
                done[name] = future.result()
            except BackendUnavailable as exc:
                logger.warning("ratelimits: reconciliation: %s", exc)
            except Exception:  # a bug or the unforeseen: this region did not answer, the others did
                logger.exception("ratelimits: reconciliation: region %s failed", name)
    return done


def _publish_status(result: Round, stores: Mapping[str, RegionStore]) -> None:
    result.seconds = time.monotonic() - result.started
    status = json.dumps(result.summary())
    for name in result.reached:
        with contextlib.suppress(BackendUnavailable):
            stores[name].write_status(status, STATUS_TTL_S)


@contextlib.contextmanager
def _round_lock(wanted: bool) -> Iterator[bool]:
    """Whether this round may run: it holds the fleet's reconciliation lock (PostgreSQL), or there is none."""
    if not wanted or connection.vendor != "postgresql":
        yield True
        return
    with transaction.atomic(), connection.cursor() as cursor:
        # A transaction-level advisory lock: released at commit, or by PostgreSQL when the
        # connection dies, so a killed reconciler never keeps it.
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_lock_id()])
        yield bool(cursor.fetchone()[0])


def _lock_id() -> int:
    """The advisory lock of this fleet (by key prefix): fleets sharing a database do not wait on each other."""
    digest = hashlib.blake2b(f"ratelimits.reconcile:{conf.redis.key_prefix}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
