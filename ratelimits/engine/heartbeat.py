"""The slots this process holds, renewed while it lives: a killed worker's come back within a lease.

A slot (a request in flight, per subject or in the fleet) is stored with an expiry, so that a
worker killed while holding it cannot lock its caller out for ever. Were that expiry the longest a
request may run (``SHEDDING['SLOT_TTL']``, a minute), a ``kill -9`` would lock the caller's
concurrency, and the fleet's places, out for that minute. So a slot is taken for a short lease
(``SHEDDING['SLOT_LEASE']``, 3 s) and one thread per process renews every slot its requests still
hold, every third of the lease: one call per store per beat, whatever the number of requests,
and nothing on the request path. A slot is renewed until its request ends or ``SLOT_TTL`` after it
was taken, so the bounds are:

- a killed (or frozen) worker's slots come back within one lease of its last beat;
- a live worker's slot is held until its request ends, for at most ``SLOT_TTL`` (plus a lease).

A worker stalled for longer than two beats (its heartbeat starved, or the store unreachable) may
see a slot it still holds expire: the request runs on, uncounted, until it ends. The lease is
three beats long so that one late beat never does it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..conf import conf
from ..policies.values import slot_lease_us

if TYPE_CHECKING:
    from ..backends.base import Backend

__all__ = ["HEARTBEAT", "SlotHeartbeat"]

logger = logging.getLogger("ratelimits")

#: How many beats a lease lasts: a slot survives one late or failed beat.
BEATS_PER_LEASE = 3


class SlotHeartbeat:
    """Renew the slots this process's requests hold, off the request path."""

    def __init__(self, lease_us: Callable[[], int] = slot_lease_us) -> None:
        self._lease_us = lease_us
        self.reset()

    def reset(self) -> None:
        """Nothing held, no thread: at start, and in a forked child (the parent's slots are its own)."""
        self._lock = threading.Lock()
        #: slot id -> (its store, its keys, until when it is renewed: monotonic seconds)
        self._held: dict[str, tuple[Backend, tuple[str, ...], float]] = {}
        self._thread: threading.Thread | None = None

    def hold(self, backend: Backend, slot: str, keys: Sequence[str]) -> None:
        """Renew ``slot`` under ``keys`` in ``backend`` until :meth:`drop`, or ``SLOT_TTL`` from now."""
        until = time.monotonic() + conf.shedding.slot_ttl_us / 1_000_000
        with self._lock:
            self._held[slot] = (backend, tuple(keys), until)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ratelimits-slot-heartbeat", daemon=True)
                self._thread.start()

    def drop(self, slot: str) -> None:
        """The request ended (its slot released, or being released): renew it no more."""
        with self._lock:
            self._held.pop(slot, None)

    def beat(self) -> None:
        """Renew every slot still held, one call per store; drop those past their ``SLOT_TTL``."""
        now = time.monotonic()
        by_store: dict[int, tuple[Backend, dict[str, tuple[str, ...]]]] = {}
        with self._lock:
            for slot, (backend, keys, until) in list(self._held.items()):
                if until <= now:
                    del self._held[slot]  # its request outran SLOT_TTL: its slot lapses within a lease
                    continue
                by_store.setdefault(id(backend), (backend, {}))[1][slot] = keys
        lease = self._lease_us()
        for backend, slots in by_store.values():
            try:
                backend.renew(slots, lease)
            except Exception as exc:  # the store is down: the next beat tries again, the lease covers two
                logger.info("ratelimits: %d slots not renewed this beat: %s", len(slots), exc)

    def _run(self) -> None:
        while True:
            time.sleep(self._lease_us() / 1_000_000 / BEATS_PER_LEASE)
            try:
                self.beat()
            except Exception:  # this thread must outlive anything
                logger.exception("ratelimits: the slot heartbeat failed a beat")


#: The process's heartbeat: every limiter's slots (one made by a settings change included, until
#: its requests end) in one thread.
HEARTBEAT = SlotHeartbeat()
os.register_at_fork(after_in_child=HEARTBEAT.reset)
