"""The demo under gunicorn: a private Redis, a throwaway PostgreSQL database, ``migrate`` and ``seed_demo``."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .http import serving
from .postgres import throwaway_database
from .processes import Service, gunicorn, manage, uvicorn
from .redis_server import RedisServer, free_port

__all__ = ["Demo", "demo_server"]

START_TIMEOUT = 30.0


@dataclass(frozen=True)
class Demo:
    port: int
    database_url: str
    redis: RedisServer
    #: The server's process (its master, under gunicorn): its ``children()`` are the workers.
    server: Service | None = None


@contextlib.contextmanager
def demo_server(
    name: str, *, workers: int, threads: int = 1, env: Mapping[str, str] | None = None, asgi: bool = False
) -> Iterator[Demo]:
    """``gunicorn --workers N --threads M project.wsgi`` on a seeded demo; everything stopped by PID after.

    ``env``: more of the processes' environment. ``asgi``: ``uvicorn --workers N project.asgi`` instead.
    """
    extra = env
    with contextlib.ExitStack() as cleanup:
        redis_server = cleanup.enter_context(RedisServer())
        database_url = cleanup.enter_context(throwaway_database(f"ratelimits_{name}"))
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_server.url,
            "SECRET_KEY": f"{name}-test-" + secrets.token_hex(8),
            "DEBUG": "0",
            "PYTHONUNBUFFERED": "1",
            **(extra or {}),
        }
        manage(env, "migrate", "--noinput", "-v", "0")
        manage(env, "seed_demo")
        logs = Path(tempfile.mkdtemp(prefix=f"ratelimits-{name}-"))
        cleanup.callback(shutil.rmtree, logs, ignore_errors=True)
        if asgi:
            server = uvicorn(name, port=free_port(), logs=logs, workers=workers)
        else:
            server = gunicorn(name, port=free_port(), logs=logs, workers=workers, threads=threads)
        cleanup.callback(server.stop, grace=10)
        server.start(env)
        server.wait_until(lambda: serving(server.port), START_TIMEOUT, "answer to GET /admin/login/")
        yield Demo(server.port, database_url, redis_server, server)
