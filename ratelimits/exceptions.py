"""Exceptions raised by ratelimits."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class ConfigurationError(ImproperlyConfigured, ValueError):
    """A rate, policy or setting is invalid. The message names the field and the input."""


class BackendUnavailable(Exception):
    """The limiter's store could not answer in time (down, stalled, or the breaker is open)."""
