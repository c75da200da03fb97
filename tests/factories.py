"""factory-boy factories for the demo models."""

from __future__ import annotations

from datetime import timedelta

import factory
from django.utils import timezone

from project.payments.models import ApiKey, hash_key
from ratelimits.models import (
    AuditEntry,
    EndpointPolicy,
    FleetSettings,
    Override,
    PolicyVersion,
    SubjectAssignment,
    Tier,
)


class ApiKeyFactory(factory.django.DjangoModelFactory):
    """An API key; pass ``raw="sk_..."`` to know the secret to send."""

    class Meta:
        model = ApiKey

    class Params:
        raw = factory.Sequence(lambda n: f"sk_test_{n:08d}")

    name = factory.Sequence(lambda n: f"integrator {n}")
    prefix = factory.LazyAttribute(lambda o: o.raw[:12])
    key_hash = factory.LazyAttribute(lambda o: hash_key(o.raw))
    tier = "free"
    organization = ""


# -- ratelimits' policy models -------------------------------------------------------------------


class UserFactory(factory.django.DjangoModelFactory):
    """A staff user: the actor of audited changes, or an authenticated caller."""

    class Meta:
        model = "auth.User"

    username = factory.Sequence(lambda n: f"operator{n}")
    is_staff = True


class TierFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tier

    name = factory.Sequence(lambda n: f"tier-{n}")
    rate = "10/s"


class SubjectAssignmentFactory(factory.django.DjangoModelFactory):
    """Puts an API key (by default) on a tier; ``subject_id`` is the identity value, e.g. ``ApiKey:7``."""

    class Meta:
        model = SubjectAssignment

    subject_kind = "api_key"
    subject_id = factory.Sequence(lambda n: f"ApiKey:{900_000 + n}")
    tier = factory.SubFactory(TierFactory)


class EndpointPolicyFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = EndpointPolicy

    endpoint = factory.Sequence(lambda n: f"endpoint-{n}")


class OverrideFactory(factory.django.DjangoModelFactory):
    """A replacement rate for one API key until tomorrow."""

    class Meta:
        model = Override

    subject_kind = "api_key"
    subject_id = factory.Sequence(lambda n: f"ApiKey:{800_000 + n}")
    rate = "1000/s"
    reason = factory.Sequence(lambda n: f"ticket #{n}: load test")
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(days=1))


class FleetSettingsFactory(factory.django.DjangoModelFactory):
    """The singleton row (pk=1, seeded by the migration): fetched or created, then given what is passed.

    Declares no defaults of its own, so only the values passed are applied to an existing row
    (through ``save()``, so the change is audited like an admin edit).
    """

    class Meta:
        model = FleetSettings
        django_get_or_create = ("id",)

    id = 1

    @classmethod
    def _create(cls, model_class: type[FleetSettings], *args: object, **kwargs: object) -> FleetSettings:
        wanted = {k: v for k, v in kwargs.items() if k != "id"}
        instance = super()._create(model_class, *args, **kwargs)
        if any(getattr(instance, k) != v for k, v in wanted.items()):
            for name, value in wanted.items():
                setattr(instance, name, value)
            instance.save()
        return instance


class AuditEntryFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = AuditEntry

    action = "changed"
    model = "ratelimits.Tier"
    object_id = factory.Sequence(str)
    object_repr = factory.Sequence(lambda n: f"tier-{n}")
    before = factory.LazyFunction(lambda: {"rate": "10/s"})
    after = factory.LazyFunction(lambda: {"rate": "20/s"})
    reason = "factory"


class PolicyVersionFactory(factory.django.DjangoModelFactory):
    """The one policy version row (pk 1), at a given value."""

    class Meta:
        model = PolicyVersion
        django_get_or_create = ("id",)

    id = 1
    value = 0
