"""A process of the benchmark's own: started in a session of its own, stopped by its PID and group.

Never by name: a server that outlives an error or a Ctrl-C would keep its port and its CPU, and a
process of the same name may be someone else's. A wait is a bounded poll of a condition, and a
failed one says what the process logged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["REPO", "Service", "gunicorn"]

REPO = Path(__file__).resolve().parents[2]


class Service:
    """``argv`` run from the repository in a new session; each start logs to ``<logs>/<name>-<n>.log``."""

    def __init__(self, name: str, argv: list[str], logs: Path, *, port: int = 0) -> None:
        self.name = name
        self.argv = argv
        self.logs = logs
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self._starts = 0

    def start(self, env: dict[str, str] | None = None) -> None:
        self._starts += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log = self.logs / f"{self.name}-{self._starts}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None and not _ended(self.process.pid)

    def children(self) -> list[int]:
        """Its direct children's PIDs (gunicorn's workers); none once it is gone."""
        try:
            return [int(pid) for pid in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()]
        except (OSError, RuntimeError):
            return []

    def log_text(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str, *, every: float = 0.05) -> None:
        """Poll ``condition`` until ``timeout`` s; fail, with the log's end, if it never holds or the process ends."""
        deadline = time.monotonic() + timeout
        while not condition():
            if not self.running:
                raise RuntimeError(f"{self.name} ended before {what}:\n{self.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {what} after {timeout:g} s:\n{self.log_text()[-4000:]}")
            time.sleep(every)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the process; SIGKILL to its group once it has ended, or after ``grace`` s (its workers too).

        The process is reaped only after that: until then its PID, which is its group's id, stays ours.
        Interrupted (a Ctrl-C meanwhile), it is still this service's, for a second call to finish.
        """
        process = self.process
        if process is None or process.returncode is not None:
            self.process = None
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)  # a paused process would never see the SIGTERM
            os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not _ended(process.pid):
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        self.process = None


def _ended(pid: int) -> bool:
    """Whether our child ``pid`` has ended, leaving it unreaped."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def gunicorn(name: str, *, port: int, logs: Path, workers: int, threads: int, timeout: int = 30) -> Service:
    """The demo (``project.wsgi``) under gunicorn's gthread workers on ``127.0.0.1:port``."""
    argv = [
        str(Path(sys.executable).parent / "gunicorn"),
        "--worker-class=gthread",
        f"--workers={workers}",
        f"--threads={threads}",
        f"--bind=127.0.0.1:{port}",
        f"--timeout={timeout}",
        "--graceful-timeout=5",
        # Else every gunicorn 27 master would bind the same ~/.gunicorn/gunicorn.ctl.
        "--no-control-socket",
        "project.wsgi",
    ]
    return Service(name, argv, logs, port=port)
