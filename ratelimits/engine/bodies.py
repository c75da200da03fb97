"""A request's body, read before the request is decided: a request in flight is one that can run.

Under WSGI the body is read lazily: gunicorn hands the view a socket, and DRF reads it when the
view first asks for ``request.data``, after the throttle has decided. Decided first, a request
whose body trickles in (one byte every two seconds) holds the fleet's in-flight slot and this
worker's place for as long as its client likes: five such requests from one tenant shed every
other tenant's traffic while the servers' threads sit idle. So a consuming decision first reads
the body (:func:`receive_body`), up to ``DATA_UPLOAD_MAX_MEMORY_SIZE``, and only a request whose
body has arrived is counted in flight.

Under gunicorn the read has a deadline (``SHEDDING['BODY_TIMEOUT']``): one watchdog thread per
process shuts the read side of a late request's socket, the read ends short, and the request is
answered 408 before anything is taken for it. Other WSGI servers read with their own timeouts.
Under ASGI, Django's handler receives the whole body before the application runs: there is
nothing left to wait for here.

A body larger than ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (an upload) is not read first: it is decided
when its headers have arrived, as before, and holds its slot while it uploads.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, UnreadablePostError

from ..conf import conf
from ..identity import django_request

__all__ = ["BodyNotReceived", "receive_body"]

logger = logging.getLogger("ratelimits")


class BodyNotReceived(Exception):
    """The request's body did not arrive within ``SHEDDING['BODY_TIMEOUT']``: answer 408, hold nothing."""

    def __init__(self, received: int, expected: int, timeout: float) -> None:
        super().__init__(f"{received} of {expected} body bytes arrived in {timeout:g} s")
        self.received, self.expected, self.timeout = received, expected, timeout


def receive_body(request: HttpRequest) -> None:
    """Read ``request``'s body into memory now, unless it is read already, absent, or an upload.

    Raises :class:`BodyNotReceived` when it does not all arrive in time (or the client closed
    its side first). The view then reads the body from memory, as Django reads it twice.
    """
    http: Any = django_request(request)
    meta = http.META
    announced = meta.get("CONTENT_LENGTH")
    # Most requests (GET) announce no body: they are done with at the first test.
    if not announced or "wsgi.input" not in meta or http._read_started or hasattr(http, "_body"):
        return
    try:
        length = int(announced)
    except ValueError:
        return  # Django reads such a body as empty
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if length <= 0 or (limit is not None and length > limit):
        return
    timeout = conf.shedding.body_timeout
    watched = _watchdog.watch(meta.get("gunicorn.socket"), timeout)
    try:
        body = http.body
    except (UnreadablePostError, OSError, RequestDataTooBig):
        body = getattr(http, "_body", b"")
    finally:
        late = _watchdog.done(watched)
    if len(body) < length:
        if not late:  # the client closed its side, or the server's own timeout ended the read
            logger.info("ratelimits: request body ended short: %d of %d bytes", len(body), length)
        raise BodyNotReceived(len(body), length, timeout)


class _Watchdog:
    """One thread per process that ends the reads of bodies past their deadline.

    Shutting a socket's read side ends a ``recv`` blocked on it (it returns end of file) and
    leaves the write side open, so the 408 still reaches the client. Each watched read costs a
    heap push and, for the earliest deadline, one wake-up: nothing per byte.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Nothing watched, no thread: at start, and in a forked child (the parent's are not its own)."""
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._pending: set[int] = set()
        self._shut: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket | None, timeout: float) -> int | None:
        """Watch a read from ``sock`` for ``timeout`` seconds; ``None`` when there is no socket to end it with."""
        if sock is None:
            return None
        with self._lock:
            watched = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + timeout, watched, sock))
            self._pending.add(watched)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ratelimits-body-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == watched:
                self._lock.notify()  # the earliest deadline now: wake up for it
        return watched

    def done(self, watched: int | None) -> bool:
        """The read ended: stop watching it. Whether the watchdog had ended it."""
        if watched is None:
            return False
        with self._lock:
            self._pending.discard(watched)  # its heap entry is dropped when it comes up
            if watched in self._shut:
                self._shut.discard(watched)
                return True
            return False

    def _run(self) -> None:
        with self._lock:
            while True:
                while self._heap and self._heap[0][1] not in self._pending:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._lock.wait()
                    continue
                deadline, watched, sock = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                heapq.heappop(self._heap)
                self._pending.discard(watched)
                self._shut.add(watched)
                with contextlib.suppress(OSError):  # closed meanwhile: its read has ended anyway
                    sock.shutdown(socket.SHUT_RD)


_watchdog = _Watchdog()
os.register_at_fork(after_in_child=_watchdog.reset)
