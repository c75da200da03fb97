"""The demo's landing page (``/``) and its documentation site (``/docs/``, as ``make docs`` built it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views import static

from project.payments.management.commands.seed_demo import ADMIN, DEMO_KEYS
from project.payments.models import ApiKey, hash_key
from ratelimits.conf import conf
from ratelimits.engine import get_policy_source
from ratelimits.models import Override

DOCS = Path(settings.BASE_DIR) / "docs"


@dataclass(frozen=True)
class Endpoint:
    """One endpoint of the demo API, with the policy it is under right now and a curl line to try it."""

    method: str
    path: str
    scope: str
    what: str
    curl: str
    priority: str = ""
    cost: int = 0
    #: The endpoint's own limits, per caller and for everyone.
    limits: tuple[str, ...] = ()


def _endpoints(base: str, key: str) -> list[Endpoint]:
    auth = f'-H "Authorization: Bearer {key}"'
    listed = [
        Endpoint(
            "POST",
            "/v1/charges",
            "charges",
            "create a charge",
            f"curl -i -X POST {auth} -d amount=500 {base}/v1/charges",
        ),
        Endpoint("GET", "/v1/customers", "customers", "list customers", f"curl -i {auth} {base}/v1/customers"),
        Endpoint(
            "POST",
            "/v1/reports/export",
            "reports.export",
            "export a report (slow: 0.5 s)",
            f"curl -i -X POST {auth} {base}/v1/reports/export",
        ),
        Endpoint(
            "GET",
            "/v1/rate_limit",
            "rate_limit",
            "your limits on an endpoint, what is left; spends none of them, it has a limit of its own",
            f'curl -s {auth} "{base}/v1/rate_limit?endpoint=charges&method=POST"',
        ),
    ]
    source = get_policy_source()
    rules = [source.endpoint_rule(e.scope, e.method) for e in listed]  # as the admin has them now
    return [
        *(
            replace(
                e,
                priority=rule.priority,
                cost=rule.cost,
                limits=tuple(
                    f"{who}: {policy.describe()}"
                    for who, policy in (("per caller", rule.per_caller), ("all callers", rule.endpoint_wide))
                    if policy is not None
                ),
            )
            for e, rule in zip(listed, rules, strict=True)
        ),
        Endpoint(
            "GET",
            "/v1/usage",
            "usage",
            "your own usage, drained every 30 s",
            f'curl -s {auth} "{base}/v1/usage?granularity=minute"',
        ),
    ]


def landing(request: HttpRequest) -> HttpResponse:
    """What a newcomer sees after ``make demo``: the keys, every endpoint with a curl line, the admin, the docs."""
    base = request.build_absolute_uri("/").rstrip("/")
    keys = []
    for name, tier, organization, raw in DEMO_KEYS:
        stored = ApiKey.objects.filter(key_hash=hash_key(raw)).first()
        keys.append(
            {
                "name": name,
                "tier": stored.tier if stored else tier,
                "organization": organization,
                "raw": raw,
                "subject": f"ApiKey:{stored.pk}" if stored else None,
            }
        )
    first = keys[0]["raw"]
    override = Override.objects.filter(
        subject_kind="api_key", subject_id=keys[0]["subject"] or "", endpoint="customers", enabled=True
    ).first()
    context = {
        "keys": keys,
        "endpoints": _endpoints(base, first),
        "override": override.describe() if override is not None else None,
        "admin_user": ADMIN,
        "backend": conf.backend,
        "redis_url": conf.redis.address[0] if conf.backend == "redis" else None,
        "broker": getattr(settings, "CELERY_BROKER_URL", ""),
        "admin_links": [
            ("Tiers", reverse("admin:ratelimits_tier_changelist")),
            ("Endpoint policies", reverse("admin:ratelimits_endpointpolicy_changelist")),
            ("Overrides", reverse("admin:ratelimits_override_changelist")),
            (
                "Effective policy of Acme's key on customers",
                f"{reverse('admin:ratelimits_effective_policy')}?api_key={keys[0]['subject'] or ''}"
                "&endpoint=customers&method=GET",
            ),
            ("Usage report", reverse("admin:ratelimits_usage_report")),
            ("Audit trail", reverse("admin:ratelimits_auditentry_changelist")),
        ],
        "docs_site": reverse("demo-docs", args=[""]),
        "docs_built": _built_site() is not None,
        "docs": [
            (path.stem, reverse("demo-docs", args=[f"{path.stem}.html"]), _title(path))
            for path in sorted(DOCS.glob("*.md"))
            if path.stem != "index"
        ],
    }
    return render(request, "index.html", context)


def docs(request: HttpRequest, path: str) -> HttpResponse:
    """A file of the documentation site ``make docs`` built, or a page saying how to build it.

    Django's static serving is enough for a demo, and refuses paths outside the site.
    """
    site = _built_site()
    if site is None:
        return render(request, "docs_not_built.html", {"site": settings.DOCS_SITE}, status=404)
    if path == "" or path.endswith("/"):
        path += "index.html"
    return static.serve(request, path, document_root=site)


def _built_site() -> Path | None:
    """The directory ``make docs`` built the site into (``settings.DOCS_SITE``), or None before it has."""
    site = Path(settings.DOCS_SITE)
    return site if (site / "index.html").is_file() else None


def _title(path: Path) -> str:
    first = path.read_text(encoding="utf-8").split("\n", 1)[0]
    return first.lstrip("# ").strip() or path.stem
