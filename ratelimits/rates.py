"""Parse and represent rates such as "100/s", "5/10m" or "10000/d"."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .exceptions import ConfigurationError

__all__ = [
    "MAX_BURST",
    "MAX_LIMIT",
    "MAX_PERIOD_US",
    "MAX_REFILL_US",
    "UNITS_US",
    "Rate",
    "check_burst",
    "parse_duration",
    "parse_limit",
    "parse_rate",
]

#: Microseconds per unit. Long and short spellings are both accepted.
UNITS_US: dict[str, int] = {
    "ms": 1_000,
    "s": 1_000_000,
    "sec": 1_000_000,
    "second": 1_000_000,
    "m": 60_000_000,
    "min": 60_000_000,
    "minute": 60_000_000,
    "h": 3_600_000_000,
    "hour": 3_600_000_000,
    "d": 86_400_000_000,
    "day": 86_400_000_000,
}

# ASCII digits only: str.isdigit() and \d also accept other scripts' digits (Arabic-Indic
# "\u0661\u0660\u0660/s"), which would parse but never match what an operator meant to type.
_RATE = re.compile(r"(?P<limit>[0-9]+)/(?P<period>[0-9]*)(?P<unit>[a-z]+)", re.ASCII)
_DURATION = re.compile(r"(?P<count>[0-9]+)(?P<unit>[a-z]+)", re.ASCII)

# What the store can carry: every numeric bound the decide script relies on, in one place. Every
# policy is checked against them when it is made (settings, admin forms, import, the loaders), so
# no accepted policy can make the script fail (tests/test_bounds.py tries the whole ranges).

#: The largest limit (and slot count): counts stay exact in Lua's doubles, which hold integers to 2**53.
MAX_LIMIT = 1_000_000_000
#: The longest period: a window's index and a slot's expiry stay far inside the doubles' exact range.
MAX_PERIOD_US = 366 * 86_400_000_000
#: The largest burst: the same ceiling as a limit.
MAX_BURST = MAX_LIMIT
#: The longest a full bucket may take to refill (burst x period / limit). The token bucket keeps a
#: timestamp up to that far ahead of now, in microseconds, and its key lives that long (Redis PX,
#: in milliseconds): a century keeps the timestamp below 2**53 µs (the year 2255) and the TTL
#: far inside what PX accepts. ``1/366d`` with a burst of 2**31 - 1 would need 2 billion years.
MAX_REFILL_US = 100 * 365 * 86_400_000_000


@dataclass(frozen=True, slots=True)
class Rate:
    """``limit`` requests (or tokens) per ``period_us`` microseconds."""

    limit: int
    period_us: int

    def __post_init__(self) -> None:
        if not 0 < self.limit <= MAX_LIMIT:
            raise ConfigurationError(f"limit must be between 1 and {MAX_LIMIT}, got {self.limit}")
        if not 0 < self.period_us <= MAX_PERIOD_US:
            raise ConfigurationError(f"period must be between 1µs and 366 days, got {self.period_us}µs")

    @property
    def period_seconds(self) -> float:
        return self.period_us / 1_000_000

    @property
    def interval_us(self) -> float:
        """Time one token takes to refill (the GCRA emission interval)."""
        return self.period_us / self.limit

    def __str__(self) -> str:
        return f"{self.limit}/{_format_duration(self.period_us)}"

    def describe(self) -> str:
        """Human-readable form for admins and docs: ``"100 / second"``, ``"5 / 10 minutes"``."""
        count, unit = _largest_unit(self.period_us)
        names = {"us": "microsecond", "ms": "millisecond", "s": "second", "m": "minute", "h": "hour", "d": "day"}
        name = names[unit]
        period = name if count == 1 else f"{count} {name}s"
        return f"{self.limit} / {period}"


def check_burst(rate: Rate, burst: object, *, field: str = "burst") -> int:
    """``burst`` if a bucket of ``rate`` can hold it in the store; a :class:`ConfigurationError` naming ``field``.

    A positive integer of at most :data:`MAX_BURST`, which refills within :data:`MAX_REFILL_US`.
    """
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ConfigurationError(f"{field}: {burst!r} must be a positive integer")
    if burst > MAX_BURST:
        raise ConfigurationError(f"{field}: {burst} is too large; a burst must be at most {MAX_BURST:,}")
    if burst * rate.period_us > MAX_REFILL_US * rate.limit:
        years = burst * rate.period_us / rate.limit / (365 * 86_400_000_000)
        raise ConfigurationError(
            f"{field}: a burst of {burst} at {rate} takes {years:,.0f} years to refill; "
            f"at most {MAX_REFILL_US // (365 * 86_400_000_000)} years (burst x period / limit) can be stored"
        )
    return burst


def parse_rate(value: object, *, field: str = "rate") -> Rate:
    """Parse ``"N/period"`` (``"100/s"``, ``"5/10m"``, ``"1000/hour"``) into a :class:`Rate`.

    Raises :class:`ConfigurationError` naming ``field`` and the offending input for anything
    else: zero or negative limits, exponents, NaN, non-ASCII digits, unknown units, sizes
    beyond what the backends can count exactly.
    """
    if isinstance(value, Rate):
        return value
    if not isinstance(value, str):
        raise ConfigurationError(f"{field}: expected a string like '100/s', got {value!r}")
    text = value.strip().lower()
    match = _RATE.fullmatch(text)
    if match is None:
        raise ConfigurationError(
            f"{field}: {value!r} is not a rate; expected 'N/period' such as '100/s', '5/10m' or '1000/h'"
        )
    limit = parse_limit(match["limit"], field=field, value=value)
    period_us = _period_us(match["period"], match["unit"], field=field, value=value)
    return Rate(limit, period_us)


def parse_limit(digits: str, *, field: str, value: object) -> int:
    """A rate's or a quota's ``N``: at least 1, at most :data:`MAX_LIMIT`; the error names ``field`` and ``value``."""
    limit = int(digits)
    if limit == 0:
        raise ConfigurationError(f"{field}: {value!r} allows nothing; the limit must be at least 1")
    if limit > MAX_LIMIT:
        raise ConfigurationError(f"{field}: {value!r} is too large; the limit must be at most {MAX_LIMIT}")
    return limit


def parse_duration(value: object, *, field: str = "duration") -> int:
    """Parse ``"30s"``, ``"10m"`` or ``"250ms"`` into microseconds."""
    if not isinstance(value, str):
        raise ConfigurationError(f"{field}: expected a string like '30s', got {value!r}")
    match = _DURATION.fullmatch(value.strip().lower())
    if match is None:
        raise ConfigurationError(f"{field}: {value!r} is not a duration; expected e.g. '250ms', '30s', '10m'")
    return _period_us(match["count"], match["unit"], field=field, value=value)


def _period_us(count_text: str, unit: str, *, field: str, value: object) -> int:
    if unit not in UNITS_US:
        known = ", ".join(sorted(UNITS_US))
        raise ConfigurationError(f"{field}: {value!r} has an unknown unit {unit!r}; use one of {known}")
    count = int(count_text) if count_text else 1
    if count == 0:
        raise ConfigurationError(f"{field}: {value!r} has a zero-length period")
    period_us = count * UNITS_US[unit]
    if period_us > MAX_PERIOD_US:
        raise ConfigurationError(f"{field}: {value!r} has a period longer than 366 days")
    return period_us


def _largest_unit(period_us: int) -> tuple[int, str]:
    for unit in ("d", "h", "m", "s", "ms"):
        size = UNITS_US[unit]
        if period_us % size == 0:
            return period_us // size, unit
    return period_us, "us"


def _format_duration(period_us: int) -> str:
    count, unit = _largest_unit(period_us)
    return unit if count == 1 else f"{count}{unit}"
