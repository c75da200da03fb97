"""Demo models: API keys on tiers, customers and charges."""

from __future__ import annotations

import hashlib
import secrets

from django.db import models


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiKey(models.Model):
    """A secret key that authenticates an integrator. Only its hash is stored."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="First characters of the key, to recognise it.")
    key_hash = models.CharField(max_length=64, unique=True)
    tier = models.CharField(max_length=50, default="free")
    organization = models.CharField(max_length=100, blank=True)
    is_active = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…, {self.tier})"

    @classmethod
    def issue(cls, name: str, tier: str, organization: str = "", raw: str | None = None) -> tuple[ApiKey, str]:
        """Create a key and return it with its raw secret (shown once)."""
        raw = raw or f"sk_{tier}_{secrets.token_urlsafe(18)}"
        key = cls.objects.create(
            name=name, prefix=raw[:12], key_hash=hash_key(raw), tier=tier, organization=organization
        )
        return key, raw


class Customer(models.Model):
    owner = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="customers")
    email = models.EmailField()
    created = models.DateTimeField(auto_now_add=True)


class Charge(models.Model):
    owner = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="charges")
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3, default="eur")
    created = models.DateTimeField(auto_now_add=True)
