from django.contrib import admin
from django.urls import include, path, re_path

from project import views as demo

urlpatterns = [
    path("", demo.landing, name="demo-landing"),
    re_path(r"^docs/(?P<path>.*)$", demo.docs, name="demo-docs"),
    path("", include("project.payments.urls")),
    path("t/", include("tests.views")),
    path("admin/", admin.site.urls),
]
