from django.contrib import admin
from django.urls import include, path

from project import views as demo

urlpatterns = [
    path("", demo.landing, name="demo-landing"),
    path("docs/<slug:name>", demo.doc, name="demo-doc"),
    path("", include("project.payments.urls")),
    path("t/", include("tests.views")),
    path("admin/", admin.site.urls),
]
