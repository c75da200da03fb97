from django.urls import path

from ratelimits.views import QuotaUsageView, UsageView

from . import views

urlpatterns = [
    path("v1/charges", views.ChargeList.as_view(), name="charges"),
    path("v1/customers", views.CustomerList.as_view(), name="customers"),
    path("v1/balance", views.Balance.as_view(), name="balance"),
    path("v1/reports/export", views.ReportExport.as_view(), name="reports-export"),
    path("v1/rate_limit", views.RateLimitStatus.as_view(), name="rate-limit"),
    path("v1/usage", UsageView.as_view(), name="usage"),
    path("v1/usage/quota", QuotaUsageView.as_view(), name="usage-quota"),
]
