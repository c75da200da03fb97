"""A URLconf for tests/test_drf_compat.py: a view DRF still throttles, with a scope nothing rates,
beside a view that lists RateLimitThrottle classes of its own."""

from django.urls import path

from .test_drf_compat import Burst, StillDrf, search

urlpatterns = [
    path("legacy", StillDrf.as_view(), name="legacy"),
    path("search", search, name="search"),
    path("burst", Burst.as_view(), name="burst"),
]
