"""The demo's own models in the admin (the API keys are what staff pick subjects by)."""

from django.contrib import admin

from .models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "prefix", "tier", "organization", "is_active", "created")
    list_filter = ("tier", "is_active")
    search_fields = ("name", "prefix", "organization")
    readonly_fields = ("key_hash", "created")
