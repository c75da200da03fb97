"""Helpers for the in-flight limit tests: concurrent request bursts and slot counting.

A :class:`Burst` sends requests from their own threads (one request per thread, each with its
own test client) and records every answer; the test waits, bounded, until enough have
answered. The Django test client closes each response before returning it, which sends
``request_finished`` on the requesting thread: by the time a thread records its answer, the
request's slots have been released.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from ratelimits.backends.base import Backend
from ratelimits.backends.redis import RedisBackend
from ratelimits.policies import Check


@dataclass
class Answer:
    """One thread's request: its label (e.g. the caller) and the response."""

    label: str
    response: Any

    @property
    def status(self) -> int:
        return int(self.response.status_code)

    def json(self) -> Any:
        return json.loads(self.response.content)


class Burst:
    """Requests on their own threads, started together; every answer (or error) is recorded."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.errors: list[str] = []
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    def start(self, label: str, request: Callable[[], Any]) -> None:
        thread = threading.Thread(target=self._run, args=(label, request), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self, label: str, request: Callable[[], Any]) -> None:
        try:
            response = request()
        except BaseException:
            with self._cond:
                self.errors.append(traceback.format_exc())
                self._cond.notify_all()
        else:
            with self._cond:
                self.answers.append(Answer(label, response))
                self._cond.notify_all()
        finally:
            close_thread_connections()

    def wait_answered(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until ``count`` requests have answered (or one failed); bounded."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self.errors) or len(self.answers) >= count, timeout)

    def join(self, timeout: float = 15.0) -> None:
        for thread in self._threads:
            thread.join(timeout)
        alive = sum(t.is_alive() for t in self._threads)
        assert not alive, f"{alive} request threads did not finish in {timeout} s"
        assert not self.errors, "\n".join(self.errors)

    def statuses(self) -> list[int]:
        with self._cond:
            return sorted(a.status for a in self.answers)

    def by_label(self) -> dict[str, Answer]:
        with self._cond:
            return {a.label: a for a in self.answers}


def close_thread_connections() -> None:
    """Close this thread's own database connections, at the end of a thread a test started.

    ``connections.close_all()`` leaves an in-memory SQLite database's connections open (Django's
    SQLite backend ignores ``close()`` there, as closing the last one would drop the database): a
    thread's connection then lives until the garbage collector finds it, and one still open can
    hold a shared-cache table lock that makes the test's teardown flush fail. A thread's own
    connection is never the last (the test's thread holds one), so it is closed for real.
    """
    for connection in connections.all(initialized_only=True):
        if connection.vendor == "sqlite" and connection.is_in_memory_db():
            BaseDatabaseWrapper.close(connection)
        else:
            connection.close()


def in_flight(backend: Backend, check: Check) -> int:
    """Slots held under ``check``'s key right now, read with a peek (which consumes nothing).

    A peek reports what one more request would leave: ``limit - held - 1`` when it fits. When
    it does not, every slot is taken (more than the limit can never be admitted).
    """
    result = backend.decide([check], consume=False).results[0]
    limit = check.policy.rate.limit
    held = limit - result.remaining - 1 if result.allowed else limit
    if isinstance(backend, RedisBackend):
        # The peek purged expired slots: the sorted set now holds exactly the live ones.
        assert backend.client.zcard(check.key(backend.prefix)) == held
    return held


def slot_counts(backend: Backend, checks: Sequence[Check]) -> list[int]:
    return [in_flight(backend, check) for check in checks]
