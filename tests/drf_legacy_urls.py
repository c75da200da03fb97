"""A URLconf for tests/test_drf_compat.py: a view DRF still throttles, with a scope nothing rates,
beside a view that lists RateLimitThrottle classes of its own, one whose scope is exempt, and this
app's own customer API (whose scopes are its own, on purpose)."""

from django.urls import path

from ratelimits.views import RateLimitStatusView, UsageView

from .test_drf_compat import Burst, Health, StillDrf, search

urlpatterns = [
    path("legacy", StillDrf.as_view(), name="legacy"),
    path("search", search, name="search"),
    path("burst", Burst.as_view(), name="burst"),
    path("health", Health.as_view(), name="health"),
    path("v1/usage", UsageView.as_view(), name="usage"),
    path("v1/rate_limit", RateLimitStatusView.as_view(), name="rate_limit"),
]
