"""The audit trail of policy changes, written in the same transaction as the change itself.

Who and why come from :func:`audit_context` (the admin, the management commands and the import
set it); the before and after values from the database. Every committed change also bumps the
policy version stamp, so workers reload their policies on their next request.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.db.models.signals import post_delete, post_save, pre_save
from django.forms.models import model_to_dict

__all__ = ["audit_context", "connect", "record", "record_bulk_update", "snapshot"]


@dataclass(frozen=True)
class _Context:
    actor: Any = None
    reason: str = ""


# _Context is frozen, so sharing one default instance is safe.
_context: contextvars.ContextVar[_Context] = contextvars.ContextVar("ratelimits_audit", default=_Context())  # noqa: B039


@contextlib.contextmanager
def audit_context(actor: Any = None, reason: str = "") -> Iterator[None]:
    """Attribute every policy change made inside the block to ``actor``, for ``reason``."""
    token = _context.set(_Context(actor if getattr(actor, "pk", None) is not None else None, reason))
    try:
        yield
    finally:
        _context.reset(token)


def snapshot(instance: models.Model) -> dict[str, Any]:
    """The instance's field values as JSON-safe data (what ``before`` and ``after`` store)."""
    data = model_to_dict(instance, fields=[f.name for f in instance._meta.concrete_fields])
    return json.loads(json.dumps(data, cls=DjangoJSONEncoder))  # type: ignore[no-any-return]


def record(
    instance: models.Model,
    action: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    *,
    reason: str = "",
) -> None:
    """Write one audit entry and schedule the version bump for when the transaction commits."""
    from .models import AuditEntry

    context = _context.get()
    AuditEntry.objects.using(instance._state.db or "default").create(
        actor=context.actor,
        action=action,
        model=instance._meta.label,
        object_id=str(instance.pk),
        object_repr=str(instance)[:300],
        before=before,
        after=after,
        reason=reason or context.reason or getattr(instance, "reason", "") or "",
    )
    _bump_on_commit(instance._state.db or "default")


def record_bulk_update(model: type[models.Model], before: Iterable[models.Model], changes: dict[str, Any]) -> None:
    """Audit a queryset ``update()``: one entry per row, with the values it had and now has."""
    rows = list(before)
    if not rows:
        return
    fresh = {obj.pk: obj for obj in model._default_manager.filter(pk__in=[r.pk for r in rows])}
    for old in rows:
        new = fresh.get(old.pk)
        if new is not None:
            record(new, "changed", snapshot(old), snapshot(new))


def _bump_on_commit(using: str) -> None:
    """Raise the policy version once per transaction, and publish it when the transaction commits.

    However many rows a transaction changes (an import changes many), the version moves once.
    A pending publication survives whenever this change does: rolling back a savepoint discards
    the callbacks registered inside it, and any savepoint still open now encloses this change too.
    """
    from .models import PolicyVersion
    from .sources import bump_policy_version

    connection = transaction.get_connection(using)
    if connection.in_atomic_block and any(entry[1] is bump_policy_version for entry in connection.run_on_commit):
        return
    PolicyVersion.advance(using)
    transaction.on_commit(bump_policy_version, using=using)


def _before_save(sender: type[models.Model], instance: models.Model, raw: bool = False, **kwargs: Any) -> None:
    if raw or instance.pk is None:
        instance._ratelimits_before = None  # type: ignore[attr-defined]
        return
    old = sender._default_manager.filter(pk=instance.pk).first()
    instance._ratelimits_before = snapshot(old) if old is not None else None  # type: ignore[attr-defined]


def _after_save(
    sender: type[models.Model], instance: models.Model, created: bool, raw: bool = False, **kwargs: Any
) -> None:
    if raw:
        return
    before = getattr(instance, "_ratelimits_before", None)
    record(instance, "created" if created or before is None else "changed", before, snapshot(instance))


def _after_delete(sender: type[models.Model], instance: models.Model, **kwargs: Any) -> None:
    record(instance, "deleted", snapshot(instance), None)


def _audited() -> tuple[type[models.Model], ...]:
    from .models import EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier

    return (Tier, SubjectAssignment, EndpointPolicy, Override, FleetSettings)


def connect() -> None:
    """Connect the audit signals (called from ``AppConfig.ready``)."""
    for model in _audited():
        uid = f"ratelimits.audit.{model.__name__}"
        pre_save.connect(_before_save, sender=model, dispatch_uid=f"{uid}.pre_save")
        post_save.connect(_after_save, sender=model, dispatch_uid=f"{uid}.post_save")
        post_delete.connect(_after_delete, sender=model, dispatch_uid=f"{uid}.post_delete")
