"""The demo API: endpoints of different priority and cost."""

from __future__ import annotations

from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ratelimits.views import RateLimitStatusView

from . import downstream
from .models import ApiKey, Charge, Customer


class ChargeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Charge
        fields = ["id", "amount", "currency", "created"]


class CustomerSerializer(serializers.ModelSerializer):
    class Meta:
        model = Customer
        fields = ["id", "email", "created"]


def _owner(request: Request) -> ApiKey:
    if not isinstance(request.auth, ApiKey):
        from rest_framework.exceptions import NotAuthenticated

        raise NotAuthenticated("An API key is required.")
    return request.auth


class ChargeList(APIView):
    """POST creates a charge (critical, cost 1)."""

    throttle_scope = "charges"

    def post(self, request: Request) -> Response:
        serializer = ChargeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        serializer.save(owner=_owner(request))
        downstream.call("charge")  # the payment processor: nothing to wait on, unless DEMO_DOWNSTREAM says
        return Response(serializer.data, status=status.HTTP_201_CREATED)

    def get(self, request: Request) -> Response:
        charges = Charge.objects.filter(owner=_owner(request)).order_by("-id")[:100]
        return Response({"data": ChargeSerializer(charges, many=True).data})


class CustomerList(APIView):
    """GET lists customers (normal priority)."""

    throttle_scope = "customers"

    def get(self, request: Request) -> Response:
        customers = Customer.objects.filter(owner=_owner(request)).order_by("-id")[:100]
        return Response({"data": CustomerSerializer(customers, many=True).data})


class ReportExport(APIView):
    """POST exports a report: low priority, cost 10, and slow."""

    throttle_scope = "reports.export"
    #: Seconds the export waits on its reporting database, unless ``DEMO_DOWNSTREAM`` says otherwise
    #: (see downstream.py); long enough to show concurrency limits.
    duration = 0.5

    def post(self, request: Request) -> Response:
        owner = _owner(request)
        downstream.call("export", self.duration)
        return Response({"rows": owner.charges.count(), "format": "csv"})


class RateLimitStatus(RateLimitStatusView):
    """GET /v1/rate_limit?endpoint=charges&method=POST: the caller's current limits; consumes none of them."""

    default_endpoint = "charges"
