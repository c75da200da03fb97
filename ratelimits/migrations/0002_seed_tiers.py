"""Seed sensible tiers and the fleet settings row.

100 requests per second per key is the standard limit; anonymous callers get a tenth of it.
Uses historical models, so no audit entries or version bumps: there is nothing to notify yet.
"""

from typing import Any

from django.db import migrations

TIERS = [
    ("anonymous", "10/s", 20, "", "Callers without credentials, limited per client IP."),
    ("free", "25/s", 50, "100000/d", "Authenticated callers without a paid plan."),
    ("standard", "100/s", 200, "", "The standard limit: 100 requests per second per key."),
    ("enterprise", "1000/s", 2000, "", "Large integrators, by contract."),
]


def seed(apps: Any, schema_editor: Any) -> None:
    Tier = apps.get_model("ratelimits", "Tier")
    FleetSettings = apps.get_model("ratelimits", "FleetSettings")
    db = schema_editor.connection.alias
    tiers = {}
    # No concurrency limits by default: how many requests in flight a caller may hold depends on
    # how slow the endpoints are, which only the operator knows.
    for name, rate, burst, quota, description in TIERS:
        tiers[name], _ = Tier.objects.using(db).get_or_create(
            name=name,
            defaults={"rate": rate, "burst": burst, "quota": quota, "description": description},
        )
    FleetSettings.objects.using(db).get_or_create(
        pk=1, defaults={"anonymous_tier": tiers["anonymous"], "authenticated_tier": tiers["standard"]}
    )


def unseed(apps: Any, schema_editor: Any) -> None:
    apps.get_model("ratelimits", "FleetSettings").objects.using(schema_editor.connection.alias).filter(pk=1).delete()


class Migration(migrations.Migration):
    dependencies = [("ratelimits", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
