"""The Django admin for policies: tiers, assignments, endpoints, overrides, fleet settings, audit.

Every save, delete and action runs inside :func:`~ratelimits.audit.audit_context`, so the audit
trail knows who did it and why; every committed change reaches every worker on its next request.
"""

from __future__ import annotations

import math
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone

from .algorithms import Algorithm
from .audit import audit_context
from .autocomplete import subject_suggestions_view
from .engine import get_limiter, get_policy_source
from .exceptions import BackendUnavailable
from .identity import Identity, Subject, ip_subject_value, normalize_ip
from .models import (
    SUBJECT_KINDS,
    AuditEntry,
    ConcurrentEdit,
    EndpointPolicy,
    FleetSettings,
    Override,
    SubjectAssignment,
    Tier,
    validate_endpoint,
)
from .rates import parse_rate
from .reports import usage_report_view


class RevisionedForm(forms.ModelForm):  # type: ignore[type-arg]
    """Carries the revision the editor started from, so a concurrent save is caught, not lost."""

    change_reason = forms.CharField(
        required=False, max_length=500, help_text="Why you are making this change (kept in the audit trail)."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "revision" in self.fields:
            self.fields["revision"].widget = forms.HiddenInput()
            self.fields["revision"].required = False

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        instance = self.instance
        if instance.pk is not None and "revision" in cleaned:
            stored = type(instance)._default_manager.filter(pk=instance.pk).values_list("revision", flat=True).first()
            started = cleaned.get("revision")
            if stored is not None and started is not None and stored != started:
                raise forms.ValidationError(
                    f"Someone else saved this {instance._meta.verbose_name} while you were editing it. "
                    "Reload the page to see their change, then apply yours again.",
                    code="concurrent_edit",
                )
        return cleaned


class SubjectForm(RevisionedForm):
    """A subject's identifier field suggests users and API keys as the admin types."""

    class Media:
        js = ("ratelimits/subject-autocomplete.js",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields.get("subject_id")
        if field is not None:
            field.widget.attrs.update(
                {
                    "data-suggest-url": reverse("admin:ratelimits_subject_suggestions"),
                    "data-kind-field": "id_subject_kind",
                    "placeholder": "type a name to search users and API keys",
                }
            )


class AuditedAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Saves, deletes and actions are attributed to the admin user, with their reason."""

    form = RevisionedForm

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        with audit_context(request.user, form.cleaned_data.get("change_reason", "")):
            try:
                super().save_model(request, obj, form, change)
            except ConcurrentEdit:
                # Lost the race between the form's check and the save: nothing was written.
                raise PermissionDenied("This object was changed by someone else meanwhile; reload and retry.") from None

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        with audit_context(request.user, "deleted in the admin"):
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        with audit_context(request.user, "deleted in the admin"):
            super().delete_queryset(request, queryset)


def _switch(field: str, value: bool, label: str) -> Any:
    """An admin action setting ``field`` to ``value`` on the selected rows (audited, versioned)."""

    def action(modeladmin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Any]) -> None:  # type: ignore[type-arg]
        with audit_context(request.user, f"admin action: {label}"):
            count = queryset.update(**{field: value})
        modeladmin.message_user(
            request, f"{label}: {count} {modeladmin.model._meta.verbose_name_plural}.", messages.SUCCESS
        )

    action.__name__ = f"{field}_{'on' if value else 'off'}"
    return admin.action(description=f"{label} (selected)", permissions=["change"])(action)


ENABLE = _switch("enabled", True, "Enable")
DISABLE = _switch("enabled", False, "Disable")
SHADOW_ON = _switch("shadow", True, "Shadow mode on")
SHADOW_OFF = _switch("shadow", False, "Shadow mode off")


def _describe(rate: str, burst: int | None) -> str:
    if not rate:
        return "—"
    try:
        parsed = parse_rate(rate)
    except Exception:
        return rate
    return f"{parsed.describe()}, burst {burst or parsed.limit}"


@admin.register(Tier)
class TierAdmin(AuditedAdmin):
    list_display = ("name", "limits", "concurrency", "quota", "algorithm", "fail_mode", "enabled", "shadow")
    list_filter = ("enabled", "shadow", "algorithm", "fail_mode")
    search_fields = ("name", "description")
    actions = (ENABLE, DISABLE, SHADOW_ON, SHADOW_OFF)
    fields = (
        "name",
        ("rate", "burst"),
        "concurrency",
        "quota",
        "algorithm",
        "fail_mode",
        ("enabled", "shadow"),
        "description",
        "change_reason",
        "revision",
    )

    @admin.display(description="limits")
    def limits(self, obj: Tier) -> str:
        return obj.describe()


@admin.register(SubjectAssignment)
class SubjectAssignmentAdmin(AuditedAdmin):
    form = SubjectForm
    list_display = ("subject_kind", "subject_id", "tier", "starts_at", "expires_at", "active")
    list_filter = ("subject_kind", "tier")
    search_fields = ("subject_id", "note")
    autocomplete_fields = ("tier",)
    fields = (("subject_kind", "subject_id"), "tier", ("starts_at", "expires_at"), "note", "change_reason", "revision")

    @admin.display(boolean=True)
    def active(self, obj: SubjectAssignment) -> bool:
        now = timezone.now()
        return (obj.starts_at is None or obj.starts_at <= now) and (obj.expires_at is None or now < obj.expires_at)


@admin.register(EndpointPolicy)
class EndpointPolicyAdmin(AuditedAdmin):
    list_display = ("__str__", "cost", "priority", "per_caller", "all_callers", "exempt", "enabled", "shadow")
    list_filter = ("priority", "method", "exempt", "enabled", "shadow")
    search_fields = ("endpoint", "description")
    actions = (ENABLE, DISABLE, SHADOW_ON, SHADOW_OFF)
    fields = (
        ("endpoint", "method"),
        ("cost", "priority"),
        ("per_caller_rate", "per_caller_burst"),
        ("endpoint_rate", "endpoint_burst"),
        ("exempt", "enabled", "shadow"),
        "description",
        "change_reason",
        "revision",
    )

    @admin.display(description="per caller")
    def per_caller(self, obj: EndpointPolicy) -> str:
        return _describe(obj.per_caller_rate, obj.per_caller_burst)

    @admin.display(description="all callers")
    def all_callers(self, obj: EndpointPolicy) -> str:
        return _describe(obj.endpoint_rate, obj.endpoint_burst)


@admin.register(Override)
class OverrideAdmin(AuditedAdmin):
    form = SubjectForm
    list_display = ("__str__", "values", "expires_at", "active", "created_by", "short_reason", "shadow")
    list_filter = ("subject_kind", "enabled", "shadow")
    search_fields = ("subject_id", "endpoint", "reason")
    actions = (ENABLE, DISABLE, SHADOW_ON, SHADOW_OFF)
    readonly_fields = ("created_by", "created_at")
    fields = (
        ("subject_kind", "subject_id"),
        "endpoint",
        ("rate", "burst"),
        "multiplier",
        "concurrency",
        "reason",
        "expires_at",
        ("enabled", "shadow"),
        ("created_by", "created_at"),
        "revision",
    )

    @admin.display(description="values")
    def values(self, obj: Override) -> str:
        return f"x {obj.multiplier}" if obj.multiplier is not None else _describe(obj.rate, obj.burst)

    @admin.display(boolean=True)
    def active(self, obj: Override) -> bool:
        return obj.is_active

    @admin.display(description="reason")
    def short_reason(self, obj: Override) -> str:
        return obj.reason if len(obj.reason) <= 60 else obj.reason[:59] + "…"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not change:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)


@admin.register(FleetSettings)
class FleetSettingsAdmin(AuditedAdmin):
    list_display = ("__str__", "default_fail_mode", "shadow", "anonymous_tier", "authenticated_tier", "capacity")
    fields = (
        "default_fail_mode",
        "shadow",
        ("anonymous_tier", "authenticated_tier"),
        "capacity",
        ("shed_low_percent", "shed_normal_percent", "shed_high_percent"),
        "change_reason",
        "revision",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return super().has_add_permission(request) and not FleetSettings.objects.exists()

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            path("effective/", view(self.effective_policy_view), name="ratelimits_effective_policy"),
            path("subjects/", view(subject_suggestions_view), name="ratelimits_subject_suggestions"),
            path("usage/", view(usage_report_view(self)), name="ratelimits_usage_report"),
            *super().get_urls(),
        ]

    def effective_policy_view(self, request: HttpRequest) -> HttpResponse:
        """Which checks apply to a subject on an endpoint, where each value comes from, what is left."""
        if not request.user.has_perm("ratelimits.view_tier"):
            raise PermissionDenied
        form = EffectivePolicyForm(request.POST if request.method == "POST" else request.GET or None)
        rows: list[dict[str, Any]] = []
        degraded = False
        if form.is_bound and form.is_valid():
            identity, method = form.identity(), form.cleaned_data["method"]
            explained = explain(identity, method)
            checks = [e.check for e in explained]
            if request.method == "POST" and "reset" in request.POST:
                if not request.user.has_perm("ratelimits.change_tier"):
                    raise PermissionDenied
                self._reset(request, identity, checks)
            decision = get_limiter().decide(checks, consume=False)
            degraded = decision.degraded
            by_check = {id(r.check): r for r in decision.results}
            for entry in explained:
                result = by_check.get(id(entry.check))
                policy = entry.check.policy
                remaining = reset_seconds = None
                if result is not None:
                    remaining = min(result.remaining + (entry.check.cost if result.allowed else 0), result.limit)
                    # The look-ahead charged the cost: a bucket's reset includes refilling it again.
                    reset_us = result.reset_us
                    if result.allowed and policy.algorithm is Algorithm.TOKEN_BUCKET:
                        reset_us -= entry.check.cost * policy.rate.period_us / policy.rate.limit
                    if not policy.holds_slots:  # slots come back when requests finish
                        reset_seconds = 0 if remaining >= result.limit else math.ceil(max(reset_us, 0) / 1_000_000)
                rows.append(
                    {
                        "policy": policy.name,
                        "description": policy.describe(),
                        "subject": entry.check.subject.kind,
                        "cost": entry.check.cost,
                        "origin": entry.origin,
                        "shadow": policy.shadow,
                        "fail_mode": policy.fail_mode,
                        "limit": policy.capacity,
                        "remaining": remaining,
                        "reset_seconds": reset_seconds,
                    }
                )
        context = {
            **self.admin_site.each_context(request),
            "title": "Effective policy",
            "form": form,
            "rows": rows,
            "degraded": degraded,
            "submitted": form.is_bound and form.is_valid(),
            "can_reset": request.user.has_perm("ratelimits.change_tier"),
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/ratelimits/effective_policy.html", context)

    def _reset(self, request: HttpRequest, identity: Identity, checks: list[Any]) -> None:
        """Clear the subject's counters (not endpoint-wide ones, which every caller shares)."""
        own = [c for c in checks if c.subject.kind != "endpoint"]
        caller = identity.caller
        try:
            get_limiter().backend.clear(own)
        except BackendUnavailable as exc:
            self.message_user(
                request, f"Counters not reset: the limiter's store is unavailable ({exc}).", messages.ERROR
            )
            return
        AuditEntry.objects.create(
            actor=request.user if request.user.is_authenticated else None,
            action="reset",
            model="ratelimits.counters",
            object_id=f"{caller.kind}:{caller.value}"[:100],
            object_repr=f"counters of {caller.kind} {caller.value}"[:300],
            after={"policies": sorted({c.policy.name for c in own}), "subjects": sorted({c.subject.kind for c in own})},
            reason="reset from the effective policy page",
        )
        self.message_user(request, f"Counters reset for {caller.kind} {caller.value}.", messages.SUCCESS)


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("at", "actor", "action", "model", "object_repr", "reason")
    list_filter = ("action", "model")
    search_fields = ("object_repr", "reason", "object_id")
    date_hierarchy = "at"
    readonly_fields = ("at", "actor", "action", "model", "object_id", "object_repr", "before", "after", "reason")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


class EffectivePolicyForm(forms.Form):
    """Pick a subject (any of its identities) and an endpoint."""

    api_key = forms.CharField(required=False, label="API key", help_text='The API key identity, e.g. "ApiKey:3".')
    user = forms.CharField(required=False, help_text="A user id.")
    org = forms.CharField(required=False, label="Organisation")
    ip = forms.CharField(required=False, label="Client IP")
    endpoint = forms.CharField(validators=[validate_endpoint], help_text="throttle_scope or route name")
    method = forms.ChoiceField(choices=[(m, m) for m in ("GET", "POST", "PUT", "PATCH", "DELETE")], initial="GET")

    def clean_ip(self) -> str:
        raw = str(self.cleaned_data["ip"]).strip()
        if raw and normalize_ip(raw) is None:
            raise forms.ValidationError(f"{raw!r} is not an IP address.")
        return raw

    def clean_user(self) -> str:
        raw = str(self.cleaned_data["user"]).strip()
        if raw and not raw.isdigit():
            raise forms.ValidationError("A user is identified by its id (a number).")
        return raw

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if not any(cleaned.get(kind) for kind, _ in SUBJECT_KINDS):
            raise forms.ValidationError("Give at least one identity of the subject.")
        return cleaned

    def identity(self) -> Identity:
        data = self.cleaned_data
        return Identity(
            ip=Subject("ip", ip_subject_value(data["ip"]) if data["ip"] else "unknown"),
            endpoint=Subject("endpoint", data["endpoint"]),
            user=Subject("user", data["user"]) if data["user"] else None,
            api_key=Subject("api_key", data["api_key"].strip()) if data["api_key"].strip() else None,
            organization=Subject("org", data["org"].strip()) if data["org"].strip() else None,
        )


def explain(identity: Identity, method: str) -> list[Any]:
    """The checks for ``identity`` on its endpoint, each with where its values come from."""
    from .sources import Explained

    request = HttpRequest()
    request.method = method
    source = get_policy_source()
    explain_ = getattr(source, "explain", None)
    if explain_ is not None:
        return list(explain_(request, identity))
    return [Explained(check, "settings") for check in source.checks_for(request, identity)]
