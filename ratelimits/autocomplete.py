"""Subject autocomplete for the admin: find users and API keys by what staff know about them."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest, JsonResponse

from .conf import conf
from .identity import SubjectKind

__all__ = ["subject_suggestions_view"]

#: Suggestions returned for one query.
LIMIT = 20


def subject_suggestions_view(request: HttpRequest) -> JsonResponse:
    """``?kind=api_key|user&term=...`` → ``{"results": [{"id": <subject id>, "text": <label>}]}``.

    Searches with the model's own admin ``search_fields`` (as Django's autocomplete does), and
    only models the requesting user may view. The ``id`` is the identifier the limiter uses, so
    it can go straight into a subject field.
    """
    if not request.user.has_perm("ratelimits.view_tier"):
        raise PermissionDenied
    kind = request.GET.get("kind", "")
    term = request.GET.get("term", "").strip()[:100]
    if kind == SubjectKind.USER:
        model: type[Model] | None = get_user_model()
    elif kind == SubjectKind.API_KEY:
        model = conf.identity.api_key_model
    else:
        model = None
    if model is None or not term:
        return JsonResponse({"results": []})
    model_admin = admin.site._registry.get(model)
    if model_admin is None or not model_admin.has_view_permission(request):
        return JsonResponse({"results": []})
    queryset, _ = model_admin.get_search_results(request, model._default_manager.all(), term)
    results = [{"id": _identifier(kind, obj), "text": str(obj)} for obj in queryset[:LIMIT]]
    return JsonResponse({"results": [r for r in results if r["id"]]})


def _identifier(kind: str, obj: Any) -> str:
    if kind == SubjectKind.USER:
        return str(obj.pk)
    return str(conf.identity.api_key_func(obj) or "")
