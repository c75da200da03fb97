"""Customer-facing API: a caller reads its own usage and its current limits, never anyone else's."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils.dateparse import parse_datetime
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.generics import ListAPIView
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from .choices import HTTP_METHODS
from .decisions import Decision
from .drf import endpoint_name
from .endpoints import is_known_endpoint
from .identity import SubjectKind, identify
from .models import MAX_ENDPOINT_LENGTH, validate_endpoint
from .periods import Unit
from .status import current_limits, limit_status_call, quota_checks
from .throttles import RateLimitThrottle
from .usage.live import read_live
from .usage.readers import MAX_QUOTA_PERIODS, caller_filters, endpoint_series, quota_periods
from .usage.records import MAX_RANGE

__all__ = ["QuotaUsageView", "RateLimitStatusThrottle", "RateLimitStatusView", "UsageView"]


class UsageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """One period's usage of one endpoint, under one tier."""

    period_start = serializers.DateTimeField()
    granularity = serializers.ChoiceField(choices=list(MAX_RANGE))
    endpoint = serializers.CharField()
    tier = serializers.CharField()
    allowed = serializers.IntegerField(min_value=0)
    throttled = serializers.IntegerField(min_value=0, help_text="Requests answered 429.")
    shed = serializers.IntegerField(min_value=0, help_text="Requests answered 503 (the platform was overloaded).")
    degraded = serializers.IntegerField(min_value=0, help_text="Requests decided without the limiter's store.")
    tokens = serializers.IntegerField(min_value=0, help_text="Tokens the allowed requests spent (their cost).")
    live = serializers.BooleanField(
        help_text="Some of these counts are the limiter's live counters, not stored yet: they may still grow."
    )


class UsagePagination(LimitOffsetPagination):
    default_limit = 100
    max_limit = 1000


class UsageView(ListAPIView):  # type: ignore[type-arg]
    """``GET /v1/usage?from=&to=&granularity=minute|hour|day``: the caller's own usage, oldest first.

    ``from`` and ``to`` are ISO 8601 datetimes with an offset (default: the last 24 hours);
    the caller is whoever authenticated the request (API key, else user, else client IP), so
    no parameter can name another subject. Paginated with ``limit`` and ``offset``.

    One row per period, endpoint and tier that counted anything, read as the admin's usage report
    reads it (:func:`ratelimits.usage.readers.endpoint_series`): the periods rolled up, those
    still summed from finer rows, and the minutes not drained yet (``live``), so a request made
    now is in every granularity at once.
    """

    serializer_class = UsageSerializer
    pagination_class = UsagePagination
    throttle_scope = "usage"

    def get_queryset(self) -> Any:
        request: Request = self.request
        caller = _caller(request, self)
        granularity = request.query_params.get("granularity", "hour")
        if granularity not in MAX_RANGE:
            raise ValidationError({"granularity": f"{granularity!r} must be one of minute, hour, day."})
        now = datetime.now(tz=UTC)
        start = _moment(request.query_params.get("from"), "from", now - timedelta(days=1))
        end = _moment(request.query_params.get("to"), "to", now)
        if end <= start:
            raise ValidationError({"to": "must be after from."})
        if end - start > MAX_RANGE[granularity]:
            raise ValidationError(
                {"from": f"ranges of {granularity} rows may cover at most {MAX_RANGE[granularity].days} days."}
            )
        filters = caller_filters(caller, start, end, granularity)
        live = read_live(start, end, caller=caller)
        rows = []
        for row in endpoint_series(filters, live.rows):
            fields = asdict(row)
            rows.append({"period_start": fields.pop("start"), "granularity": granularity, **fields})
        return rows


def _caller(request: Request, view: Any) -> Any:
    return identify(request, endpoint="usage", auth=request.auth, user=request.user).caller


def _moment(raw: str | None, field: str, default: datetime) -> datetime:
    if raw is None:
        return default
    try:
        moment = parse_datetime(raw)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ValidationError(
            {field: f"{raw!r} is not an ISO 8601 datetime with an offset, e.g. 2026-11-30T00:00:00Z."}
        )
    return moment


class QuotaPeriodSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """One billing period of a quota: what it allowed, and what the caller spent of it."""

    start = serializers.DateTimeField(help_text="When the period began, in the quota's time zone.")
    end = serializers.DateTimeField(help_text="When it renews (or renewed).")
    quota = serializers.IntegerField(min_value=1)
    used = serializers.IntegerField(min_value=0, help_text="Tokens the admitted requests spent in the period.")
    remaining = serializers.IntegerField(min_value=0)
    overage = serializers.IntegerField(
        min_value=0, help_text="Spent past the quota: what a soft quota admitted and bills for."
    )
    live = serializers.BooleanField(help_text="Some of it is the limiter's live counters: it may still grow.")


class QuotaUsageSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """A quota of the caller's, by billing period."""

    policy = serializers.CharField()
    subject = serializers.ChoiceField(choices=[kind.value for kind in SubjectKind])
    period_unit = serializers.ChoiceField(choices=[unit.value for unit in Unit])
    period_zone = serializers.CharField(help_text="The IANA time zone the periods are counted in.")
    soft = serializers.BooleanField(help_text="Admitted past the quota, the overage counted, not refused.")
    periods = QuotaPeriodSerializer(many=True, help_text="Oldest first; the current period last.")


class QuotaUsageListSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """``GET /v1/usage/quota``: each quota of the caller by calendar day, week or month."""

    quotas = QuotaUsageSerializer(many=True)


