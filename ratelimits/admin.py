"""The Django admin for policies (tiers, assignments, endpoints, overrides, fleet settings, audit) and notices.

Every save, delete and action runs inside :func:`~ratelimits.store.audit.audit_context`, so the audit
trail knows who did it and why; every committed change reaches every worker on its next request.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone

from . import documentation
from .autocomplete import subject_suggestions_view
from .backends import HealthSupport, RegionSupport, StoreHealth, get_backend
from .choices import HTTP_METHODS, Counts
from .conf import conf
from .exceptions import BackendUnavailable, ConfigurationError
from .identity import SubjectKind, normalize_ip
from .models import (
    SUBJECT_KINDS,
    AuditEntry,
    ConcurrentEdit,
    Delivery,
    DeliveryAttempt,
    EndpointPolicy,
    FleetSettings,
    Notice,
    Override,
    SubjectAssignment,
    Tier,
    WebhookEndpoint,
    describe_limit,
    expired,
    validate_endpoint,
)
from .policies.source import get_policy_source
from .policies.values import every_shard
from .reports.preview import DAYS as PREVIEW_DAYS
from .reports.preview import PolicyPreview, base_policies_of, preview_endpoint, preview_override, preview_tier
from .reports.report import usage_report_view
from .status import Caller, RegionShare, effective_limits, stand_in
from .store.audit import audit_context, record_reset
from .store.database import DatabasePolicySource


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


class ExpiringForm(SubjectForm):
    """An override's or assignment's form: an expiry that has already passed is saved only once confirmed.

    Such a row never applies, which is rarely what was meant (a mistyped year, a form copied from an
    old incident), so it is not saved without a word. The tick box comes with the error, and stays
    while the expiry is past; a later expiry needs nothing more.
    """

    CONFIRM = "Save with this past expiry"

    confirm_expired = forms.BooleanField(
        required=False, widget=forms.HiddenInput, label=CONFIRM, help_text="It is kept, but never applies."
    )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if expired(cleaned.get("expires_at"), now=timezone.now()):
            self.fields["confirm_expired"].widget = forms.CheckboxInput()
            if not cleaned.get("confirm_expired"):
                noun = self._meta.model._meta.verbose_name
                self.add_error(
                    "expires_at",
                    f"This expiry has already passed: the {noun} would never apply. "
                    f"Give a later one, or tick “{self.CONFIRM}” to save it anyway.",
                )
        return cleaned


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


class PreviewedAdmin(AuditedAdmin):
    """An admin whose change form can show, before saving, what the change would have refused over
    the last days of recorded usage (:mod:`ratelimits.reports.preview`): the form's *Preview*
    button validates it as a save would, computes, and shows the form again, unsaved."""

    def previews(self, request: HttpRequest, candidate: Any) -> list[PolicyPreview]:
        raise NotImplementedError

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        may = self.has_add_permission(request) if object_id is None else self.has_change_permission(request)
        context = {
            **(extra_context or {}),
            "can_preview": may,
            "preview_days": PREVIEW_DAYS,
            "previews_help": documentation.page("previews"),
        }
        if request.method == "POST" and "_preview" in request.POST:
            return self._preview_view(request, object_id, form_url, context)
        return super().changeform_view(request, object_id, form_url, context)

    def _preview_view(
        self, request: HttpRequest, object_id: str | None, form_url: str, extra_context: dict[str, Any]
    ) -> HttpResponse:
        """The change form again, bound to what was posted, with what it would have refused: as
        Django's own change view builds the page, but nothing saved."""
        obj = self.get_object(request, unquote(object_id)) if object_id else None
        add = obj is None
        if object_id and obj is None:
            redirect: HttpResponse = self._get_obj_does_not_exist_redirect(  # type: ignore[attr-defined]
                request, self.opts, object_id
            )
            return redirect
        allowed = self.has_add_permission(request) if add else self.has_change_permission(request, obj)
        if not allowed:
            raise PermissionDenied
        form = self.get_form(request, obj, change=not add)(request.POST, request.FILES, instance=obj)
        previews = None
        if form.is_valid():
            try:
                previews = self.previews(request, form.instance)
            except ConfigurationError as exc:  # a value the form let through but a policy cannot take
                form.add_error(None, str(exc))
        admin_form = helpers.AdminForm(
            form,
            list(self.get_fieldsets(request, obj)),  # type: ignore[arg-type]
            self.get_prepopulated_fields(request, obj),
            self.get_readonly_fields(request, obj),
            model_admin=self,
        )
        context = {
            **self.admin_site.each_context(request),
            "title": f"{'Add' if add else 'Change'} {self.opts.verbose_name}",
            "subtitle": str(obj) if obj is not None else None,
            "adminform": admin_form,
            "object_id": object_id,
            "original": obj,
            "is_popup": False,
            "to_field": None,
            "media": self.media + admin_form.media,
            "inline_admin_formsets": [],
            "errors": helpers.AdminErrorList(form, []),
            "preserved_filters": self.get_preserved_filters(request),
            "previews": previews,
            **extra_context,
        }
        return self.render_change_form(request, context, add=add, change=not add, obj=obj, form_url=form_url)


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


