"""Exceptions raised by ratelimits."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class ConfigurationError(ImproperlyConfigured, ValueError):
    """A rate, policy or setting is invalid. The message names the field and the input."""


class BackendUnavailable(Exception):
    """The limiter's store could not answer in time (down, stalled, or the breaker is open)."""

    #: A slot the unanswered call may still have taken (a stalled store runs the script late):
    #: ``(slot id, keys)``, to be released when the request finishes.
    stray_slot: tuple[str, tuple[str, ...]] | None = None
