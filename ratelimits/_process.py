"""One value per process, built from the settings on first use and rebuilt after they change.

The backend, the policy source, the limiter and the worker shedder are each one of these. The
settings module empties them all when ``RATELIMITS`` (or a setting it reads) changes
(``ratelimits.conf``, on Django's ``setting_changed``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["ProcessWide"]

T = TypeVar("T")


class ProcessWide(Generic[T]):
    """One value per process built from the settings on first use, and built again after they change.

    The backend, the policy source, the limiter and the worker shedder are each one of these:
    shared by every thread of the process, cheap to read, and rebuilt on the next use after a
    ``setting_changed`` signal for ``RATELIMITS`` (``override_settings`` in tests).
    """

    _all: weakref.WeakSet[ProcessWide[Any]] = weakref.WeakSet()

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        #: ``(value,)`` once built: a value of ``None`` (no worker shedder) is still built.
        self._built: tuple[T] | None = None
        self._lock = threading.Lock()
        ProcessWide._all.add(self)

    def get(self) -> T:
        built = self._built  # one read: a reset between two reads cannot hand out nothing
        if built is None:
            with self._lock:
                built = self._built
                if built is None:
                    built = self._built = (self._build(),)
        return built[0]

    def current(self) -> T | None:
        """The value if it was built, without building it."""
        built = self._built
        return None if built is None else built[0]

    def reset(self) -> None:
        """Forget the value: the next :meth:`get` builds it again."""
        with self._lock:
            self._built = None

    @classmethod
    def reset_all(cls) -> None:
        for value in list(cls._all):
            value.reset()
