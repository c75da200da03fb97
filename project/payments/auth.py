"""API key authentication for the demo: ``Authorization: Bearer sk_...``."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from .models import ApiKey, hash_key


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, ApiKey] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        keyword, _, raw = header.partition(" ")
        if keyword != self.keyword or not raw.strip():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <api key>'.")
        try:
            key = ApiKey.objects.get(key_hash=hash_key(raw.strip()), is_active=True)
        except ApiKey.DoesNotExist:
            raise exceptions.AuthenticationFailed("Unknown or revoked API key.") from None
        return None, key

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """The OpenAPI security scheme of :class:`ApiKeyAuthentication` (drf-spectacular finds it by its target)."""

    target_class = ApiKeyAuthentication
    name = "ApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return build_bearer_security_scheme_object(
            header_name="Authorization", token_prefix=ApiKeyAuthentication.keyword
        )


def tier_of(request: Any, identity: Any) -> str | None:
    """RATELIMITS['POLICIES']['TIER_FUNC']: the tier stored on the API key, if any."""
    key = getattr(request, "auth", None)
    return key.tier if isinstance(key, ApiKey) else None


def organization_of(request: Any) -> str | None:
    """RATELIMITS['IDENTITY']['ORGANIZATION_FUNC']: the API key's organisation."""
    key = getattr(request, "auth", None)
    return key.organization or None if isinstance(key, ApiKey) else None
