"""How the usage report writes values: on the page, and in CSV files a spreadsheet opens safely."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = ["csv_text", "display_text", "format_moment"]


def format_moment(moment: datetime) -> str:
    """``2026-05-01 14:00`` (UTC; seconds only when there are any)."""
    moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S" if moment.second or moment.microsecond else "%Y-%m-%d %H:%M")


def csv_text(value: Any) -> str:
    """``value`` for a CSV cell: ISO times, four decimals, and never the start of a formula."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    # A spreadsheet would run a cell starting like a formula: organisations are the host's strings.
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def display_text(value: Any) -> str:
    """``value`` for the page: readable times, percentages and thousands separators."""
    if isinstance(value, datetime):
        return format_moment(value)
    if isinstance(value, float):
        return f"{value:.1%}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value) or "—"
