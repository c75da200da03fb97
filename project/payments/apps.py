from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "project.payments"
    label = "payments"
    verbose_name = "Demo payments API"
    default_auto_field = "django.db.models.BigAutoField"
