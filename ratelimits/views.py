"""Customer-facing usage API: a caller reads its own usage, never anyone else's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.utils.dateparse import parse_datetime
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.generics import ListAPIView
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

from .counters import METRICS
from .identity import identify
from .models import UsageRecord
from .usage.records import MAX_RANGE

__all__ = ["UsageView"]


class UsageSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = UsageRecord
        fields = ["period_start", "granularity", "endpoint", "tier", *METRICS.values()]


class UsagePagination(LimitOffsetPagination):
    default_limit = 100
    max_limit = 1000


class UsageView(ListAPIView):  # type: ignore[type-arg]
    """``GET /v1/usage?from=&to=&granularity=minute|hour|day``: the caller's own usage, oldest first.

    ``from`` and ``to`` are ISO 8601 datetimes with an offset (default: the last 24 hours);
    the caller is whoever authenticated the request (API key, else user, else client IP), so
    no parameter can name another subject. Paginated with ``limit`` and ``offset``.
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
        return UsageRecord.objects.filter(
            subject_kind=caller.kind,
            subject_id=caller.value,
            granularity=granularity,
            period_start__gte=start,
            period_start__lt=end,
        ).order_by("period_start", "endpoint")


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
