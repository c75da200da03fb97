"""The decision path's ``redis.asyncio`` clients: one per event loop, made like the sync connections.

An async view's decision is the same script call as a sync one's, sent on a connection of the
running event loop: a ``redis.asyncio`` connection belongs to the loop it was made in. Its
address, credentials and TLS come from the sync client's pool; its timeouts are the limiter's,
and it never retries. Only what ``redis.asyncio`` can make the same way is made: a plain, TLS or
Unix socket connection. A Sentinel-managed one is not (its master is found by the sync client's
Sentinel), nor a cluster's; :func:`async_pool_factory` says ``None`` and those stores are asked
from a thread instead.

A loop ``async_to_sync`` made for one call (an async view under WSGI, adrf's throttles there) is
gone after it: a client made for it would be a connection, and a TCP handshake, per request.
:meth:`AsyncClients.current` says ``None`` there, and the sync call is made in one of
:data:`~ratelimits.backends.base.STORE_THREADS` instead, on that thread's own lasting connection.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection
from asgiref.sync import AsyncToSync
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = ["AsyncClients", "async_pool_factory"]

logger = logging.getLogger("ratelimits")

#: The sync connection classes ``redis.asyncio`` has a twin of.
_TWINS: dict[type, type] = {
    redis.connection.Connection: redis.asyncio.connection.Connection,
    redis.connection.SSLConnection: redis.asyncio.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection: redis.asyncio.connection.UnixDomainSocketConnection,
}
#: What the sync pool's arguments say that an async connection is told otherwise, or not at all.
_REPLACED = {"retry", "retry_on_timeout", "retry_on_error", "connection_pool", "cache", "cache_config"}
#: The most connections one loop's client opens. A decision waits for a free one rather than fail
#: at once: a burst of concurrent decisions must not read as the store failing.
MAX_CONNECTIONS = 64
#: How long a decision waits for a free connection when the pool has no timeout to go by (seconds).
POOL_WAIT_S = 1.0


def async_pool_factory(
    pool: Any, timeouts: tuple[float, float] | None
) -> Callable[[], redis.asyncio.ConnectionPool] | None:
    """How to make an event loop's pool like ``pool`` (a sync client's), or ``None`` if it cannot be made.

    ``timeouts``: (socket, connect) seconds that override the pool's, as on the sync path.
    Arguments an async connection does not take are left out only if they say nothing (``None``
    or false); one that says something, a TLS option an async connection lacks, means no twin.
    """
    twin = _TWINS.get(pool.connection_class)
    if twin is None:
        return None
    accepted = _parameters(twin)
    kwargs: dict[str, Any] = {}
    for name, value in pool.connection_kwargs.items():
        if name in _REPLACED:
            continue
        if name in accepted:
            kwargs[name] = value
        elif value not in (None, False, (), {}):
            return None
    kwargs["decode_responses"] = False  # replies are read as bytes, whatever the client decodes
    if timeouts is not None:
        kwargs["socket_timeout"], kwargs["socket_connect_timeout"] = timeouts
    # A consume that may have run is never sent twice: no retry of any kind.
    kwargs.update(retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)

    # Waiting for a free connection is bounded like connecting: all 64 busy for that long is a
    # store too slow for this loop's load, and is counted as its failure. (A connection handed
    # over may still connect, within its own connect timeout.)
    wait = kwargs.get("socket_connect_timeout") or kwargs.get("socket_timeout") or POOL_WAIT_S

    def make() -> redis.asyncio.ConnectionPool:
        return redis.asyncio.BlockingConnectionPool(
            connection_class=twin, max_connections=MAX_CONNECTIONS, timeout=wait, **kwargs
        )

    return make


#: The loops asgiref's ``async_to_sync`` made and runs for one call, while they run (an asgiref
#: detail, read defensively: without it, such a loop's client is dropped when the loop is closed).
_ONE_CALL_LOOPS: dict[asyncio.AbstractEventLoop, Any] | None = getattr(AsyncToSync, "loop_thread_executors", None)


def _parameters(cls: type) -> set[str]:
    """Every argument ``cls`` and the classes it passes ``**kwargs`` on to take by name."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and klass is not object:
            names |= set(inspect.signature(init).parameters) - {"self", "args", "kwargs"}
    return names


class AsyncClients:
    """One ``redis.asyncio`` client per long-lived event loop (an ASGI server's), made on first use.

    A client's connections refer to their loop, so a loop's entry would outlive it: each new
    client drops those of loops closed since (a script's ``asyncio.run()`` calls, one after another).
    """

    def __init__(self, make_pool: Callable[[], redis.asyncio.ConnectionPool]) -> None:
        self._make_pool = make_pool
        self._clients: dict[asyncio.AbstractEventLoop, redis.asyncio.Redis] = {}
        self._lock = threading.Lock()
        if _ONE_CALL_LOOPS is None:
            logger.warning(
                "ratelimits: this asgiref has no AsyncToSync.loop_thread_executors; an async view under "
                "WSGI opens a Redis connection per request"
            )

    def current(self) -> redis.asyncio.Redis | None:
        """The running loop's client (call from a coroutine); ``None`` in a loop made for one call."""
        loop = asyncio.get_running_loop()
        if _ONE_CALL_LOOPS is not None and loop in _ONE_CALL_LOOPS:
            return None
        client = self._clients.get(loop)
        if client is None:
            with self._lock:
                client = self._clients.get(loop)
                if client is None:
                    for closed in [other for other in self._clients if other.is_closed()]:
                        del self._clients[closed]  # its sockets close as they are collected
                    client = self._clients[loop] = redis.asyncio.Redis(connection_pool=self._make_pool())
        return client

    def __len__(self) -> int:
        """How many loops have a client (closed ones not dropped yet included)."""
        return len(self._clients)
