"""Views used only by the tests."""

from typing import Any

from adrf.views import APIView as AsyncAPIView
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from ratelimits.decorators import throttle
from ratelimits.middleware import ratelimit_exempt
from ratelimits.throttles import AsyncRateLimitThrottle


class Ping(APIView):
    throttle_scope = "ping"

    def get(self, request):  # type: ignore[no-untyped-def]
        return Response({"ok": True})


@throttle(endpoint="plain")
def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain ok")


urlpatterns = [
    path("ping", Ping.as_view(), name="ping"),
    path("plain", plain, name="plain"),
]


def unmarked(request: HttpRequest) -> HttpResponse:
    return HttpResponse("unmarked ok")


@ratelimit_exempt
def exempt(request: HttpRequest) -> HttpResponse:
    return HttpResponse("exempt ok")


urlpatterns += [
    path("unmarked", unmarked, name="unmarked"),
    path("exempt", exempt, name="exempt"),
]


class Gated(APIView):
    """Held inside until the test opens ``tests.support.gate.GATE`` (in-flight limit tests).

    GET and POST are separate endpoints to ``RATELIMITS['ENDPOINTS']`` ("GET gated", "POST
    gated"), so one view can serve two priority classes.
    """

    throttle_scope = "gated"

    def get(self, request):  # type: ignore[no-untyped-def]
        return self._hold()

    def post(self, request):  # type: ignore[no-untyped-def]
        return self._hold()

    def _hold(self) -> Response:
        from .support.gate import GATE

        if not GATE.pass_through():
            return Response({"ok": False, "detail": "the gate never opened"}, status=504)
        return Response({"ok": True})


urlpatterns += [path("gated", Gated.as_view(), name="gated")]


class Status(APIView):
    """Answers the status code in its path: a view failing with a 5xx, for the adaptive capacity."""

    throttle_scope = "status"

    def get(self, request, code):  # type: ignore[no-untyped-def]
        return Response({"status": code}, status=code)


urlpatterns += [path("status/<int:code>", Status.as_view(), name="status")]


# -- async views: the same engine, decided on the event loop ----------------------------------


@throttle(endpoint="async-plain")
async def async_plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async plain ok")


async def async_unmarked(request: HttpRequest) -> HttpResponse:
    """Limited only by RateLimitMiddleware, when a test installs it."""
    return HttpResponse("async unmarked ok")


@throttle(endpoint="async-gated")
async def async_gated(request: HttpRequest) -> HttpResponse:
    """Held inside (off the event loop) until the test opens ``tests.support.gate.GATE``."""
    from asgiref.sync import sync_to_async

    from .support.gate import GATE

    if not await sync_to_async(GATE.pass_through, thread_sensitive=False)():
        return HttpResponse("the gate never opened", status=504)
    return HttpResponse("async gated ok")


@throttle(endpoint="streaming")
def streaming(request: HttpRequest) -> StreamingHttpResponse:
    """A body made after the view returned, by a generator that keeps no reference to the request."""
    return StreamingHttpResponse(iter([b"one ", b"two ", b"three"]))


class AsyncPing(AsyncAPIView):
    throttle_scope = "async-ping"
    throttle_classes = [AsyncRateLimitThrottle]

    async def get(self, request):  # type: ignore[no-untyped-def]
        return Response({"ok": True})


urlpatterns += [
    path("async/plain", async_plain, name="async-plain"),
    path("async/unmarked", async_unmarked, name="async-unmarked"),
    path("async/gated", async_gated, name="async-gated"),
    path("async/ping", AsyncPing.as_view(), name="async-ping"),
    path("streaming", streaming, name="streaming"),
]


# -- charges settled after the response (docs/charging.md) ---------------------------------------


def _outcome_of(request: HttpRequest, query: Any, target: object) -> int:
    """The status the query asks for (``?status=500``), after setting the request's true cost on
    ``target`` if asked (``?cost=7``): what a view that charges by outcome or by work does. With
    ``?gate=1``, held inside until the test opens ``tests.support.gate.GATE`` first; with
    ``?raise=1``, it raises instead."""
    if "gate" in query:
        from .support.gate import GATE

        if not GATE.pass_through():
            return 504
    if "raise" in query:
        raise RuntimeError("a view that fails: Django answers 500")
    if "cost" in query:
        cost = query["cost"]  # a number, or anything else a buggy view could set
        target.ratelimit_cost = int(cost) if cost.lstrip("-").isdigit() else cost  # type: ignore[attr-defined]
    return int(query.get("status", 200))


class Charged(APIView):
    """A DRF view whose status and true cost the query sets: ``counts`` and ``max_cost`` at work."""

    throttle_scope = "charged"

    def get(self, request):  # type: ignore[no-untyped-def]
        return Response({"ok": True}, status=_outcome_of(request, request.query_params, request))


@throttle(endpoint="plain-charged")
def plain_charged(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain charged", status=_outcome_of(request, request.GET, request))


class AsyncCharged(AsyncAPIView):
    throttle_scope = "async-charged"
    throttle_classes = [AsyncRateLimitThrottle]

    async def get(self, request):  # type: ignore[no-untyped-def]
        return Response({"ok": True}, status=_outcome_of(request, request.query_params, request))


urlpatterns += [
    path("charged", Charged.as_view(), name="charged"),
    path("plain-charged", plain_charged, name="plain-charged"),
    path("async/charged", AsyncCharged.as_view(), name="async-charged"),
]


def _graphql(request: HttpRequest) -> HttpResponse:
    """docs/charging.md's GraphQL endpoint, as the page writes it (imported when first asked)."""
    from .support.documented_graphql import graphql

    return graphql(request)  # type: ignore[no-any-return]


urlpatterns += [path("graphql", _graphql, name="graphql")]
