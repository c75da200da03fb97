"""Expired overrides and assignments: they stop applying on their own; this tidies them away."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from ..models import Override, SubjectAssignment
from .audit import audit_context

__all__ = ["expire_policies"]


def expire_policies() -> int:
    """Delete overrides and subject assignments whose expiry has passed; audited, one transaction."""
    now = timezone.now()
    with transaction.atomic(), audit_context(reason="expired"):
        removed = 0
        for model in (Override, SubjectAssignment):
            for row in model.objects.filter(expires_at__lte=now):
                row.delete()
                removed += 1
    return removed
