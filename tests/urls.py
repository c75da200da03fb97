from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("project.payments.urls")),
    path("t/", include("tests.views")),
    path("admin/", admin.site.urls),
]
