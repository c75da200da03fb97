"""The admin's usage report page: the form that picks the range and filters, the page, its CSV files.

Asked for with no range, the report fits the data (:meth:`UsageReportForm.defaults`). The
minutes not drained yet are read from the store once per page or file (:mod:`ratelimits.usage.live`) and counted
in everything it shows, marked live in the time series.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django import forms
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.dateparse import parse_datetime

from ..conf import conf
from ..exceptions import BackendUnavailable
from ..models import UsageBatch, validate_endpoint
from ..usage.live import MAX_FIELDS, Live, read_live, stale_since
from ..usage.readers import STEPS, TOTALS, Period, ReportFilters, floor_period, period_bounds, time_series
from .chart import MAX_BARS, chart_periods, render_chart
from .queries import (
    CALLER_KINDS,
    DEFAULT_RANGE,
    MAX_RANGE,
    TABLE_LIMIT,
    TABLES,
    YOUNG,
    Table,
    caveats,
    series_table,
    young,
)
from .text import display_text, format_moment

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

__all__ = ["RANGE_FIELDS", "UsageReportForm", "csv_response", "usage_report_view"]

#: The parameters that pick the range: with none of them given, the report fits the data.
RANGE_FIELDS = ("from", "to", "granularity")
#: The moments a range may start or end at.
EARLIEST, LATEST = datetime(1970, 1, 1, tzinfo=UTC), datetime(9999, 1, 1, tzinfo=UTC)


def csv_response(table: Table, filters: ReportFilters) -> HttpResponse:
    """``table`` as a CSV attachment, header row first."""
    name = f"usage-{table.name}-{filters.granularity}-{filters.start:%Y%m%dT%H%M}-{filters.end:%Y%m%dT%H%M}.csv"
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    writer.writerow(table.header())
    writer.writerows(table.csv_rows())
    return response


def _moment_field(label: str, help_text: str) -> forms.CharField:
    return forms.CharField(
        required=False,
        label=label,
        max_length=40,
        help_text=help_text,
        widget=forms.TextInput(attrs={"placeholder": "2026-05-01 00:00", "size": 20}),
    )


class UsageReportForm(forms.Form):
    """The range (``from``, ``to``: UTC unless an offset is given), granularity and filters."""

    granularity = forms.ChoiceField(
        choices=[(g, g) for g in STEPS],
        required=False,
        help_text="Ranges may cover at most " + ", ".join(f"{d.days} days of {g}s" for g, d in MAX_RANGE.items()) + ".",
    )
    subject = forms.CharField(
        required=False,
        max_length=220,
        help_text="kind:id, e.g. api_key:ApiKey:3, user:42 or ip:203.0.113.7",
        widget=forms.TextInput(attrs={"size": 24}),
    )
    tier = forms.CharField(required=False, max_length=50)
    endpoint = forms.CharField(required=False, max_length=150, help_text="throttle_scope or route name")
    org = forms.CharField(required=False, max_length=200, label="Organisation")
    by = forms.ChoiceField(
        choices=[("requests", "requests"), ("tokens", "tokens")], required=False, label="Rank consumers by"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "from" is a Python keyword: these two are added here, first.
        self.fields = {
            "from": _moment_field(
                "From", "UTC unless an offset is given; default: 24 hours before To (with no range: fits the data)."
            ),
            "to": _moment_field("To", "Excluded; default: now."),
            **self.fields,
        }

    @classmethod
    def defaults(cls, now: datetime | None = None) -> dict[str, str]:
        """The range and granularity of a report asked for with none: one that fits the data.

        A young install (no usage row older than :data:`~.queries.YOUNG`, an hour) gets its last
        hour by minute: by hour, all of its traffic would be one bar. Any other, its last 24
        hours by hour.
        """
        now = now or datetime.now(tz=UTC)
        end = floor_period(now, "minute") + timedelta(minutes=1)
        granularity, span = ("minute", YOUNG) if young(now) else ("hour", DEFAULT_RANGE)
        return {"from": format_moment(end - span), "to": format_moment(end), "granularity": granularity}

    def _moment(self, name: str) -> datetime | None:
        raw = str(self.cleaned_data.get(name) or "").strip()
        if not raw:
            return None
        try:
            moment = parse_datetime(raw)
        except ValueError:
            moment = None
        if moment is None:
            raise forms.ValidationError(f"{raw!r} is not a date and time, e.g. 2026-05-01 00:00 or 2026-05-01T00:00Z.")
        moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
        if not EARLIEST <= moment <= LATEST:
            # Periods are counted in minutes since the epoch; and a range's last period must end in the calendar.
            raise forms.ValidationError(
                f"{raw!r} is out of range: give a moment from {format_moment(EARLIEST)} to {format_moment(LATEST)} UTC."
            )
        return moment

    def clean_from(self) -> datetime | None:
        return self._moment("from")

    def clean_to(self) -> datetime | None:
        return self._moment("to")

    def clean_subject(self) -> tuple[str, str]:
        raw = str(self.cleaned_data.get("subject") or "").strip()
        if not raw:
            return "", ""
        kind, _, value = raw.partition(":")
        if kind not in CALLER_KINDS or not value.strip():
            raise forms.ValidationError(
                f"{raw!r}: give kind:id, the kind one of {', '.join(CALLER_KINDS)} (e.g. api_key:ApiKey:3)."
            )
        return kind, value.strip()

    def clean_endpoint(self) -> str:
        raw = str(self.cleaned_data.get("endpoint") or "").strip()
        if raw:
            validate_endpoint(raw)
        return raw

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        granularity = cleaned.get("granularity") or "hour"
        cleaned["granularity"] = granularity
        cleaned["by"] = cleaned.get("by") or "requests"
        if "from" not in cleaned or "to" not in cleaned:
            return cleaned  # a field error already
        end = cleaned["to"] or floor_period(datetime.now(tz=UTC), "minute") + timedelta(minutes=1)
        start = cleaned["from"] or end - DEFAULT_RANGE
        cleaned["from"], cleaned["to"] = start, end
        if end <= start:
            self.add_error("to", "To must be after From.")
        elif end - start > MAX_RANGE[granularity]:
            self.add_error(
                "from", f"A range of {granularity} rows may cover at most {MAX_RANGE[granularity].days} days."
            )
        return cleaned

    def filters(self) -> ReportFilters:
        data = self.cleaned_data
        kind, value = data["subject"]
        return ReportFilters(
            start=data["from"],
            end=data["to"],
            granularity=data["granularity"],
            subject_kind=kind,
            subject_id=value,
            tier=data["tier"].strip(),
            endpoint=data["endpoint"],
            organization=data["org"].strip(),
        )

    def query(self) -> dict[str, str]:
        """The cleaned form as query parameters: the same report, whenever it is asked for again."""
        data = self.cleaned_data
        query = {
            "from": format_moment(data["from"]),
            "to": format_moment(data["to"]),
            "granularity": data["granularity"],
            "subject": ":".join(data["subject"]) if data["subject"][0] else "",
            "tier": data["tier"].strip(),
            "endpoint": data["endpoint"],
            "org": data["org"].strip(),
            "by": data["by"],
        }
        return {name: value for name, value in query.items() if value}


def usage_report_view(model_admin: ModelAdmin[Any]) -> Callable[[HttpRequest], HttpResponse]:
    """The report page of ``model_admin``'s admin site (staff with ``ratelimits.view_tier``)."""

    def view(request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm("ratelimits.view_tier"):
            raise PermissionDenied
        data = request.GET.copy()
        if not any(request.GET.get(name, "").strip() for name in RANGE_FIELDS):
            for name, value in UsageReportForm.defaults().items():
                data[name] = value  # shown in the form: the page says what it covers
        form = UsageReportForm(data)
        valid = form.is_valid()
        if request.GET.get("format") == "csv":
            return _csv_view(request, form, valid)
        context: dict[str, Any] = {
            **model_admin.admin_site.each_context(request),
            "title": "Usage report",
            "form": form,
            "opts": model_admin.model._meta,
            "limit": TABLE_LIMIT,
        }
        if valid:
            filters, query = form.filters(), form.query()
            here = reverse("admin:ratelimits_usage_report")
            live = read_live(*period_bounds(filters))
            series = time_series(filters, live.rows)
            tables = [build(filters, form.cleaned_data["by"], live.rows) for build in TABLES.values()]
            for table in tables:
                if table.name == "throttled_endpoints":  # an endpoint narrows the report to it
                    for row in table.rows:
                        row["links"] = {"endpoint": f"{here}?{urlencode({**query, 'endpoint': row['endpoint']})}"}
            sections = [
                {
                    "table": t,
                    "cells": t.cells(),
                    "csv_url": f"{here}?{urlencode({**query, 'format': 'csv', 'table': t.name})}",
                }
                for t in [series_table(series), *tables]
            ]
            if len(series) > MAX_BARS:  # a long series is in its CSV, not in thousands of table rows
                sections[0]["cells"] = []
            shown = chart_periods(series)
            context.update(
                {
                    "filters": filters,
                    "chart": render_chart(shown, filters.granularity, left_out=len(series) - len(shown)),
                    "chart_starts": format_moment(shown[0].start) if len(shown) < len(series) else "",
                    "totals": {
                        "requests": display_text(sum(p.requests for p in series)),
                        **{m: display_text(sum(getattr(p, m) for p in series)) for m in TOTALS},
                    },
                    "sections": sections,
                    # Only those there are, written as the page writes numbers.
                    "caveats": {name: display_text(n) for name, n in asdict(caveats(filters, live.rows)).items() if n},
                    "max_subjects": display_text(conf.usage.max_subjects),
                    "live": _live_notes(live, series),
                    "drain": _drain_notes(),
                }
            )
        return TemplateResponse(request, "admin/ratelimits/usage_report.html", context)

    return view


def _live_notes(live: Live, series: list[Period]) -> dict[str, str]:
    """What the page says of the live part: which periods are live, and what could not be read."""
    notes = {}
    live_periods = [period for period in series if period.live]
    if live_periods:
        notes["periods"] = display_text(len(live_periods))
        notes["since"] = format_moment(live_periods[0].start)
    if live.error:
        notes["error"] = live.error
    if live.truncated:
        notes["truncated"] = display_text(MAX_FIELDS)
    return notes


def _drain_notes() -> dict[str, str]:
    """What the page says of the drain: when it last applied a batch, and since when nothing drains (if so)."""
    # The newest batch by its key, not by an unindexed column of a table that grows a row a minute.
    last = UsageBatch.objects.order_by("-pk").values_list("applied_at", flat=True).first()
    try:
        stale = stale_since()
    except (BackendUnavailable, NotImplementedError):
        stale = None  # the live part's own note says the store could not be read
    return {"last": format_moment(last) if last else "", "stale": format_moment(stale) if stale else ""}


def _csv_view(request: HttpRequest, form: UsageReportForm, valid: bool) -> HttpResponse:
    name = request.GET.get("table", "series")
    if not valid:
        errors = "; ".join(f"{field}: {' '.join(map(str, messages))}" for field, messages in form.errors.items())
        return HttpResponse(f"Invalid report: {errors}\n", status=400, content_type="text/plain; charset=utf-8")
    filters = form.filters()
    build = TABLES.get(name)
    if name != "series" and build is None:
        choices = ", ".join(["series", *TABLES])
        return HttpResponse(f"Unknown table {name!r}: one of {choices}.\n", status=400, content_type="text/plain")
    live = read_live(*period_bounds(filters)).rows
    if build is None:
        return csv_response(series_table(time_series(filters, live)), filters)
    return csv_response(build(filters, form.cleaned_data["by"], live), filters)
