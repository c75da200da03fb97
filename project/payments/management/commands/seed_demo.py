"""Create the demo's API keys (idempotent) and print them."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from project.payments.models import ApiKey, Customer

# Fixed secrets so the README's curl lines work on every machine. Demo only.
DEMO_KEYS = [
    ("Acme (free tier)", "free", "acme", "sk_free_demo_acme_0000000000"),
    ("Globex (pro tier)", "pro", "globex", "sk_pro_demo_globex_000000000"),
]


class Command(BaseCommand):
    help = "Create the demo API keys and customers, then print the keys."

    def handle(self, *args: Any, **options: Any) -> None:
        from django.conf import settings

        from project.payments.models import hash_key

        for name, tier, org, raw in DEMO_KEYS:
            key = ApiKey.objects.filter(key_hash=hash_key(raw)).first()
            if key is None:
                key, _ = ApiKey.issue(name=name, tier=tier, organization=org, raw=raw)
                Customer.objects.bulk_create(Customer(owner=key, email=f"c{i}@{org}.example") for i in range(3))
            self.stdout.write(f"  {tier:<5} {raw}   ({name})")
        backend = settings.RATELIMITS.get("BACKEND")
        where = settings.RATELIMITS.get("REDIS_URL") if backend == "redis" else "in-process, this server only"
        self.stdout.write(f"  rate limiting backend: {backend} ({where})")
        self.stdout.write(f"  database: {settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}")
