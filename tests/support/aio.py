"""Driving async code from sync tests: one event loop in a thread of its own, for the whole test.

A ``redis.asyncio`` connection belongs to the loop it was made in, so every call a test makes
runs on the same loop, as an ASGI server's do: :class:`EventLoopThread` keeps it running, and
:class:`AsyncDriven` makes a backend's ``decide`` and ``lease`` go through its ``adecide`` and
``alease`` there.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["AsyncDriven", "EventLoopThread", "asgi_get", "event_loop_thread"]

T = TypeVar("T")

#: How long one awaited call may take before the test fails (a stuck loop must not hang the suite).
CALL_TIMEOUT_S = 30.0


class EventLoopThread:
    """An event loop running in a daemon thread until :meth:`stop`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-event-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and wait for its result (or its exception)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT_S)
        self.loop.close()


@contextmanager
def event_loop_thread() -> Iterator[EventLoopThread]:
    loop = EventLoopThread()
    try:
        yield loop
    finally:
        loop.stop()


class AsyncDriven:
    """``backend`` whose ``decide`` and ``lease`` are its ``adecide`` and ``alease``, awaited on ``loop``."""

    def __init__(self, backend: Any, loop: EventLoopThread) -> None:
        self.backend = backend
        self._loop = loop

    def decide(self, checks: Any, *, consume: bool = True, usage: Any = None) -> Any:
        return self._loop.run(self.backend.adecide(checks, consume=consume, usage=usage))

    def lease(self, checks: Any, wants: Any, *, usage: Any = None) -> Any:
        return self._loop.run(self.backend.alease(checks, wants, usage=usage))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


async def asgi_get(
    app: Any, path: str, *, headers: dict[str, str] | None = None, disconnect: asyncio.Event | None = None
) -> list[dict[str, Any]]:
    """GET ``path`` from the ASGI ``app`` as a server would, and the messages it sent back.

    Unlike Django's ``AsyncClient``, the handler runs as under uvicorn: it closes the response from
    its own context, and it listens for the client going away. With ``disconnect``, the client
    goes away once the event is set (else it stays until the handler is done).
    """
    raw = [(b"host", b"testserver")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    body_sent = False
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await (disconnect or never).wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent
