"""factory-boy factories for the demo models."""

from __future__ import annotations

import factory

from project.payments.models import ApiKey, hash_key


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
