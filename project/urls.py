from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from ratelimits import metrics

from . import views

#: The schema and its docs describe the API and are not part of it: public, neither authenticated nor limited.
DOCUMENTATION = {"authentication_classes": [], "throttle_classes": []}

urlpatterns = [
    path("", views.landing, name="demo-landing"),
    # The documentation site that `make docs` builds (mkdocs.yml), served as files.
    re_path(r"^docs/(?P<path>.*)$", views.docs, name="demo-docs"),
    path("api/schema/", SpectacularAPIView.as_view(**DOCUMENTATION), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", **DOCUMENTATION), name="swagger-ui"),
    path("admin/", admin.site.urls),
    # Prometheus's scrape (RATELIMITS['METRICS']); in production, route it where only the scraper reaches.
    path("metrics", metrics.view, name="metrics"),
    path("", include("project.payments.urls")),
]
