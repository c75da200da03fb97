"""The named choices settings, models and policies share: fail modes, priorities, what is charged, HTTP methods."""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from .exceptions import ConfigurationError

__all__ = ["HTTP_METHODS", "SHEDDABLE", "Counts", "FailMode", "Priority"]


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


class Counts(Choice):
    """Which of an endpoint's responses its requests are charged for; the others are given back
    once the response is closed (:mod:`ratelimits.engine.settling`)."""

    #: Every response (the default: nothing to settle).
    ALL = "all"
    #: Successes only (below 400): a request that failed costs the caller nothing.
    SUCCESSES = "successes"
    #: Client errors only (400 to 499): to limit scanners and bad scripts, not use.
    CLIENT_ERRORS = "client_errors"
    #: Every response but the server's errors (500 and up): the caller never pays for our fault.
    NO_SERVER_ERRORS = "no_server_errors"

    def counts(self, status: int) -> bool:
        """Whether a response of ``status`` is charged."""
        if self is Counts.SUCCESSES:
            return status < 400
        if self is Counts.CLIENT_ERRORS:
            return 400 <= status < 500
        if self is Counts.NO_SERVER_ERRORS:
            return status < 500
        return True

    @property
    def description(self) -> str:
        return _COUNTS_DESCRIPTIONS[self]


_COUNTS_DESCRIPTIONS = {
    Counts.ALL: "every response",
    Counts.SUCCESSES: "successes only (below 400)",
    Counts.CLIENT_ERRORS: "client errors only (4xx)",
    Counts.NO_SERVER_ERRORS: "every response but server errors (5xx)",
}


#: The classes the shedders may turn away, lowest first (their thresholds must rise in this order).
SHEDDABLE = (Priority.LOW, Priority.NORMAL, Priority.HIGH)

#: The methods an endpoint policy may name (besides ``ANY``), and so the methods the effective
#: limits can be asked about: the admin page, ``ratelimits_effective`` and a status endpoint.
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
