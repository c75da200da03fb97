"""The demo API: endpoints of different priority and cost."""

from __future__ import annotations

from adrf.views import APIView as AsyncAPIView
from django.db.models import Count, Sum
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ratelimits.openapi import FIELD_ERRORS
from ratelimits.problems import CONTENT_TYPE
from ratelimits.throttles import AsyncRateLimitThrottle
from ratelimits.views import RateLimitStatusView

from . import downstream
from .models import ApiKey, Charge, Customer
from .problems import MALFORMED_BODY


class ChargeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Charge
        fields = ["id", "amount", "currency", "created"]


class CustomerSerializer(serializers.ModelSerializer):
    class Meta:
        model = Customer
        fields = ["id", "email", "created"]


# The bodies the views below build by hand, for the OpenAPI schema.
class ChargePageSerializer(serializers.Serializer):
    data = ChargeSerializer(many=True)


class CustomerPageSerializer(serializers.Serializer):
    data = CustomerSerializer(many=True)


class BalanceSerializer(serializers.Serializer):
    amount = serializers.IntegerField(min_value=0)
    charges = serializers.IntegerField(min_value=0)


class ExportSerializer(serializers.Serializer):
    rows = serializers.IntegerField(min_value=0)
    format = serializers.ChoiceField(choices=["csv"])


def _owner(request: Request) -> ApiKey:
    if not isinstance(request.auth, ApiKey):
        from rest_framework.exceptions import NotAuthenticated

        raise NotAuthenticated("An API key is required.")
    return request.auth


class ChargeList(APIView):
    """POST creates a charge (critical, cost 1)."""

    throttle_scope = "charges"

    @extend_schema(
        request=ChargeSerializer,
        responses={
            201: ChargeSerializer,
            # A body the parser refuses (problems.py), first: the 400's description is the first one's.
            (400, CONTENT_TYPE): MALFORMED_BODY,
            (400, "application/json"): FIELD_ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        serializer = ChargeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        serializer.save(owner=_owner(request))
        downstream.call("charge")  # the payment processor: nothing to wait on, unless DEMO_DOWNSTREAM says
        return Response(serializer.data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=ChargePageSerializer)
    def get(self, request: Request) -> Response:
        charges = Charge.objects.filter(owner=_owner(request)).order_by("-id")[:100]
        return Response({"data": ChargeSerializer(charges, many=True).data})


class CustomerList(APIView):
    """GET lists customers (normal priority)."""

    throttle_scope = "customers"

    @extend_schema(responses=CustomerPageSerializer)
    def get(self, request: Request) -> Response:
        customers = Customer.objects.filter(owner=_owner(request)).order_by("-id")[:100]
        return Response({"data": CustomerSerializer(customers, many=True).data})


class ReportExport(APIView):
    """POST exports a report: low priority, cost 10, and slow."""

    throttle_scope = "reports.export"
    #: Seconds the export waits on its reporting database, unless ``DEMO_DOWNSTREAM`` says otherwise
    #: (see downstream.py); long enough to show concurrency limits.
    duration = 0.5

    @extend_schema(request=None, responses=ExportSerializer)
    def post(self, request: Request) -> Response:
        owner = _owner(request)
        downstream.call("export", self.duration)
        return Response({"rows": owner.charges.count(), "format": "csv"})


class Balance(AsyncAPIView):
    """GET the caller's balance: an async view (adrf), decided on the event loop under ASGI."""

    throttle_scope = "balance"
    throttle_classes = [AsyncRateLimitThrottle]

    @extend_schema(responses=BalanceSerializer)
    async def get(self, request: Request) -> Response:
        charges = Charge.objects.filter(owner=_owner(request))
        totals = await charges.aaggregate(amount=Sum("amount"), charges=Count("id"))
        return Response({"amount": totals["amount"] or 0, "charges": totals["charges"]})


class RateLimitStatus(RateLimitStatusView):
    """GET /v1/rate_limit?endpoint=charges&method=POST: the caller's current limits; consumes none of them."""

    default_endpoint = "charges"
