"""A limiter of a test's own, on the in-process ``memory`` backend, whose clock moves when the test says; the switch."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction
from django.test import override_settings

from .._process import ProcessWide
from ..backends import standing_in
from ..backends.memory import MemoryBackend
from ..conf import conf

__all__ = ["FakeClock", "IsolatedLimiter", "disabled", "limiter"]

F = TypeVar("F", bound=Callable[..., Any])
US = 1_000_000


class FakeClock:
    """Integer microseconds since the epoch that only move when a test says so (a backend's ``clock``)."""

    def __init__(self, start_us: int = 1_700_000_000_000_000) -> None:
        self.now = start_us

    def __call__(self) -> int:
        return self.now

    def advance(self, us: int) -> None:
        self.now += us


class IsolatedLimiter:
    """A fresh limiter for a test: the project's policies, decided on a ``memory`` backend of its own.

    Made by :func:`limiter`; see there. Inside the block every request is decided on
    :attr:`backend`, whatever ``RATELIMITS['BACKEND']`` says, by :attr:`clock`, which stands
    still until :meth:`advance` moves it.
    """

    def __init__(self) -> None:
        #: The clock decisions are made by: the wall clock's time on entry, then only what :meth:`advance` adds.
        self.clock = FakeClock()
        #: The store of the block (a new one each time the block is entered).
        self.backend = MemoryBackend(clock=self.clock)
        self._open: ExitStack | None = None

    def __enter__(self) -> IsolatedLimiter:
        if self._open is not None:
            raise RuntimeError("this limiter() block is open already: make another with ratelimits.testing.limiter()")
        with ExitStack() as stack:
            if not conf.enabled:
                # A project that turns the limiter off for its suite turns it on where a test asks for one.
                stack.enter_context(override_settings(RATELIMITS={**conf.user_settings, "ENABLED": True}))
            self.clock = FakeClock(time.time_ns() // 1000)
            self.backend = MemoryBackend(clock=self.clock, prefix=conf.redis.key_prefix)
            stack.enter_context(standing_in(self.backend))
            self._open = stack.pop_all()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        opened, self._open = self._open, None
        if opened is not None:
            opened.close()

    def __call__(self, test: F) -> F:
        """Run ``test`` (a function or a coroutine function) inside the block."""
        if iscoroutinefunction(test):

            @functools.wraps(test)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await test(*args, **kwargs)

            return cast(F, run_async)

        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self:
                return test(*args, **kwargs)

        return cast(F, run)

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on: buckets refill and windows roll over as if that time had passed."""
        if seconds < 0:
            raise ValueError(f"advance({seconds!r}): the limiter's clock never goes back")
        self.clock.advance(round(seconds * US))
        # What the worker remembers by its own clock (the failed-authentication limit's denials) is
        # forgotten with the rest of the process's state: the store answers, on this clock.
        ProcessWide.reset_all()

    def reset(self) -> None:
        """Forget what every request spent and holds, as on entry; the clock stays where it is."""
        self.backend.reset()


def limiter() -> IsolatedLimiter:
    """A fresh, isolated limiter for one test: a context manager, or a decorator of a test function.

    On entry the process's backend, limiter and policy source are built afresh around a new
    ``memory`` backend whose clock starts at the wall clock's time and then stands still; on exit
    they are built afresh again from the project's settings, so nothing spent inside is seen
    outside. The project's policies (``TIERS``, ``ENDPOINTS``, ``DIMENSIONS``, the database's)
    apply as they are. With ``RATELIMITS['ENABLED']`` off, it is on inside the block. No Redis is
    asked, whatever ``RATELIMITS['BACKEND']`` says::

        with ratelimits.testing.limiter() as limits:
            ...                   # exhaust a limit
            limits.advance(30)    # instead of sleeping 30 s
    """
    return IsolatedLimiter()


def disabled() -> override_settings:
    """``RATELIMITS['ENABLED']`` off, as Django's ``override_settings`` (a context manager, or a decorator).

    Every request is admitted without asking the store, and no response carries rate-limit
    headers. The other settings are the project's as they are when it is called.
    """
    return override_settings(RATELIMITS={**conf.user_settings, "ENABLED": False})
