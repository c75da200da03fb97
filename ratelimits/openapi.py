"""The OpenAPI schema of rate-limited views (drf-spectacular): their 429 and 503, and the rate-limit headers.

Optional, as drf-spectacular is (the ``openapi`` extra): no other module of the package imports
this one. Set ``REST_FRAMEWORK["DEFAULT_SCHEMA_CLASS"]`` to :class:`RateLimitAutoSchema`, or put
it before a schema class of your own (see docs/openapi.md). Importing it also documents the
parameters and bodies of :class:`~ratelimits.views.RateLimitStatusView` and
:class:`~ratelimits.views.UsageView`, and their subclasses.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ComponentRegistry, ResolvedComponent
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers
from rest_framework.views import APIView

from .algorithms import Algorithm
from .choices import HTTP_METHODS
from .conf import conf
from .counters import METRICS
from .identity import SubjectKind
from .models import MAX_ENDPOINT_LENGTH
from .periods import Unit
from .policies.values import OriginKind, Scope
from .problems import CONTENT_TYPE, QUOTA_EXCEEDED, REDUCED_CAPACITY
from .throttles import RateLimitThrottle
from .usage.readers import MAX_QUOTA_PERIODS
from .usage.records import MAX_RANGE
from .views import QuotaUsageListSerializer

__all__ = ["FIELD_ERRORS", "RateLimitAutoSchema", "documented_headers", "is_rate_limited"]


class Header(NamedTuple):
    """A response header as ``components/headers`` describes it."""

    name: str
    description: str
    schema: dict[str, Any]
    required: bool = False

    def component(self) -> dict[str, Any]:
        """The OpenAPI header object."""
        return {"description": self.description, "required": self.required, "schema": self.schema}


_COUNT = {"type": "integer", "minimum": 0}

IETF_HEADERS = (
    Header(
        "RateLimit-Policy",
        "The policies the request is counted under (IETF RateLimit draft, an RFC 9651 List): every enforced "
        "policy, or only the closest (`RATELIMITS['HEADERS']['POLICIES']`). `\"tier:free\";q=20;w=2` is a quota `q` "
        'granted over `w` seconds, `qu="concurrent-requests"` a limit of requests in flight; with '
        "`RATELIMITS['HEADERS']['PARTITION_KEY']`, `pk` is a Byte Sequence of the keyed hash of the subject the "
        "policy counts.",
        {"type": "string", "example": '"tier:free";q=20;w=2, "tier:free:quota";q=100000;w=86400'},
    ),
    Header(
        "RateLimit",
        'What is left under the policy closest to its limit: `"tier:free";r=19;t=1` is `r` remaining, fully '
        "restored in `t` seconds (no `t` for a limit of requests in flight).",
        {"type": "string", "example": '"tier:free";r=19;t=1'},
    ),
)
GITHUB_HEADERS = (
    Header("X-RateLimit-Limit", "The limit of the policy closest to it.", {"type": "integer", "minimum": 1}),
    Header("X-RateLimit-Remaining", "What is left of that limit.", _COUNT),
    Header("X-RateLimit-Used", "What is spent of that limit.", _COUNT),
    Header("X-RateLimit-Reset", "When that limit is fully restored, in seconds since the epoch.", {"type": "integer"}),
    Header("X-RateLimit-Resource", "The name of that policy.", {"type": "string", "example": "tier:free"}),
)
#: Sent whatever the header style, when they apply.
EVERY_STYLE_HEADERS = (
    Header(
        "X-RateLimit-Degraded",
        "`1`: the limiter's store could not be reached and the policies' fail modes decided.",
        {"type": "string", "enum": ["1"]},
    ),
    Header(
        "X-RateLimit-Shadow",
        "The shadow policies (tried out, not enforced) that would have refused the request, quoted.",
        {"type": "string", "example": '"tier:free"'},
    ),
)
LOCAL_HEADER = Header(
    "X-RateLimit-Local",
    "How this worker decided without asking the store: `denial` (a denial it remembers) or `lease` (tokens it leased).",
    {"type": "string", "enum": ["denial", "lease"]},
)
RETRY_AFTER = Header(
    "Retry-After",
    "Seconds to wait before retrying: the exact wait (the body's `retry_after_ms`) rounded up, at least 1.",
    {"type": "integer", "minimum": 1},
    required=True,
)


def documented_headers() -> tuple[Header, ...]:
    """The rate-limit headers a decided response may carry, as ``HEADERS`` and ``LOCAL_PATH`` are set now."""
    style = conf.headers.style
    headers = [
        *(IETF_HEADERS if style in ("ietf", "both") else ()),
        *(GITHUB_HEADERS if style in ("github", "both") else ()),
        *EVERY_STYLE_HEADERS,
    ]
    if conf.local_path.header:
        headers.append(LOCAL_HEADER)
    return tuple(headers)


class _Component(NamedTuple):
    """A schema of ``components/schemas``, with its name."""

    name: str
    schema: dict[str, Any]


VIOLATION = _Component(
    "RateLimitViolation",
    {
        "type": "object",
        "description": "One violated policy: the subject it limits, its limit, what is left and its own wait.",
        "required": ["policy", "subject", "limit", "remaining", "window_seconds", "retry_after_ms"],
        "properties": {
            "policy": {"type": "string", "example": "tier:free"},
            "subject": {"type": "string", "enum": [kind.value for kind in SubjectKind]},
            "limit": {"type": "integer", "minimum": 1},
            "remaining": _COUNT,
            "window_seconds": {"type": "integer", "minimum": 1},
            "retry_after_ms": _COUNT,
        },
    },
)


def _problem(problem_type: str, status: int, description: str, extra: dict[str, Any]) -> dict[str, Any]:
    """An ``application/problem+json`` body (RFC 9457) of ``problem_type``, with the members both kinds share."""
    required = ["type", "title", "status", "detail", "retry_after_ms", *extra]
    return {
        "type": "object",
        "description": description,
        "required": required,
        "properties": {
            "type": {"type": "string", "enum": [problem_type]},
            "title": {"type": "string"},
            "status": {"type": "integer", "enum": [status]},
            "detail": {"type": "string"},
            "retry_after_ms": {
                **_COUNT,
                "description": "The exact wait: a request sent that many milliseconds later is admitted.",
            },
            "violated-policies": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The names of the violated policies (IETF RateLimit draft).",
            },
            **extra,
        },
    }


QUOTA_EXCEEDED_PROBLEM = _Component(
    "RateLimitQuotaExceeded",
    _problem(
        QUOTA_EXCEEDED,
        429,
        "The caller is over one or more of its limits. A denied request consumes nothing.",
        {"violations": {"type": "array", "items": {"$ref": f"#/components/schemas/{VIOLATION.name}"}}},
    ),
)
REDUCED_CAPACITY_PROBLEM = _Component(
    "RateLimitReducedCapacity",
    _problem(
        REDUCED_CAPACITY,
        503,
        "The platform cannot serve the request now: it sheds load, or cannot decide it and the policy fails closed.",
        {},
    ),
)
#: Status -> what the limiter answers with it.
DENIALS = {
    "429": (QUOTA_EXCEEDED_PROBLEM, "Too many requests: the caller is over a limit; retry after `Retry-After`."),
    "503": (
        REDUCED_CAPACITY_PROBLEM,
        "The service sheds load or cannot decide the request; retry after `Retry-After`.",
    ),
}

#: A 400 of DRF's: each key names a parameter or field, with what is wrong with it.
FIELD_ERRORS = OpenApiResponse(
    response={
        "type": "object",
        "additionalProperties": {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        },
    },
    description="A parameter or field is invalid: each key names one, with what is wrong with it.",
)


def is_rate_limited(view: APIView) -> bool:
    """Whether ``view`` is throttled by :class:`~ratelimits.throttles.RateLimitThrottle` (or a subclass)."""
    return any(isinstance(throttle, RateLimitThrottle) for throttle in view.get_throttles())


def _register(registry: ComponentRegistry, kind: str, name: str, schema: dict[str, Any]) -> dict[str, str]:
    """``$ref`` to the component, registered on first use (the throttle class stands for its owner).

    A copy: drf-spectacular's hooks rewrite the schemas they are given (the enum hook replaces enums
    by references), which must not change the next schema generated.
    """
    component = ResolvedComponent(  # type: ignore[no-untyped-call]
        name=name, type=kind, schema=copy.deepcopy(schema), object=RateLimitThrottle
    )
    registry.register_on_missing(component)
    ref: dict[str, str] = component.ref
    return ref


def document_rate_limits(responses: dict[str, Any], registry: ComponentRegistry) -> None:
    """Add the 429 and 503 (unless documented already) and the rate-limit headers to every response."""
    _register(registry, ResolvedComponent.SCHEMA, VIOLATION.name, VIOLATION.schema)
    for status, (problem, description) in DENIALS.items():
        schema = _register(registry, ResolvedComponent.SCHEMA, problem.name, problem.schema)
        responses.setdefault(status, {"description": description, "content": {CONTENT_TYPE: {"schema": schema}}})
    headers = {
        h.name: _register(registry, ResolvedComponent.HEADER, h.name, h.component()) for h in documented_headers()
    }
    retry_after = _register(registry, ResolvedComponent.HEADER, RETRY_AFTER.name, RETRY_AFTER.component())
    for status, response in responses.items():
        ours = {**headers, RETRY_AFTER.name: retry_after} if status in DENIALS else headers
        # The view's own headers of the same names, if any, are left as it wrote them.
        response["headers"] = {**ours, **response.get("headers", {})}


class RateLimitAutoSchema(AutoSchema):
    """drf-spectacular's ``AutoSchema``, documenting what :class:`~ratelimits.throttles.RateLimitThrottle` adds.

    An operation whose view has the throttle gets a 429 and a 503 with their
    ``application/problem+json`` bodies and ``Retry-After``, and the rate-limit headers on every
    response; other operations are left as they are. To keep a schema class of your own, list
    this one first: ``class Schema(RateLimitAutoSchema, YourAutoSchema)``.
    """

    def get_operation(
        self, path: str, path_regex: str, path_prefix: str, method: str, registry: ComponentRegistry
    ) -> dict[str, Any] | None:
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is not None and is_rate_limited(self.view):
            document_rate_limits(operation["responses"], registry)
        return operation


class RateLimitResourceSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """One policy of ``GET /rate_limit``'s ``resources`` (``ratelimits.status.current_limits``)."""

    policy = serializers.CharField()
    subject = serializers.ChoiceField(choices=[kind.value for kind in SubjectKind])
    description = serializers.CharField()
    algorithm = serializers.ChoiceField(choices=[algorithm.value for algorithm in Algorithm])
    limit = serializers.IntegerField(min_value=0)
    remaining = serializers.IntegerField(min_value=0, allow_null=True, help_text="`null` when the store is down.")
    used = serializers.IntegerField(min_value=0, allow_null=True, help_text="`null` when the store is down.")
    reset = serializers.IntegerField(
        allow_null=True, help_text="Seconds since the epoch; `null` for slots, or when the store is down."
    )
    window_seconds = serializers.IntegerField(min_value=1)
    cost = serializers.IntegerField(min_value=1)
    scope = serializers.ChoiceField(choices=[scope.value for scope in Scope])
    origin = serializers.ChoiceField(
        choices=[kind.value for kind in OriginKind],
        help_text="Where it is set: a tier, an assignment or an override of the caller, an endpoint policy, the fleet, "
        "or the settings.",
    )
    # Global policies only (``scope`` ``global``): this region's share.
    region = serializers.CharField(required=False, allow_null=True)
    region_share = serializers.FloatField(required=False, min_value=0, max_value=1)
    region_limit = serializers.IntegerField(required=False, min_value=0)
    reconciled_at = serializers.DateTimeField(required=False, allow_null=True)
    # Quotas by billing period only: the period in force, as the caller's anchor and zone make it.
    period_unit = serializers.ChoiceField(required=False, choices=[unit.value for unit in Unit])
    period_zone = serializers.CharField(required=False, help_text="The IANA time zone the period is counted in.")
    period_start = serializers.DateTimeField(required=False)
    period_end = serializers.DateTimeField(required=False, help_text="When the quota renews.")
    soft = serializers.BooleanField(
        required=False, help_text="Admitted past the quota, the overage counted (billed), not refused."
    )


