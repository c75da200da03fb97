from django.contrib import admin
from django.urls import include, path

from . import views

urlpatterns = [
    path("", views.landing, name="demo-landing"),
    path("docs/<slug:name>", views.doc, name="demo-doc"),
    path("admin/", admin.site.urls),
    path("", include("project.payments.urls")),
]
