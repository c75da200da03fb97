from django.urls import include, path

urlpatterns = [
    path("", include("project.payments.urls")),
    path("t/", include("tests.views")),
]
