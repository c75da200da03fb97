"""The named choices settings, models and policies share: fail modes, priority classes, HTTP methods."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from .exceptions import ConfigurationError

__all__ = ["HTTP_METHODS", "SHEDDABLE", "FailMode", "Priority"]


class Choice(StrEnum):
    """A choice written as a string in settings and tables (it compares equal to that string)."""

    @classmethod
    def parse(cls, value: object, *, field: str) -> Self:
        """``value`` as one of the choices, or a :class:`ConfigurationError` naming ``field``."""
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        raise ConfigurationError(f"{field}: {value!r} must be one of {', '.join(cls)}")


class FailMode(Choice):
    """What a policy does when the limiter's store cannot answer in time."""

    #: Allow the request (counted and logged as degraded).
    OPEN = "open"
    #: Refuse it with a 503 and a Retry-After: for login or payment-abuse policies.
    CLOSED = "closed"
    #: Decide it in this process against the policy scaled to this worker's share.
    LOCAL = "local"

    @property
    def description(self) -> str:
        return _FAIL_MODE_DESCRIPTIONS[self]


_FAIL_MODE_DESCRIPTIONS = {
    FailMode.OPEN: "open: allow when the limiter is down",
    FailMode.CLOSED: "closed: 503 when the limiter is down",
    FailMode.LOCAL: "local: per-process limit when the limiter is down",
}


class Priority(Choice):
    """An endpoint's class for the load shedders, most important first. Critical is never shed."""

    CRITICAL = "critical"
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


#: The classes the shedders may turn away, lowest first (their thresholds must rise in this order).
SHEDDABLE = (Priority.LOW, Priority.NORMAL, Priority.HIGH)

#: The methods an endpoint policy may name (besides ``ANY``), and so the methods the effective
#: limits can be asked about: the admin page, ``ratelimits_effective`` and a status endpoint.
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
