"""Exceptions raised by ratelimits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from .policies.values import Check


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


class PolicyFailed(BackendUnavailable):
    """The store is up, but could not decide some checks: their policy or their state is at fault.

    A key of another type where a check keeps its state, or (around the bounds every policy is
    checked against) arguments the decide script cannot use. Nothing was consumed. The limiter
    degrades only ``checks`` by their fail modes and leaves the circuit breaker alone: one bad
    policy is not an outage. Any other caller may treat it as the store error it subclasses.
    """

    def __init__(self, message: str, checks: tuple[Check, ...]) -> None:
        super().__init__(message)
        #: The checks that failed; every check of the call when the store could not say which.
        self.checks = checks
