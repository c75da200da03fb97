"""Create the demo's API keys, endpoint policies, an override and an admin user (idempotent)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.utils import timezone

from project.payments.models import ApiKey, Customer, hash_key
from ratelimits.conf import conf
from ratelimits.models import EndpointPolicy, FleetSettings, Override, Tier
from ratelimits.store.audit import audit_context

# Fixed secrets so the README's curl lines work on every machine. Demo only.
DEMO_KEYS = [
    ("Acme (free tier)", "free", "acme", "sk_free_demo_acme_0000000000"),
    ("Globex (standard tier)", "standard", "globex", "sk_std_demo_globex_000000000"),
]
ENDPOINTS = [
    {"endpoint": "charges", "method": "POST", "cost": 1, "priority": "critical"},
    {"endpoint": "customers", "method": "ANY", "cost": 1, "priority": "normal"},
    {
        "endpoint": "reports.export",
        "method": "ANY",
        "cost": 10,
        "priority": "low",
        "per_caller_rate": "600/m",
        "endpoint_rate": "6000/m",
    },
    # GET /v1/rate_limit is limited by this alone: asking what is left spends none of the caller's.
    {"endpoint": "rate_limit", "method": "ANY", "per_caller_rate": "60/m", "per_caller_burst": 20},
]
ADMIN = ("admin", "admin")


class Command(BaseCommand):
    help = "Create the demo API keys, endpoint policies, one override and an admin login, then print them."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="Where the demo is served (for the banner).")

    def handle(self, *args: Any, **options: Any) -> None:
        with audit_context(reason="demo seed"):
            keys = [self._key(*spec) for spec in DEMO_KEYS]
            for spec in ENDPOINTS:
                if not EndpointPolicy.objects.filter(endpoint=spec["endpoint"], method=spec["method"]).exists():
                    EndpointPolicy.objects.create(**spec)
            # Small numbers, so one terminal can show the limiters at work: a free key may run two
            # requests at once, and the "fleet" (this one server) sheds exports above 3 in flight.
            free = Tier.objects.get(name="free")
            if free.concurrency is None:
                free.concurrency = 2
                free.save()
            fleet = FleetSettings.load()
            if fleet.capacity is None:
                fleet.capacity = 6
                fleet.save()
            acme = keys[0]
            if not Override.objects.filter(subject_id=f"ApiKey:{acme.pk}").exists():
                Override.objects.create(
                    subject_kind="api_key",
                    subject_id=f"ApiKey:{acme.pk}",
                    endpoint="customers",
                    rate="2/s",
                    burst=5,
                    reason="Demo: Acme's customer listing is held to 2/s while they fix a polling loop.",
                    expires_at=timezone.now() + timedelta(days=30),
                )
        user_model = get_user_model()
        if not user_model.objects.filter(username=ADMIN[0]).exists():
            user_model.objects.create_superuser(ADMIN[0], "admin@example.com", ADMIN[1])
        for key, (name, tier, _, raw) in zip(keys, DEMO_KEYS, strict=True):
            self.stdout.write(f"  {tier:<8} {raw}   ({name}, subject api_key ApiKey:{key.pk})")
        url = str(options["url"]).rstrip("/")
        self.stdout.write(f"  demo     {url}/  (keys, endpoints with curl lines, links to the admin and the docs)")
        self.stdout.write(f"  admin    {url}/admin/  user {ADMIN[0]} / password {ADMIN[1]}")
        where = conf.redis.address[0] if conf.backend == "redis" else "in-process, this server only"
        self.stdout.write(f"  rate limiting backend: {conf.backend} ({where})")
        self.stdout.write(f"  database: {settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}")
        broker = getattr(settings, "CELERY_BROKER_URL", "")
        if broker:
            self.stdout.write(f"  usage reports: drained by Celery ({broker}); run a worker with beat")
        else:
            self.stdout.write("  usage reports: no CELERY_BROKER_URL, drained in this process every 30 s")

    def _key(self, name: str, tier: str, org: str, raw: str) -> ApiKey:
        key = ApiKey.objects.filter(key_hash=hash_key(raw)).first()
        if key is None:
            key, _ = ApiKey.issue(name=name, tier=tier, organization=org, raw=raw)
            Customer.objects.bulk_create(Customer(owner=key, email=f"c{i}@{org}.example") for i in range(3))
        return key