@admin.register(Tier)
class TierAdmin(PreviewedAdmin):
    list_display = ("name", "limits", "concurrency", "quota", "algorithm", "fail_mode", "scope", "enabled", "shadow")
    list_filter = ("enabled", "shadow", "algorithm", "fail_mode", "scope")
    search_fields = ("name", "description")
    actions = (ENABLE, DISABLE, SHADOW_ON, SHADOW_OFF)
    fields = (
        "name",
        ("rate", "burst"),
        "concurrency",
        ("quota", "quota_zone", "quota_mode"),
        "algorithm",
        "fail_mode",
        "scope",
        ("enabled", "shadow"),
        "description",
        "change_reason",
        "revision",
    )

    def previews(self, request: HttpRequest, candidate: Tier) -> list[PolicyPreview]:
        return [preview_tier(candidate)]

    @admin.display(description="limits")
    def limits(self, obj: Tier) -> str:
        return obj.describe()


@admin.register(SubjectAssignment)
class SubjectAssignmentAdmin(AuditedAdmin):
    form = ExpiringForm
    list_display = ("subject_kind", "subject_id", "tier", "starts_at", "expires_at", "active")
    list_filter = ("subject_kind", "tier")
    search_fields = ("subject_id", "note")
    autocomplete_fields = ("tier",)
    fields = (
        ("subject_kind", "subject_id"),
        "tier",
        ("starts_at", "expires_at"),
        "quota_anchor",
        "confirm_expired",
        "note",
        "change_reason",
        "revision",
    )

    @admin.display(boolean=True)
    def active(self, obj: SubjectAssignment) -> bool:
        now = timezone.now()
        return (obj.starts_at is None or obj.starts_at <= now) and not expired(obj.expires_at, now=now)


@admin.register(EndpointPolicy)
class EndpointPolicyAdmin(PreviewedAdmin):
    list_display = (
        "__str__",
        "cost",
        "priority",
        "per_caller",
        "all_callers",
        "charged",
        "exempt",
        "enabled",
        "shadow",
    )
    list_filter = ("priority", "method", "counts", "exempt", "enabled", "shadow")
    search_fields = ("endpoint", "description")
    actions = (ENABLE, DISABLE, SHADOW_ON, SHADOW_OFF)
    fields = (
        ("endpoint", "method"),
        ("cost", "priority"),
        ("counts", "max_cost"),
        ("per_caller_rate", "per_caller_burst"),
        ("endpoint_rate", "endpoint_burst", "endpoint_shards"),
        ("exempt", "enabled", "shadow"),
        "description",
        "change_reason",
        "revision",
    )

    def previews(self, request: HttpRequest, candidate: EndpointPolicy) -> list[PolicyPreview]:
        return preview_endpoint(candidate)

    @admin.display(description="per caller")
    def per_caller(self, obj: EndpointPolicy) -> str:
        return describe_limit(obj.per_caller_rate, obj.per_caller_burst) if obj.per_caller_rate else "—"

    @admin.display(description="charged")
    def charged(self, obj: EndpointPolicy) -> str:
        text = Counts(obj.counts).description if obj.counts in Counts._value2member_map_ else obj.counts
        return f"{text}, trued up to {obj.max_cost}" if obj.max_cost else text

    @admin.display(description="all callers")
    def all_callers(self, obj: EndpointPolicy) -> str:
        if not obj.endpoint_rate:
            return "—"
        text = describe_limit(obj.endpoint_rate, obj.endpoint_burst)
        return f"{text}, in {obj.endpoint_shards} shards" if obj.endpoint_shards > 1 else text


