"""Billing periods: a quota's calendar day, week or month in a time zone, renewing on a customer's anchor.

A plan sold by the month renews on the day the subscription started (the 17th, at the hour it
started), in the customer's time zone, not at UTC midnight on the 1st. :class:`BillingPeriod`
says which; :meth:`BillingPeriod.bounds` gives the store the instants around now that a decision
needs, so the store's own clock picks the period exactly (``lua/decide.lua`` and
:func:`ratelimits.algorithms.calendar_window` take them).

An anchor on a day the month lacks (the 31st) renews on the month's last day; a wall time a
daylight-saving change skips or repeats is read as the zone reads it before the change (``fold``
0). A period is therefore 23 to 25 hours for a day in most zones (a zone whose clocks change by two
hours, 22 to 26), and 28 to 31 days, give or take such a change, for a month.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .exceptions import ConfigurationError
from .rates import parse_limit

__all__ = [
    "DAY_US",
    "LONGEST_US",
    "BillingPeriod",
    "QuotaMode",
    "Unit",
    "counted_period",
    "from_us",
    "parse_calendar_quota",
]

DAY_US = 86_400_000_000
_HOUR_US = 3_600_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


class Unit(StrEnum):
    """The calendar unit a quota renews by."""

    DAY = "day"
    WEEK = "week"
    MONTH = "month"


class QuotaMode(StrEnum):
    """What a quota does once spent."""

    #: Refuse (429) until the period renews.
    HARD = "hard"
    #: Admit past the quota and count the overage (billed, not refused).
    SOFT = "soft"

    @classmethod
    def parse(cls, value: object, *, field: str) -> QuotaMode:
        if isinstance(value, str) and value in cls._value2member_map_:
            return cls(value)
        raise ConfigurationError(f"{field}: {value!r} must be 'hard' or 'soft'")


#: Each unit's longest period, with room for a daylight-saving change (an hour in most zones, two in
#: a few, such as Antarctica/Troll): how long a period's count is kept.
_CHANGE_US = 3 * _HOUR_US
LONGEST_US = {Unit.DAY: DAY_US + _CHANGE_US, Unit.WEEK: 7 * DAY_US + _CHANGE_US, Unit.MONTH: 31 * DAY_US + _CHANGE_US}
#: The spellings a calendar quota's unit accepts ("10000/month").
_UNITS = {"d": Unit.DAY, "day": Unit.DAY, "w": Unit.WEEK, "week": Unit.WEEK, "mo": Unit.MONTH, "month": Unit.MONTH}
_QUOTA = re.compile(r"(?P<limit>[0-9]+)/(?P<count>[0-9]*)(?P<unit>[a-z]+)", re.ASCII)


@dataclass(frozen=True, slots=True)
class BillingPeriod:
    """A calendar ``unit`` in ``zone``, renewing at ``anchor`` (``None``: the unit's own start).

    The anchor is a moment (the subscription's start): a day renews at its time of day, a week on
    its weekday at that time, a month on its day of the month (the last day, in a shorter month).
    Without one, a day starts at midnight, a week on Monday, a month on the 1st, in ``zone``.
    """

    unit: Unit
    zone: str = "UTC"
    anchor: datetime | None = None
    _tz: ZoneInfo = field(init=False, repr=False, compare=False)
    #: ``(from, until, bounds)``: the bounds last given, good for a ``now`` in [from, until).
    _cached: tuple[int, int, tuple[int, int, int]] = field(
        default=(0, 0, (0, 0, 0)), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if type(self.unit) is not Unit:
            if not (isinstance(self.unit, str) and self.unit in Unit._value2member_map_):
                raise ConfigurationError(f"a billing period's unit {self.unit!r} must be 'day', 'week' or 'month'")
            object.__setattr__(self, "unit", Unit(self.unit))
        object.__setattr__(self, "_tz", zone_info(self.zone, field="quota zone"))
        if self.anchor is not None and (not isinstance(self.anchor, datetime) or self.anchor.utcoffset() is None):
            raise ConfigurationError(f"a quota's anchor must be an aware datetime, got {self.anchor!r}")

    @property
    def is_utc_day(self) -> bool:
        """Whether this is the plain UTC day: the epoch-aligned fixed window already counts it."""
        return self.unit is Unit.DAY and self.zone == "UTC" and self.anchor is None

    def describe(self) -> str:
        text = f"calendar {self.unit.value}"
        if self.zone != "UTC":
            text += f" ({self.zone})"
        if self.anchor is not None:
            text += f", renewing {self._renews()}"
        return text

    def _renews(self) -> str:
        local = self._anchor_local()
        at = local.strftime("%H:%M")
        if self.unit is Unit.DAY:
            return f"at {at}"
        if self.unit is Unit.WEEK:
            return f"on {local.strftime('%A')} at {at}"
        return f"on day {local.day} at {at}"

    def with_anchor(self, anchor: datetime | None) -> BillingPeriod:
        """This period renewing at ``anchor``."""
        return BillingPeriod(self.unit, self.zone, anchor)

    # -- the instants -------------------------------------------------------------------------

    def start(self, moment: datetime) -> datetime:
        """The start of the period holding ``moment`` (aware), in this period's zone."""
        us = _instant_us(moment)
        return from_us(self._starts_around(us)[1], self._tz)

    def next_start(self, moment: datetime) -> datetime:
        """The end of the period holding ``moment``: the next one's start."""
        us = _instant_us(moment)
        return from_us(self._starts_around(us)[2], self._tz)

    def bounds(self, now_us: int) -> tuple[int, int, int]:
        """Three period starts (us since the epoch) around ``now_us``, the middle one nearest to it.

        A store whose clock reads ``t`` counts in ``[b0, b1)`` if ``t < b1``, else in ``[b1, b2)``:
        exact at the boundary on the store's own clock, however far the app's clock is from it, up
        to half the shortest period. Kept between calls: made again about once per period.
        """
        since, until, kept = self._cached
        if since <= now_us < until:
            return kept
        before, start, after = self._starts_around(now_us)
        nearer_start = now_us - start < after - now_us
        lo, mid, hi = bounds = (before, start, after) if nearer_start else (start, after, self._step(after, 1))
        object.__setattr__(self, "_cached", ((lo + mid) // 2, (mid + hi) // 2, bounds))
        return bounds

    def length_us(self, now_us: int) -> int:
        """How long the period holding ``now_us`` is (a month of 28 to 31 days, a day of 23 to 25 hours)."""
        lo, mid, hi = self.bounds(now_us)
        return mid - lo if now_us < mid else hi - mid

    def _starts_around(self, now_us: int) -> tuple[int, int, int]:
        """The start of the period before the one holding ``now_us``, its start, and the next one's."""
        local = from_us(now_us, self._tz).replace(tzinfo=None)
        start = self._wall_start(local)
        # A wall time a daylight-saving change repeats reads either side of it: the period holding
        # ``now_us`` is the one whose instants hold it.
        if self._us(start) > now_us:
            start = self._shift(start, -1)
        elif self._us(self._shift(start, 1)) <= now_us:
            start = self._shift(start, 1)
        return self._us(self._shift(start, -1)), self._us(start), self._us(self._shift(start, 1))

    def _step(self, start_us: int, periods: int) -> int:
        wall = from_us(start_us, self._tz).replace(tzinfo=None)
        return self._us(self._shift(self._wall_start(wall), periods))

    def _anchor_local(self) -> datetime:
        if self.anchor is None:
            return datetime(2024, 1, 1)  # a Monday, the 1st, at midnight: each unit's own start
        return self.anchor.astimezone(self._tz).replace(tzinfo=None)

    def _wall_start(self, local: datetime) -> datetime:
        """The wall time the period holding the wall time ``local`` starts at."""
        anchor = self._anchor_local()
        at = anchor.time()
        if self.unit is Unit.DAY:
            start = datetime.combine(local.date(), at)
        elif self.unit is Unit.WEEK:
            day = local.date() - timedelta(days=(local.weekday() - anchor.weekday()) % 7)
            start = datetime.combine(day, at)
        else:
            start = _month_day(local.year, local.month, anchor.day, at)
        return start if start <= local else self._shift(start, -1)

    def _shift(self, start: datetime, periods: int) -> datetime:
        """The wall time ``periods`` periods after (or before) the period start ``start``."""
        if self.unit is Unit.DAY:
            return start + timedelta(days=periods)
        if self.unit is Unit.WEEK:
            return start + timedelta(weeks=periods)
        months = start.year * 12 + start.month - 1 + periods
        return _month_day(months // 12, months % 12 + 1, self._anchor_local().day, start.time())

    def _us(self, wall: datetime) -> int:
        return _instant_us(wall.replace(tzinfo=self._tz))


def _month_day(year: int, month: int, day: int, at: time) -> datetime:
    """``day`` of the month at ``at``, or its last day if it is shorter."""
    return datetime.combine(date(year, month, min(day, calendar.monthrange(year, month)[1])), at)


def _instant_us(moment: datetime) -> int:
    return (moment - _EPOCH) // _US


def from_us(us: int, tz: tzinfo = UTC) -> datetime:
    """The instant ``us`` microseconds after the epoch, in ``tz``."""
    return (_EPOCH + timedelta(microseconds=us)).astimezone(tz)


def counted_period(bounds: tuple[int, int, int], now_us: int) -> tuple[int, int]:
    """The period a store whose clock reads ``now_us`` counts in, among :meth:`BillingPeriod.bounds`:
    its start and the time until the next (us). The one rule the store, the reference arithmetic and
    the notices each read a period by (``lua/decide.lua`` says it again, in Lua)."""
    lo, mid, hi = bounds
    return (lo, mid - now_us) if now_us < mid else (mid, hi - now_us)


def zone_info(name: object, *, field: str) -> ZoneInfo:
    """The IANA time zone ``name``; a :class:`ConfigurationError` naming ``field`` for anything else."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{field}: expected an IANA time zone name such as 'Europe/Paris', got {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigurationError(
            f"{field}: {name!r} is not a time zone this system knows (an IANA name such as 'Europe/Paris')"
        ) from exc


def parse_calendar_quota(value: object, *, zone: str = "UTC", field: str = "quota") -> tuple[int, BillingPeriod] | None:
    """``"10000/month"`` as its limit and billing period; ``None`` for a quota that is a plain rate.

    Calendar units: ``day`` (``d``), ``week`` (``w``) and ``month`` (``mo``), one of them, never
    a multiple (``"5/2month"`` is an error). Any other period (``"500/h"``, ``"10000/7d"``) is a
    fixed window aligned to the epoch, as before: ``None``, for :func:`~ratelimits.rates.parse_rate`.
    """
    if not isinstance(value, str):
        return None
    match = _QUOTA.fullmatch(value.strip().lower())
    if match is None or match["unit"] not in _UNITS:
        return None
    unit = _UNITS[match["unit"]]
    if match["count"] and int(match["count"]) != 1:
        if unit is Unit.DAY:
            return None  # "10000/7d": a fixed window of seven days
        raise ConfigurationError(
            f"{field}: {value!r}: a calendar quota renews every {unit.value}; "
            f"give one, as '{match['limit']}/{unit.value}'"
        )
    return parse_limit(match["limit"], field=field, value=value), BillingPeriod(unit, zone)