#: ``CSV``'s columns: a quota's, then a period's.
QUOTA_CSV_COLUMNS = (
    *("policy", "subject", "period_unit", "period_zone", "soft"),
    *("start", "end", "quota", "used", "remaining", "overage", "live"),
)


class QuotaCSVRenderer(BaseRenderer):
    """``?format=csv``: one row per quota and period (an error body, as its fields' name and value)."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out)
        if isinstance(data, dict) and "quotas" in data:
            writer.writerow(QUOTA_CSV_COLUMNS)
            for quota in data["quotas"]:
                for period in quota["periods"]:
                    row = {**quota, **period}
                    writer.writerow([row[column] for column in QUOTA_CSV_COLUMNS])
        elif isinstance(data, dict):
            writer.writerow(("field", "error"))
            writer.writerows((field, value) for field, value in data.items())
        return out.getvalue().encode()


class QuotaUsageView(APIView):
    """``GET /v1/usage/quota?periods=3``: the caller's usage against each quota by billing period.

    Each of the caller's quotas by calendar day, week or month (docs/plans.md): its last ``periods``
    billing periods (1 to 12, default 3), the current one last, counted from the caller's own
    anchor in the quota's zone, with what each allowed, what was spent (tokens), what is left and
    the overage past it. ``?format=csv`` gives the same as CSV. The caller is whoever authenticated
    the request: no parameter can name another subject. Read as every reader of usage reads
    (:func:`ratelimits.usage.readers.quota_periods`), the minutes not drained yet included.
    """

    throttle_scope = "usage"
    # The project's renderers (as DRF's APIView reads them: once), and CSV for ``?format=csv``.
    renderer_classes = [*cast("list[type[BaseRenderer]]", api_settings.DEFAULT_RENDERER_CLASSES), QuotaCSVRenderer]

    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        raw = request.query_params.get("periods", "3")
        if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= MAX_QUOTA_PERIODS):
            raise ValidationError({"periods": f"{raw!r} must be a whole number from 1 to {MAX_QUOTA_PERIODS}."})
        count = int(raw)
        identity = identify(request, endpoint="usage", auth=request.auth, user=request.user)
        quotas = []
        for check in quota_checks(request, identity):
            policy = check.policy
            period = policy.billing_period
            assert period is not None  # quota_checks gives those that have one
            periods = quota_periods(check.subject, period, policy.rate.limit, count=count)
            quotas.append(
                {
                    "policy": policy.name,
                    "subject": check.subject.kind,
                    "period_unit": period.unit.value,
                    "period_zone": period.zone,
                    "soft": policy.soft,
                    "periods": [
                        {
                            "start": row.start.isoformat(),
                            "end": row.end.isoformat(),
                            "quota": row.quota,
                            "used": row.used,
                            "remaining": row.remaining,
                            "overage": row.overage,
                            "live": row.live,
                        }
                        for row in periods
                    ],
                }
            )
        return Response({"quotas": quotas})


class RateLimitStatusThrottle(RateLimitThrottle):
    """The status endpoint's throttle: its own limits only, never the caller's (which it reports).

    It lives here, not in :mod:`ratelimits.throttles`: DRF imports that module while settings
    load, before the models the status needs can be imported.

    The view's ``status_rate`` and ``status_burst`` are its per-caller limit when its endpoint
    policy gives none (see :func:`~ratelimits.status.limit_status_call`).
    """

    def decide(self, request: Request, view: Any) -> Decision:
        return limit_status_call(
            request, endpoint=endpoint_name(request, view), rate=view.status_rate, burst=view.status_burst
        )


class RateLimitStatusView(APIView):
    """``GET /rate_limit?endpoint=charges&method=POST``: the caller's current limits there, spending none.

    Route to it, or subclass it (``default_endpoint``, ``throttle_scope``, the built-in limit).
    ``endpoint`` must name an endpoint of this project: a route's ``throttle_scope`` or name, or
    one an endpoint policy names; anything else is a 400 naming the parameter.

    It is limited as the endpoint ``throttle_scope`` by its own policy (an endpoint policy's
    per-caller and all-callers limits; ``status_rate`` and ``status_burst`` per caller when none
    gives one), never by the caller's limits it reports, and its responses carry the headers.
    """

    throttle_scope = "rate_limit"
    throttle_classes = [RateLimitStatusThrottle]
    #: The per-caller limit of status calls when no endpoint policy of ``throttle_scope`` sets one.
    status_rate = "1/s"
    status_burst = 20
    #: The endpoint asked about when the request names none (``None``: ``endpoint`` is required).
    default_endpoint: str | None = None

    def get(self, request: Request) -> Response:
        endpoint = request.query_params.get("endpoint", self.default_endpoint)
        method = request.query_params.get("method", "GET").upper()
        if endpoint is None:
            raise ValidationError({"endpoint": ["This parameter is required: an endpoint name such as a route's."]})
        if len(endpoint) > MAX_ENDPOINT_LENGTH:
            raise ValidationError(
                {"endpoint": [f"An endpoint name has at most {MAX_ENDPOINT_LENGTH} characters, not {len(endpoint)}."]}
            )
        try:
            validate_endpoint(endpoint)
        except DjangoValidationError as exc:
            raise ValidationError({"endpoint": exc.messages}) from None
        if not is_known_endpoint(endpoint):
            raise ValidationError(
                {"endpoint": [f"{endpoint!r} is not an endpoint of this API: name a route or its throttle_scope."]}
            )
        if method not in HTTP_METHODS:
            raise ValidationError({"method": [f"{method[:20]!r} must be one of {', '.join(HTTP_METHODS)}."]})
        return Response(current_limits(request, endpoint=endpoint, method=method))
