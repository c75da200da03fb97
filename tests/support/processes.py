"""One process supervisor for every server a test starts (gunicorn, Celery, redis-server).

Each process runs in a session of its own, its output in a log file. It is stopped by the PID it
got and its process group (so its children go with it), never by name: SIGTERM first, SIGKILL
after a grace period. Every wait is a bounded poll of a condition, failing with the log's tail.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPO", "VENV_BIN", "Service", "gunicorn", "manage", "uvicorn"]

REPO = Path(__file__).resolve().parents[2]
#: The virtualenv's scripts (gunicorn, celery), beside the interpreter running the tests.
VENV_BIN = Path(sys.executable).parent
#: How long a ``manage.py`` command may run.
MANAGE_TIMEOUT = 120.0


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py`` with ``env`` in the repository; fail with its output if it fails."""
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=MANAGE_TIMEOUT
    )
    assert result.returncode == 0, f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def gunicorn(
    name: str,
    *,
    port: int,
    logs: Path,
    workers: int = 1,
    threads: int = 1,
    timeout: int = 30,
    worker_class: str | None = None,
) -> Service:
    """The demo (``project.wsgi``) under gunicorn on ``port``: its master and ``workers`` workers of ``threads``."""
    argv = [
        str(VENV_BIN / "gunicorn"),
        *([f"--worker-class={worker_class}"] if worker_class else []),
        f"--workers={workers}",
        f"--threads={threads}",
        f"--bind=127.0.0.1:{port}",
        f"--timeout={timeout}",
        "--graceful-timeout=5",
        # Otherwise every gunicorn 27 master binds the same ~/.gunicorn/gunicorn.ctl.
        "--no-control-socket",
        "project.wsgi",
    ]
    return Service(name, argv, logs, port=port)


def uvicorn(name: str, *, port: int, logs: Path, workers: int = 1) -> Service:
    """The demo's ASGI application (``project.asgi``) under uvicorn on ``port``, with ``workers`` processes."""
    argv = [
        str(VENV_BIN / "uvicorn"),
        "project.asgi:application",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--workers={workers}",
        "--no-access-log",
        "--timeout-graceful-shutdown=5",
    ]
    return Service(name, argv, logs, port=port)


@dataclass
class Service:
    """A command run in its own session, logging to ``<logs>/<name>-<n>.log`` (one file per start)."""

    name: str
    argv: list[str]
    logs: Path
    cwd: Path = REPO
    #: The port it serves on, when it is a server.
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    log: Path | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.starts += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log = self.logs / f"{self.name}-{self.starts}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=env if env is not None else dict(os.environ),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} is not running"
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def children(self) -> list[int]:
        """The PIDs of the process's direct children (gunicorn's workers, Celery's pool)."""
        try:
            return [int(p) for p in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()]
        except OSError:
            return []

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str, *, every: float = 0.05) -> None:
        """Poll ``condition`` until it holds; fail (with the log) on a timeout or if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            assert self.running, f"{self.name} exited ({self.process and self.process.returncode}):\n{self.tail()}"
            time.sleep(every)
        raise AssertionError(f"{self.name}: no {what} within {timeout:g} s:\n{self.tail()}")

    def wait_for_log(self, pattern: str | re.Pattern[str], timeout: float, what: str) -> re.Match[str]:
        """The first match of ``pattern`` in the log, once it appears (bounded)."""
        found: list[re.Match[str]] = []

        def appeared() -> bool:
            match = re.search(pattern, self.log_text())
            if match:
                found.append(match)
            return match is not None

        self.wait_until(appeared, timeout, what, every=0.1)
        return found[0]

    def signal(self, number: int) -> None:
        """Send ``number`` to the process itself (SIGSTOP, SIGCONT...)."""
        os.kill(self.pid, number)

    def kill(self) -> None:
        """SIGKILL to the whole group at once: the process and every child, mid-work (``process`` stays, exited)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM (a graceful shutdown), SIGKILL after ``grace`` s; then SIGKILL whatever is left in its group."""
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        pid = process.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not _exited(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            # Exited but not reaped yet, so the group's id is still this process's own.
            os.killpg(pid, signal.SIGKILL)
        process.wait(timeout=10)


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it (its PID, and so its group, stay ours)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
