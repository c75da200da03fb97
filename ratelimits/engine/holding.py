"""What an admitted request holds until it is over, and how it is given back.

An admitted request may hold slots (a concurrency limit's, the fleet's in-flight set) and its
place in the worker shedder. They are kept on the request and given back when Django closes its
response, under WSGI and ASGI alike; when no response is closed (a client gone under ASGI) by
``request_finished`` within the request's context; and as a last resort when the request is
collected, by a thread of this module's (a finalizer must not call the store itself). After a
fork the child starts afresh. :func:`after_response` also does what the limiter catches up on
off the decision path.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asgiref.sync import SyncToAsync
from django.core.signals import request_finished, request_started

from ..decisions import Decision
from .limiter import Limiter, current_limiter
from .settling import Settlement, settle
from .shedding import WorkerShedder, get_worker_shedder

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = ["HELD_ATTRIBUTE", "Held", "after_response", "hold", "holds_anything", "note_response", "note_status"]

logger = logging.getLogger("ratelimits")


@dataclass(slots=True, kw_only=True)
class Held:
    """What an admitted request holds until it finishes: its slots, and its place in the worker shedder."""

    limiter: Limiter
    decision: Decision
    shedder: WorkerShedder | None = None
    #: For the adaptive capacity: the endpoint, when its decision ended (monotonic: the view's
    #: latency starts there), and its response's status and time once a middleware saw it (else
    #: the time it is released is used).
    endpoint: str | None = None
    admitted_at: float = 0.0
    status: int | None = None
    answered_at: float | None = None
    #: What settles the request's charge after its response, where its endpoint says so (:mod:`.settling`).
    settlement: Settlement | None = None


#: The request attribute that keeps the list of what it holds.
HELD_ATTRIBUTE = "_ratelimit_held"


def holds_anything(decision: Decision, shedder: WorkerShedder | None) -> bool:
    """Whether a request so decided has anything to give back when it finishes: slots, or its place in the shedder."""
    return decision.slot is not None or decision.stray_slot is not None or shedder is not None


def hold(request: HttpRequest, item: Held) -> None:
    """Keep ``item`` (which holds something: :func:`holds_anything`) until the request's response
    is closed, or the request is over.

    The list is kept on the request, and the request's ``close`` releases it: Django calls it when
    it closes the response, under WSGI and ASGI alike, sync or async, after a streaming body too.
    (Not a context variable: Django 5.2's ASGI handler decides a request in a task of its own,
    with a copy of its context, and closes the response from its own context.)

    When no response is closed, because the client went away under ASGI and Django cancelled the
    view, Django still sends ``request_finished``, within the request's ``ThreadSensitiveContext``:
    :func:`after_response` releases the list it finds kept under that context. Whatever is left
    after that (work the view left in a thread of its own, an outer context shared by several
    requests) is released when the request is collected.
    """
    http_request: Any = getattr(request, "_request", request)  # DRF's Request wraps Django's
    held: list[Held] | None = getattr(http_request, HELD_ATTRIBUTE, None)
    if held is None:
        held = []
        setattr(http_request, HELD_ATTRIBUTE, held)
        _release_on_close(http_request, held)
        weakref.finalize(http_request, _release_abandoned, held).atexit = False
        if _releaser is None:
            _start_releaser()
        context = _request_context()
        if context is not None:
            _held_in[context] = (held, weakref.ref(http_request))
    held.append(item)


#: The context variable asgiref keeps the current ``ThreadSensitiveContext`` in. Django's ASGI
#: handler opens one per request, around all of it (an asgiref detail, read defensively).
_THREAD_SENSITIVE: Any = getattr(SyncToAsync, "thread_sensitive_context", None)
#: How many requests each such context saw start: one, or it is not one request's own (an outer
#: one, opened around a server), and what is kept under it cannot be told apart.
_started_in: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_started_lock = threading.Lock()
#: Request context -> the list of what its request holds, and the request.
_held_in: weakref.WeakKeyDictionary[Any, tuple[list[Held], weakref.ref[Any]]] = weakref.WeakKeyDictionary()


def _thread_sensitive_context() -> Any:
    """The current ``ThreadSensitiveContext``, if any."""
    return _THREAD_SENSITIVE.get(None) if _THREAD_SENSITIVE is not None else None


def _request_context() -> Any:
    """The current ``ThreadSensitiveContext`` if it is one ASGI request's own, else ``None``."""
    context = _thread_sensitive_context()
    return context if context is not None and _started_in.get(context) == 1 else None


def _request_started(**kwargs: Any) -> None:
    """Count the request in its ``ThreadSensitiveContext`` (connected to ``request_started``)."""
    context = _thread_sensitive_context()
    if context is not None:
        with _started_lock:
            _started_in[context] = _started_in.get(context, 0) + 1


def _release_on_close(request: Any, held: list[Held]) -> None:
    """Make ``request.close`` release ``held`` first.

    The wrapper holds the request: the response's closers then keep it alive until the body is
    sent, as Django's own ``request.close`` does, so the finalizer cannot release early. The cycle
    it makes is undone once it has run; a request no response closes waits for the collector.
    """
    close = request.close

    def release_then_close() -> None:
        try:
            _release(held)
        finally:
            if request.__dict__.get("close") is release_then_close:
                del request.close
            close()

    release_then_close.releases_held = True  # type: ignore[attr-defined]
    request.close = release_then_close


