"""The invalidation channel: how a policy change or an admin's reset reaches every process at once.

A worker answers some requests from what it remembers (:mod:`ratelimits.engine.local`): denials
that nothing can end early, and tokens it leased from the store. A policy change or a reset makes
that memory stale in every process, including those whose requests never reach the store while
they are answered from it. So the store that decides also carries the word: ``publish_version``
and ``clear`` ``PUBLISH`` on the channel ``<prefix>#invalidate``, and each process keeps one
subscription to it, read by a daemon thread.

The memory is trusted only while the subscription is live. Each (re)subscription empties it first
(messages may have been missed while it was down), and a subscription that stops answering its
``PING`` is dropped within :data:`PING_EVERY_S` twice over.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import redis

__all__ = ["RESET", "Subscription", "channel", "held", "version_message"]

logger = logging.getLogger("ratelimits")

#: The message of an admin's reset (every process forgets what it remembers of every subject).
RESET = b"r"
#: Seconds without a message after which the listener asks the store whether it is still there.
PING_EVERY_S = 1.0
#: Seconds between attempts to subscribe again, doubled after each failure up to the second.
BACKOFF_S = (0.05, 2.0)


def channel(prefix: str) -> str:
    return f"{prefix}#invalidate"


def version_message(version: int) -> bytes:
    """The message of a new policy version (``v`` and the version)."""
    return b"v%d" % version


class Subscription:
    """This process's subscription to the invalidation channel, kept by a daemon thread.

    ``connect`` makes a new, unconnected redis-py connection to the store; ``on_message`` is called
    in the thread with each message, and with ``None`` whenever the subscription (re)starts. It is
    held weakly when it is a bound method: once its object is gone (the limiter was rebuilt after a
    change of settings), the thread ends.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        name: str,
        on_message: Callable[[bytes | None], None],
        *,
        wait: bool = True,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.channel = name
        self._connect = connect
        self._on_message = held(on_message)
        #: Called (held as ``on_message`` is) at least every PING_EVERY_S while subscribed: work a
        #: process does in the background, off the request path (adding usage counted in memory).
        self._on_tick = held(on_tick) if on_tick is not None else None
        self._live = False
        #: The store refused the channel (an ACL without it): nothing is ever trusted, nor retried.
        self.refused = False
        self._pid = os.getpid()
        self._stopped = threading.Event()
        # With ``wait``, the first subscription is made here, so memory is trusted from the first
        # request on; if the store cannot be reached now, the thread keeps trying.
        first = None
        if wait:
            try:
                first = self._subscribe()
            except Exception as exc:
                self._refused(exc)
                if not self.refused:
                    logger.warning("ratelimits: invalidation channel unavailable (%s); retrying in the background", exc)
        if not self.refused:
            threading.Thread(target=self._run, args=(first,), name="ratelimits-invalidations", daemon=True).start()

    @property
    def live(self) -> bool:
        """Whether every message published from now on reaches ``on_message`` (not in a forked child)."""
        return self._live and self._pid == os.getpid()

    def stop(self) -> None:
        self._stopped.set()

    def _tell(self, message: bytes | None) -> None:
        on_message = self._on_message()
        if on_message is None:
            self.stop()  # nobody listens any more
        else:
            on_message(message)

    def _subscribe(self) -> Any:
        """A connection subscribed to the channel, after memory was emptied; raises if there is none."""
        connection = self._connect()
        try:
            connection.connect()
            connection.send_command("SUBSCRIBE", self.channel)
            confirmed = connection.read_response(push_request=True)
            if not (isinstance(confirmed, list) and confirmed[:1] == [b"subscribe"]):
                raise ConnectionError(f"unexpected reply to SUBSCRIBE: {confirmed!r}")
            self._tell(None)  # whatever is remembered may have missed a message meanwhile
        except BaseException:
            connection.disconnect()
            raise
        self._live = True
        return connection

    def _refused(self, exc: BaseException) -> None:
        if isinstance(exc, redis.exceptions.NoPermissionError):
            self.refused = True
            self.stop()
            logger.warning("ratelimits: the store refuses the invalidation channel (%s): no local fast path", exc)

    def _run(self, connection: Any) -> None:
        delay, cap = BACKOFF_S
        while not self._stopped.is_set() and self._on_message() is not None:
            try:
                if connection is None:
                    connection = self._subscribe()
                    logger.info("ratelimits: invalidation channel subscribed")
                delay = BACKOFF_S[0]
                self._listen(connection)
            except Exception as exc:  # any failure: nothing remembered is trusted until subscribed again
                self._refused(exc)
                logger.debug("ratelimits: invalidation channel unavailable (%s); retrying in %.2f s", exc, delay)
            finally:
                self._live = False
                if connection is not None:
                    connection.disconnect()
                connection = None
            self._stopped.wait(delay)  # backoff between attempts, in this thread only
            delay = min(delay * 2, cap)

    def _tick(self) -> None:
        tick = self._on_tick() if self._on_tick is not None else None
        if tick is not None:
            try:
                tick()
            except Exception as exc:  # the channel outlives whatever the tick ran into
                logger.debug("ratelimits: background work on the invalidation thread failed: %s", exc)

    def _listen(self, connection: Any) -> None:
        pinged_at: float | None = None
        while not self._stopped.is_set():
            self._tick()
            if not connection.can_read(timeout=PING_EVERY_S):
                if self._on_message() is None:
                    self.stop()
                elif pinged_at is not None:
                    raise ConnectionError(f"no answer to PING in {PING_EVERY_S:g} s")
                else:
                    connection.send_command("PING")
                    pinged_at = time.monotonic()
                continue
            reply = connection.read_response(push_request=True)
            kind = reply[0] if isinstance(reply, list) and reply else reply
            if kind == b"message":
                self._tell(reply[2])
            elif kind in (b"pong", b"PONG"):  # RESP2 answers a subscribed PING with a list, RESP3 with PONG
                pinged_at = None
            else:
                raise ConnectionError(f"unexpected message on the invalidation channel: {reply!r}")


C = TypeVar("C", bound=Callable[..., None])


def held(callback: C) -> Callable[[], C | None]:
    """A weak reference to a bound method (a strong one to anything else), called to get it back."""
    if inspect.ismethod(callback):
        return weakref.WeakMethod(callback)
    return lambda: callback