#: The caller's usage since midnight UTC, a count per metric (``ratelimits.counters.METRICS``).
UsageTodaySerializer = type(
    "UsageTodaySerializer",
    (serializers.Serializer,),
    {metric: serializers.IntegerField(min_value=0) for metric in METRICS.values()},
)


class RateLimitStatusSerializer(serializers.Serializer):  # type: ignore[type-arg]
    """``GET /rate_limit``: every policy of the caller on an endpoint, and its usage today."""

    endpoint = serializers.CharField()
    method = serializers.ChoiceField(choices=HTTP_METHODS)
    degraded = serializers.BooleanField()
    resources = RateLimitResourceSerializer(many=True)
    today = UsageTodaySerializer()


class RateLimitStatusViewSchema(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """The parameters and bodies of :class:`~ratelimits.views.RateLimitStatusView` and its subclasses."""

    target_class = "ratelimits.views.RateLimitStatusView"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        default = self.target.default_endpoint
        endpoint = OpenApiParameter(
            "endpoint",
            {"type": "string", "maxLength": MAX_ENDPOINT_LENGTH},
            description="An endpoint of this API: a route's `throttle_scope` or name.",
            required=default is None,
            default=default,
        )
        method = OpenApiParameter(
            "method", str, enum=HTTP_METHODS, default="GET", description="The method it is called with."
        )
        return _documented_get(
            self.target, parameters=[endpoint, method], responses={200: RateLimitStatusSerializer, 400: FIELD_ERRORS}
        )


class UsageViewSchema(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """The parameters of :class:`~ratelimits.views.UsageView` and its subclasses, and their 400."""

    target_class = "ratelimits.views.UsageView"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        moment = "An ISO 8601 datetime with an offset"
        parameters = [
            OpenApiParameter(
                "from", {"type": "string", "format": "date-time"}, description=f"{moment}; default a day ago."
            ),
            OpenApiParameter("to", {"type": "string", "format": "date-time"}, description=f"{moment}; default now."),
            OpenApiParameter("granularity", str, enum=list(MAX_RANGE), default="hour", description="The rows' period."),
        ]
        responses = {200: self.target.serializer_class, 400: FIELD_ERRORS}
        return _documented_get(self.target, parameters=parameters, responses=responses)


class QuotaUsageViewSchema(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """The parameter and bodies of :class:`~ratelimits.views.QuotaUsageView` and its subclasses."""

    target_class = "ratelimits.views.QuotaUsageView"
    match_subclasses = True

    def view_replacement(self) -> type[APIView]:
        periods = OpenApiParameter(
            "periods",
            {"type": "integer", "minimum": 1, "maximum": MAX_QUOTA_PERIODS},
            default=3,
            description="How many billing periods, the current one last.",
        )
        responses = {200: QuotaUsageListSerializer, 400: FIELD_ERRORS}
        return _documented_get(self.target, parameters=[periods], responses=responses)


def _documented_get(view: type[APIView], **schema: Any) -> type[APIView]:
    """A subclass of ``view``, of the same name, whose GET is documented by ``extend_schema(**schema)``."""
    subclass = type(view.__name__, (view,), {"__module__": view.__module__, "__doc__": view.__doc__})
    documented: type[APIView] = extend_schema_view(get=extend_schema(**schema))(subclass)
    return documented