def _release_abandoned(held: list[Held]) -> None:
    """Release what a request no response closed still holds, once it is collected.

    A finalizer runs wherever a collection starts, maybe with a lock held or on an event loop:
    it only hands the list to the releasing thread (``SimpleQueue.put`` is safe there)."""
    if held:
        _abandoned.put(held)


#: Lists of collected requests, for :func:`_releasing` to release.
_abandoned: queue.SimpleQueue[list[Held]] = queue.SimpleQueue()
_releaser: threading.Thread | None = None
_releaser_lock = threading.Lock()


def _start_releaser() -> None:
    """Start the thread that releases collected requests' lists, once per process."""
    global _releaser
    with _releaser_lock:
        if _releaser is None:
            _releaser = threading.Thread(target=_releasing, name="ratelimits-release", daemon=True)
            _releaser.start()


def _releasing() -> None:
    while True:
        held = _abandoned.get()
        try:
            _release(held)
        except Exception:  # _release logs its own; this thread must outlive anything
            logger.exception("ratelimits: a collected request's holdings could not be released")


def _after_fork() -> None:
    """A forked child has none of the parent's threads, and the parent's lists are the parent's."""
    global _releaser, _releaser_lock, _abandoned, _started_lock
    _releaser, _releaser_lock, _abandoned, _started_lock = None, threading.Lock(), queue.SimpleQueue(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _held_by(request: HttpRequest) -> list[Held] | None:
    held: list[Held] | None = getattr(getattr(request, "_request", request), HELD_ATTRIBUTE, None)
    return held


def note_response(request: HttpRequest, status: int, *, streaming: bool = False) -> None:
    """Tell the adaptive capacity how the request's view answered: its status, and now.

    Called by :class:`~ratelimits.middleware.EarlyRejectionMiddleware` on the way out (which also
    tells the request's settlement, :func:`note_status`, if nothing inside it did). A request
    this app refused in the end (a later decision, after the shedder admitted it) never ran its
    view: it teaches nothing. A streaming response is timed to its release, when its body
    has been made.
    """
    held = _held_by(request)
    if not held:
        return
    note_status(request, status)
    refused = getattr(request, "ratelimit", None)
    view_ran = not (isinstance(refused, Decision) and not refused.allowed)
    now = None if streaming else time.monotonic()
    for item in held:
        if item.shedder is None or item.status is not None or item.endpoint is None:
            continue
        if view_ran:
            item.status, item.answered_at = status, now
        else:
            item.endpoint = None


def note_status(request: HttpRequest, status: int) -> None:
    """Tell the request's settlement (:mod:`.settling`) its response's status; a middleware or
    decorator of this app that sees the response calls it, the innermost first. The last wins:
    an outer one sees the response as it leaves (a 500 a render raised after the view returned)."""
    held = _held_by(request)
    for item in held or ():
        if item.settlement is not None:
            item.settlement.status = status


def after_response(**kwargs: Any) -> None:
    """After a response (connected to ``request_finished``), off the decision path: catch up on
    what an outage left behind.

    Releases that could not reach the store are retried (the slot's expiry is the last resort),
    ended leases give their unused tokens back, usage counted during an outage or answered from
    memory is added to the store's counters, and an adaptive capacity is published for the admin.
    First, what the request still holds is released: under ASGI, when its client went away and
    no response was closed (see :func:`hold`).
    """
    # Only a handler's: a response a view made and closed itself sends the signal too (sender None).
    context = _request_context() if kwargs.get("sender") is not None else None
    kept = _held_in.pop(context, None) if context is not None else None
    if kept is not None:
        held, request = kept
        if held:
            _release(held)
        alive = request()
        if alive is not None and getattr(alive.__dict__.get("close"), "releases_held", False):
            del alive.close  # our wrapper, which keeps the request in a cycle
    current = current_limiter()
    if current is not None:
        current.retry_releases()
        current.return_leases()
        current.flush_usage()
        shedder = get_worker_shedder()
        if shedder is not None and shedder.controller is not None:
            current.publish_worker_state(shedder.state)


def _release(held: list[Held]) -> None:
    """Give back what ``held`` holds, once: emptied in place, as the request's ``close`` and its
    finalizer share the list. One item's failure is logged; the others are released all the same."""
    items = []
    try:
        while True:
            items.append(held.pop())  # each pop atomic: two callers never release one item twice
    except IndexError:
        pass
    now = time.monotonic()
    for item in reversed(items):
        try:
            if item.shedder is not None:
                latency = (item.answered_at or now) - item.admitted_at
                error = item.status is not None and item.status >= 500
                item.shedder.finish(item.endpoint, latency, error=error, admitted_at=item.admitted_at)
        except Exception:
            logger.exception("ratelimits: the worker shedder could not count a request out")
        if item.settlement is not None:
            try:
                settle(item.limiter, item.decision, item.settlement)
            except Exception:
                logger.exception("ratelimits: a request's charge could not be settled (it stays as admitted)")
        try:
            item.limiter.release(item.decision)  # whatever the shedder did
        except Exception:
            logger.exception("ratelimits: a request's slots could not be released (they expire)")


request_started.connect(_request_started, dispatch_uid="ratelimits.engine.request_started")
request_finished.connect(after_response, dispatch_uid="ratelimits.engine.after_response")
