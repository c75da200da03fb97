"""A URLconf for tests/test_drf_compat.py: a view DRF still throttles, with a scope nothing rates."""

from django.urls import path

from .test_drf_compat import StillDrf, search

urlpatterns = [path("legacy", StillDrf.as_view(), name="legacy"), path("search", search, name="search")]
