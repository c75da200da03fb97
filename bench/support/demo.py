"""The demo as its README runs it, for a benchmark: seeded, under gunicorn, on a Redis of its own.

Its database is a temporary SQLite file (the benchmarks that use it send one request at a time);
the server, the Redis and the file are all gone when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .http import serving
from .processes import REPO, gunicorn
from .redis_server import RedisServer, free_port

__all__ = ["Demo", "demo_server"]

START_TIMEOUT = 30.0


@dataclass(frozen=True)
class Demo:
    port: int
    redis: RedisServer


def _manage(env: dict[str, str], *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")


@contextlib.contextmanager
def demo_server(name: str, *, workers: int = 1, threads: int = 2) -> Iterator[Demo]:
    """``migrate`` and ``seed_demo``, then gunicorn (``workers`` x ``threads``) until the block ends."""
    workdir = Path(tempfile.mkdtemp(prefix=f"ratelimits-bench-{name}-"))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        redis_server = cleanup.enter_context(RedisServer())
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DATABASE_URL": f"sqlite:///{workdir / 'db.sqlite3'}",
            "REDIS_URL": redis_server.url,
            "SECRET_KEY": f"bench-{name}-not-secret",
            "DEBUG": "0",
            "PYTHONUNBUFFERED": "1",
        }
        _manage(env, "migrate", "--noinput", "-v", "0")
        _manage(env, "seed_demo")
        server = gunicorn(name, port=free_port(), logs=workdir, workers=workers, threads=threads)
        cleanup.callback(server.stop)
        server.start(env)
        server.wait_until(lambda: serving(server.port), START_TIMEOUT, "answer to GET /admin/login/")
        yield Demo(server.port, redis_server)
