"""A private redis-server on a free loopback port, for tests that need one of their own."""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import redis

from .processes import Service

__all__ = ["RedisServer", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """Starts ``redis-server`` on a free loopback port; stops it by PID, never anything else.

    It keeps nothing on disk, so a restart starts empty; it may be killed, paused and flushed
    freely: the machine's own Redis is never touched. ``config`` is more of redis-server's
    arguments, e.g. ``("--maxmemory-policy", "allkeys-lru")``.
    """

    def __init__(self, port: int | None = None, *, config: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ratelimits-redis-"))
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.dir), *config]
        self.service = Service("redis", argv, self.dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.service.pid

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The server's process: ``None`` once stopped, exited (``poll()`` not ``None``) once killed."""
        return self.service.process

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> None:
        self.service.start()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Poll until the server answers PING (bounded); fail loudly with its log if it never does."""
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            self.service.wait_until(answers, timeout, f"PING answer on port {self.port}", every=0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-traffic, connections reset."""
        self.service.kill()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a stalled server)."""
        self.service.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.service.signal(signal.SIGCONT)

    def stop(self) -> None:
        self.service.stop(grace=10)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def script_calls(server: RedisServer) -> int:
    """Script calls (``FCALL``, ``EVALSHA`` and ``EVAL``) the server has run since its stats were last reset."""
    client = server.client()
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("fcall", "evalsha", "eval"))
