"""A webhook receiver over real HTTP on a loopback port: what it was sent, and an outage on demand.

It answers each POST with ``status`` (204 by default) and keeps every request it read. ``down()``
closes its socket (a sender is refused at connect, as by a receiver that is not running), and
``up()`` listens again on the same port. ``hold()`` makes it read the next requests and answer
none until ``release()``: a sender caught in the middle of an attempt.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .polling import wait_until

__all__ = ["Received", "Receiver"]

#: The longest a held request waits for ``release()``.
HOLD_BOUND_S = 60.0


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    #: Whether it was answered (a request read while held was not: its sender may have died waiting).
    answered: bool = True


class Receiver:
    def __init__(self, status: int = 204, location: str = "") -> None:
        self.status = status
        #: A ``Location`` to answer with (a redirect a sender must not follow).
        self.location = location
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._held = threading.Event()
        self._released = threading.Event()
        self.port = 0
        self.up()

    def hold(self) -> None:
        self._released.clear()
        self._held.set()

    def release(self) -> None:
        self._held.clear()
        self._released.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def up(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                held = receiver._held.is_set()
                with receiver._lock:
                    receiver.received.append(Received(self.path, dict(self.headers.items()), body, not held))
                if held:
                    receiver._released.wait(HOLD_BOUND_S)
                    return  # no answer: the connection closes with the handler
                self.send_response(receiver.status)
                if receiver.location:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def down(self) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def wait_for(self, condition: Callable[[list[Received]], bool], timeout: float, what: str) -> list[Received]:
        """Wait until ``condition(received)`` holds; the requests received then."""

        def check() -> bool:
            with self._lock:
                return condition(list(self.received))

        held = wait_until(check, timeout)
        with self._lock:
            received = list(self.received)
        assert held, f"the receiver did not get {what} within {timeout:g} s: {[r.body for r in received]}"
        return received

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
