"""A private ``redis-server`` for one benchmark run: a free loopback port, nothing kept on disk.

The shared Redis on port 6379 is never used, and the server is stopped by its PID.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

import redis

from .processes import Service

__all__ = ["SHARED_REDIS_PORT", "RedisServer", "free_port"]

#: The machine's own Redis, which a benchmark never touches.
SHARED_REDIS_PORT = 6379


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's choice), never the shared Redis's."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port != SHARED_REDIS_PORT:
            return port


class RedisServer:
    """``redis-server`` on ``127.0.0.1:<free port>`` without persistence, in a temporary directory.

    ``config``: more arguments (``("--maxmemory", "4mb")``). ``service.argv`` may be changed before
    :meth:`start` (``bench.instructions`` runs the server under valgrind). :meth:`stop` ends it and
    removes its directory.
    """

    def __init__(self, *, config: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ratelimits-bench-redis-"))
        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir)]
        argv += ["--save", "", "--appendonly", "no", *config]
        self.service = Service(f"redis-{self.port}", argv, self.dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.service.pid

    @property
    def running(self) -> bool:
        return self.service.running

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> None:
        """Start it, and return once it answers a PING (within ``timeout`` s); stop it again if it never does."""
        self.service.start()
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)

        def answers() -> bool:
            try:
                return bool(probe.ping())
            except redis.RedisError:
                return False

        try:
            self.service.wait_until(answers, timeout, f"answer to PING on port {self.port}", every=0.02)
        except BaseException:
            self.service.stop(grace=1)
            raise
        finally:
            probe.close()

    def stop(self) -> None:
        self.service.stop(grace=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
