"""Exceptions raised by ratelimits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.core.exceptions import ImproperlyConfigured


class ConfigurationError(ImproperlyConfigured, ValueError):
    """A rate, policy or setting is invalid. The message names the field and the input.

    ``setting`` is the ``RATELIMITS`` key at fault when one is (the system checks report the
    error under that setting's id); ``None`` for a value that is not a setting (an admin row).
    """

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


@contextlib.contextmanager
def about_setting(name: str) -> Iterator[None]:
    """Mark a :class:`ConfigurationError` raised inside as being about ``RATELIMITS[name]``."""
    try:
        yield
    except ConfigurationError as exc:
        if exc.setting is None:
            exc.setting = name
        raise


class BackendUnavailable(Exception):
    """The limiter's store could not answer in time (down, stalled, or the breaker is open)."""

    #: A slot the unanswered call may still have taken (a stalled store runs the script late):
    #: ``(slot id, keys)``, to be released when the request finishes.
    stray_slot: tuple[str, tuple[str, ...]] | None = None