@admin.register(Override)
class OverrideAdmin(PreviewedAdmin):
    form = ExpiringForm
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
        "scope",
        "concurrency",
        ("quota", "quota_mode"),
        "reason",
        "expires_at",
        "confirm_expired",
        ("enabled", "shadow"),
        ("created_by", "created_at"),
        "revision",
    )

    def previews(self, request: HttpRequest, candidate: Override) -> list[PolicyPreview]:
        return [preview_override(candidate, base_policies_of(candidate.subject_kind, candidate.subject_id))]

    @admin.display(description="values")
    def values(self, obj: Override) -> str:
        return obj.describe()

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

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The fleet's page also says whether the limiter's store evicts its keys, and how many it has."""
        try:
            backend = get_backend()
            store: StoreHealth | None = backend.store_health() if isinstance(backend, HealthSupport) else None
            store_error = ""
        except BackendUnavailable as exc:
            store, store_error = None, str(exc)
        workers: list[dict[str, Any]] = []
        workers_error = ""
        adaptive = conf.shedding.adaptive.settings is not None
        if adaptive:
            try:
                workers = [{**worker, "moved": _moment(worker.get("moved_at"))} for worker in get_backend().workers()]
            except BackendUnavailable as exc:
                workers_error = str(exc)
        context = {
            "store": store,
            "store_error": store_error,
            "backend": conf.backend,
            "adaptive": adaptive,
            "worker_capacity": conf.shedding.worker_capacity,
            "workers": workers,
            "workers_error": workers_error,
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            path("effective/", view(self.effective_policy_view), name="ratelimits_effective_policy"),
            path("limits/", view(self.limits_in_force_view), name="ratelimits_limits_in_force"),
            path("subjects/", view(subject_suggestions_view), name="ratelimits_subject_suggestions"),
            path("usage/", view(usage_report_view(self)), name="ratelimits_usage_report"),
            *super().get_urls(),
        ]

    def limits_in_force_view(self, request: HttpRequest) -> HttpResponse:
        """Every limit the policy source enforces, wherever it is set: read-only, with where to change it.

        With the settings source, the only place the admin shows what is enforced; with the
        database source, also the limits that stay in the settings (the backstops), and the
        tables' rows as they were loaded.
        """
        if not request.user.has_perm("ratelimits.view_tier"):
            raise PermissionDenied
        source = get_policy_source()
        snapshot = source.snapshot()
        tiers = [
            {
                "tier": name,
                "policy": policy.name,
                "description": policy.describe(),
                "algorithm": policy.algorithm.value,
                "fail_mode": policy.fail_mode.value,
                "shadow": policy.shadow,
                "origin": snapshot.tier_origins[name].detail if name in snapshot.tier_origins else "",
                "default_for": ", ".join(kind for kind, a in snapshot.default_tiers.items() if a.tier == name),
            }
            for name, policies in sorted(snapshot.tiers.items())
            for policy in policies
        ]
        endpoints = [
            {
                "endpoint": key,
                "cost": rule.cost if rule.max_cost is None else f"{rule.cost} (trued up to {rule.max_cost})",
                "priority": rule.priority.value,
                "counts": rule.counts.description,
                "per_caller": rule.per_caller.describe() if rule.per_caller else "",
                "endpoint_wide": rule.endpoint_wide.describe() if rule.endpoint_wide else "",
                "exempt": rule.exempt,
                "origin": (rule.per_caller_from or rule.origin).detail,
            }
            for key, rule in sorted(snapshot.endpoints.items())
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Limits in force",
            "source": conf.policies.source,
            "database": isinstance(source, DatabasePolicySource),
            "tiers": tiers,
            "defaults": [(kind, a.tier, a.origin.detail) for kind, a in snapshot.default_tiers.items()],
            "endpoints": endpoints,
            "dimensions": [
                (kind.value, policy.describe(), origin.detail) for kind, (policy, origin) in snapshot.dimensions.items()
            ],
            "fleet": [(priority.value, check.policy.rate.limit) for priority, check in snapshot.fleet.items()],
            "fleet_origin": snapshot.fleet_origin.detail,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/ratelimits/limits_in_force.html", context)

    def effective_policy_view(self, request: HttpRequest) -> HttpResponse:
        """Which checks apply to a subject on an endpoint, where each value comes from, what is left."""
        if not request.user.has_perm("ratelimits.view_tier"):
            raise PermissionDenied
        form = EffectivePolicyForm(request.POST if request.method == "POST" else request.GET or None)
        rows: list[dict[str, Any]] = []
        degraded = False
        notes: list[str] = []
        subjects: list[tuple[str, str]] = []
        ip_unknown = False
        if form.is_bound and form.is_valid():
            caller = form.caller()
            identity = caller.identity
            subjects = [(s.kind.label, s.value) for s in identity.subjects() if s.kind is not SubjectKind.ENDPOINT]
            ip_unknown = identity.ip.value == "unknown"
            if request.method == "POST" and "reset" in request.POST:
                if not request.user.has_perm("ratelimits.change_tier"):
                    raise PermissionDenied
                self._reset(request, caller)
            limits = effective_limits(caller.request, caller.identity)
            degraded = limits.degraded
            notes = form.notes(caller)
            if any(entry.region_share for entry in limits.checks):
                notes.append(_reconciliation_note())
            for entry in limits.checks:
                policy = entry.check.policy
                rows.append(
                    {
                        "policy": policy.name,
                        "description": policy.describe(),
                        "subject": entry.check.subject.kind,
                        "cost": entry.check.cost,
                        "origin": entry.origin,
                        "shadow": policy.shadow,
                        "fail_mode": policy.fail_mode,
                        "limit": entry.limit,
                        "remaining": entry.peek.remaining if entry.peek else None,
                        "reset_seconds": entry.peek.reset_after_seconds if entry.peek else None,
                        "region_share": _region_note(entry.region_share) if entry.region_share else "",
                    }
                )
        context = {
            **self.admin_site.each_context(request),
            "title": "Effective policy",
            "form": form,
            "rows": rows,
            "degraded": degraded,
            "notes": notes,
            "subjects": subjects,
            "ip_unknown": ip_unknown,
            "submitted": form.is_bound and form.is_valid(),
            "can_reset": request.user.has_perm("ratelimits.change_tier"),
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/ratelimits/effective_policy.html", context)

    def _reset(self, request: HttpRequest, caller: Caller) -> None:
        """Clear the subject's own counters (not the endpoint's or the fleet's, which every caller shares)."""
        source = get_policy_source()
        shared = (SubjectKind.ENDPOINT, SubjectKind.FLEET)
        resolved = source.checks_for(caller.request, caller.identity)
        own = [shard for c in resolved if c.subject.kind not in shared for shard in every_shard(c)]
        subject = caller.identity.caller
        try:
            get_backend().clear(own)
        except BackendUnavailable as exc:
            self.message_user(
                request, f"Counters not reset: the limiter's store is unavailable ({exc}).", messages.ERROR
            )
            return
        record_reset(subject, own, actor=request.user, reason="reset from the effective policy page")
        self.message_user(request, f"Counters reset for {subject.kind} {subject.value}.", messages.SUCCESS)


