"""Views used only by the tests."""

from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from ratelimits.middleware import ratelimit


class Ping(APIView):
    throttle_scope = "ping"

    def get(self, request):  # type: ignore[no-untyped-def]
        return Response({"ok": True})


@ratelimit(scope="plain")
def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain ok")


urlpatterns = [
    path("ping", Ping.as_view(), name="ping"),
    path("plain", plain, name="plain"),
]
