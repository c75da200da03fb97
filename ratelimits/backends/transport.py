"""The decisions' transport: each thread's own connection to a Redis node, and packed commands on it.

A decision is one packed write and one read on a connection nobody else uses: redis-py's generic
command path and its pool's check-out bookkeeping cost more than the decide script itself on
loopback. This module is the one place the Redis backends go below redis-py's client API, and it
uses only what redis-py's own pipelines use: a connection made as its pool makes one
(``connection_class(**connection_kwargs)``), ``connect``, ``disconnect``, ``can_read``,
``send_packed_command``, ``read_response`` and the ``pid`` it was made in. Whether a connection is
connected is asked through :func:`connected` (``is_connected`` where redis-py has it).
``tests/test_transport.py`` runs this module on the newest redis-py and the oldest the package
supports (``redis>=5.0``), against a real server.

It imports nothing of the package: that test loads it on its own, with redis-py alone installed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.connection import AbstractConnection

try:
    import hiredis
except ImportError:  # optional: redis-py's own packer is used instead
    hiredis = None  # type: ignore[assignment]

__all__ = ["IDLE_CHECK_S", "ThreadConnections", "call", "connected", "pack", "read", "send"]

#: After how long unused (seconds) a thread's connection is asked whether the server closed it.
IDLE_CHECK_S = 0.005


def _is_connected(connection: Any) -> bool:
    return bool(connection.is_connected)


def _has_socket(connection: Any) -> bool:
    # redis-py before 8 says it no other way; its pool's own check-out reads the same attribute.
    return connection._sock is not None


#: Whether ``connection`` has a socket to the server (redis-py 8's ``is_connected``, or its socket).
connected: Callable[[Any], bool] = (
    _is_connected if isinstance(getattr(AbstractConnection, "is_connected", None), property) else _has_socket
)


class ThreadConnections:
    """Each thread's own connections, made on first use with ``make(pool, **address)``.

    A connection inherited through ``fork`` is replaced, never used: parent and child would read
    each other's replies. It is told by the process id it was made in (a system call per decision,
    as redis-py's pool pays): a count kept by ``os.register_at_fork`` would miss a server that
    forks its workers from C without telling Python (uWSGI, by default). One unused for a while
    (:data:`IDLE_CHECK_S`) is asked whether the server closed it, as redis-py's pool asks on
    check-out. An unconnected one is connected here, as the pool does: a Sentinel connection
    finds the master as it connects.
    """

    def __init__(self, make: Callable[..., Any]) -> None:
        self._make = make
        self._local = threading.local()

    def own(self, pool: Any) -> Any:
        """This thread's connection made with ``pool``'s settings: on one Redis, every decision's.

        :meth:`node` written out for the one connection (a decision takes it: a dict costs).
        """
        local = self._local
        connection = getattr(local, "connection", None)
        now = time.monotonic()
        if connection is None or connection.pid != os.getpid():
            connection = local.connection = self._make(pool)
            local.used_at = now
        elif now - local.used_at > IDLE_CHECK_S and connected(connection):
            _drop_if_stale(connection)
        if not connected(connection):
            connection.connect()
        local.used_at = now
        return connection

    def node(self, name: str, pool: Any, **address: Any) -> Any:
        """This thread's connection ``name`` (a cluster node's), made with ``pool``'s settings and ``address``."""
        local = self._local
        try:
            connections, used = local.connections, local.used
        except AttributeError:
            connections, used = local.connections, local.used = {}, {}
        connection = connections.get(name)
        now = time.monotonic()
        if connection is None or connection.pid != os.getpid():
            connection = connections[name] = self._make(pool, **address)
            used[name] = now
        elif now - used[name] > IDLE_CHECK_S and connected(connection):
            _drop_if_stale(connection)
        if not connected(connection):
            connection.connect()
        used[name] = now
        return connection


def _drop_if_stale(connection: Any) -> None:
    """Disconnect an idle connection with something to read: the server closed it (a restart), or a stray reply.

    Asked only after a pause (:data:`IDLE_CHECK_S`): the question is a system call, and a server
    cannot restart between two decisions a few milliseconds apart.
    """
    try:
        stale = connection.can_read()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        stale = True
    if stale:
        connection.disconnect()


def pack(connection: Any, command: tuple[Any, ...]) -> list[bytes]:
    """``command`` in the protocol, as one buffer where hiredis packs it."""
    if hiredis is not None:
        return [hiredis.pack_command(command)]
    return list(connection.pack_command(*command))


def send(connection: Any, *commands: tuple[Any, ...]) -> None:
    """Write ``commands`` in one send (their replies are read in order with :func:`read`)."""
    packed = pack(connection, commands[0]) if len(commands) == 1 else [b for c in commands for b in pack(connection, c)]
    connection.send_packed_command(packed, check_health=False)


def read(connection: Any) -> Any:
    """The next reply on ``connection`` (an error reply raises, as redis-py raises it)."""
    return connection.read_response()


def call(connection: Any, *command: Any) -> Any:
    """Send ``command`` and read its reply."""
    connection.send_packed_command(pack(connection, command), check_health=False)
    return connection.read_response()
