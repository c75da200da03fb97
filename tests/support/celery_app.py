"""The demo's Celery worker and beat as processes of a test's own, on RabbitMQ and a queue named for the run.

``RATELIMITS_TEST_BROKER_URL`` names the broker (by default ``amqp://guest:guest@127.0.0.1:5672//``).
Tasks go to a queue of the run's own, so that runs sharing the broker's vhost never take each
other's tasks; the queue is deleted afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
import urllib.parse
from pathlib import Path
from typing import NamedTuple

from celery import Celery

from .processes import REPO, VENV_BIN, Service

__all__ = [
    "BROKER_URL",
    "CeleryProcesses",
    "broker_reachable",
    "celery",
    "celery_env",
    "celery_processes",
    "delete_queue",
    "worker_argv",
]

BROKER_URL = os.environ.get("RATELIMITS_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def broker_reachable() -> bool:
    parts = urllib.parse.urlsplit(BROKER_URL)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=2):
            return True
    except OSError:
        return False


def celery(name: str, logs: Path, *argv: str) -> Service:
    """``celery -A project <argv>`` (the demo's Celery app), its pool children in its process group."""
    return Service(name, [str(VENV_BIN / "celery"), "-A", "project", *argv], logs)


def worker_argv(queue: str, node: str, concurrency: int = 2) -> list[str]:
    """A worker on ``queue`` only, without the cluster chatter a test does not need."""
    return [
        "worker",
        "-Q",
        queue,
        "-n",
        f"{node}@%h",
        "--concurrency",
        str(concurrency),
        "--pool",
        "prefork",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "info",
    ]


def delete_queue(client: Celery, queue: str) -> None:
    # Durable, and named for this run: nobody else would ever delete it.
    with client.connection_for_write() as conn:
        conn.default_channel.queue_delete(queue=queue)
        conn.default_channel.exchange_delete(exchange=queue)


def celery_env(*, database_url: str, redis_url: str, queue: str, **extra: str) -> dict[str, str]:
    """The environment of a worker and beat on ``tests.support.celery_settings`` (``extra``: more of it)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "DJANGO_SETTINGS_MODULE": "tests.support.celery_settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": BROKER_URL,
        "RATELIMITS_TEST_CELERY_QUEUE": queue,
        "SECRET_KEY": "celery-test-" + secrets.token_hex(8),
        "DEBUG": "0",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


class CeleryProcesses(NamedTuple):
    """A test's own worker and beat (not started), and a client of the broker to publish with."""

    client: Celery
    worker: Service
    beat: Service

    def print_logs(self) -> None:
        for process in (self.worker, self.beat):
            print(f"\n--- {process.name} log {process.log} (tail) ---\n{process.tail()}")


def celery_processes(cleanup: contextlib.ExitStack, *, queue: str, node: str, concurrency: int = 2) -> CeleryProcesses:
    """A worker (``concurrency`` pool processes) on ``queue`` and a beat ticking at least every second.

    ``cleanup`` stops both when it closes, then deletes their logs and the run's queue.
    """
    client = Celery(f"{node}-client", broker=BROKER_URL, set_as_current=False, fixups=[])
    cleanup.callback(client.close)
    cleanup.callback(delete_queue, client, queue)  # runs after the worker and beat are stopped
    logs = Path(tempfile.mkdtemp(prefix=f"{node}-"))
    cleanup.callback(shutil.rmtree, logs, ignore_errors=True)
    worker = celery("worker", logs, *worker_argv(queue, node, concurrency))
    beat = celery("beat", logs, "beat", "-s", str(logs / "beat-schedule"), "--max-interval", "1", "-l", "info")
    cleanup.callback(worker.stop)
    cleanup.callback(beat.stop)
    return CeleryProcesses(client, worker, beat)