class _ReadOnly:
    """An admin of rows the app writes: listed and read, never added or changed by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(AuditEntry)
class AuditEntryAdmin(_ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("at", "actor", "action", "model", "object_repr", "reason")
    list_filter = ("action", "model")
    search_fields = ("object_repr", "reason", "object_id")
    date_hierarchy = "at"
    readonly_fields = ("at", "actor", "action", "model", "object_id", "object_repr", "before", "after", "reason")

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("subject_kind", "subject_id", "url", "enabled", "created_at")
    list_filter = ("enabled", "subject_kind")
    search_fields = ("subject_id", "url", "description")
    fields = (("subject_kind", "subject_id"), "url", "secret", "enabled", "description")

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if db_field.name == "url":
            kwargs["assume_scheme"] = "https"  # a URL typed without its scheme is sent over TLS
        return super().formfield_for_dbfield(db_field, request, **kwargs)


class DeliveryInline(_ReadOnly, admin.TabularInline):  # type: ignore[type-arg]
    model = Delivery
    fields = ("endpoint", "state", "attempts", "last_status", "last_error", "next_attempt_at", "delivered_at")
    readonly_fields = fields
    extra = 0
    show_change_link = True


@admin.register(Notice)
class NoticeAdmin(_ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("created_at", "kind", "subject_kind", "subject_id", "policy", "threshold", "used", "limit", "sent")
    list_filter = ("kind", "subject_kind", "threshold")
    search_fields = ("subject_id", "policy")
    date_hierarchy = "created_at"
    inlines = (DeliveryInline,)

    @admin.display(description="delivered")
    def sent(self, obj: Notice) -> str:
        states = [delivery.state for delivery in obj.deliveries.all()]
        return f"{states.count('delivered')} of {len(states)}" if states else "no webhook"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Notice]:
        return super().get_queryset(request).prefetch_related("deliveries")


class DeliveryAttemptInline(_ReadOnly, admin.TabularInline):  # type: ignore[type-arg]
    model = DeliveryAttempt
    fields = ("at", "status", "error", "took_ms")
    readonly_fields = fields
    extra = 0
    verbose_name_plural = "log: each attempt"


@admin.register(Delivery)
class DeliveryAdmin(_ReadOnly, admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("notice", "endpoint", "state", "attempts", "last_status", "next_attempt_at", "delivered_at")
    list_filter = ("state",)
    search_fields = ("notice__subject_id", "endpoint__url")
    list_select_related = ("notice", "endpoint")
    inlines = (DeliveryAttemptInline,)
    actions = ("send_again",)

    @admin.action(description="Send the selected deliveries again now", permissions=["send_again"])
    def send_again(self, request: HttpRequest, queryset: QuerySet[Delivery]) -> None:
        now = timezone.now()
        # Not one a sender holds now: it would be sent twice. Retried for RETRY_FOR from now.
        free = queryset.filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        count = free.update(state="pending", next_attempt_at=now, retry_from=now)
        self.message_user(request, f"{count} deliveries will be sent on the next sweep.", messages.SUCCESS)

    def has_send_again_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("ratelimits.change_delivery"))

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


class EffectivePolicyForm(forms.Form):
    """Pick a subject (any of its identities) and an endpoint."""

    api_key = forms.CharField(required=False, label="API key", help_text='The API key identity, e.g. "ApiKey:3".')
    user = forms.CharField(required=False, help_text="A user id.")
    org = forms.CharField(required=False, label="Organisation")
    ip = forms.CharField(required=False, label="Client IP")
    endpoint = forms.CharField(validators=[validate_endpoint], help_text="throttle_scope or route name")
    method = forms.ChoiceField(choices=[(m, m) for m in HTTP_METHODS], initial="GET")

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

    def caller(self) -> Caller:
        """The request and identity of the subject the form names, as its own requests would have them."""
        data = self.cleaned_data
        return stand_in(
            endpoint=data["endpoint"],
            method=data["method"],
            api_key=data["api_key"].strip(),
            user=data["user"],
            org=data["org"].strip(),
            ip=data["ip"],
        )

    def notes(self, caller: Caller) -> list[str]:
        """What the page cannot know about the subject, in words."""
        api_key = self.cleaned_data["api_key"].strip()
        if api_key and caller.credential is None and conf.identity.api_key_model is not None:
            model = conf.identity.api_key_model._meta.label
            return [
                f"No {model} has the identity {api_key!r}: RATELIMITS['POLICIES']['TIER_FUNC'] and "
                "RATELIMITS['IDENTITY']['ORGANIZATION_FUNC'] saw no credential. "
                "A request made with the key may be placed differently."
            ]
        return []


def _region_note(share: RegionShare) -> str:
    """``"global: region eu holds 42% (burst 42), reconciled 2026-12-01 12:00:01 UTC"``."""
    when = f"reconciled {share.reconciled_at:%Y-%m-%d %H:%M:%S} UTC" if share.reconciled_at else "never reconciled"
    return f"global: region {share.region or '-'} holds {share.share:.0%} (burst {share.capacity}), {when}"


def _reconciliation_note() -> str:
    """The last reconciliation round this region's store heard of, in words."""
    try:
        backend = get_backend()
        status = backend.last_reconciliation() if isinstance(backend, RegionSupport) else None
    except BackendUnavailable:
        return "The last reconciliation round is not known: the store could not be read."
    if not status:
        return "No reconciliation round has reached this region yet: each region holds an even split."
    unreachable = ", ".join(status.get("unreachable") or []) or "none"
    return (
        f"Last reconciliation round: {status.get('at')}, {status.get('subjects')} global subjects, "
        f"{status.get('written')} shares written; regions out of reach: {unreachable}."
    )


def _moment(timestamp: object) -> Any:
    """A Unix time a worker published, as an aware datetime (``None`` if it is none)."""
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
        return None
    return datetime.fromtimestamp(timestamp, tz=UTC)
