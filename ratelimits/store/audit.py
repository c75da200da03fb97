"""The audit trail of policy changes and counter resets, written in the same transaction as the change.

Who and why come from :func:`audit_context` (the admin, the management commands and the import
set it); the before and after values from the database. Every committed change also raises the
policy version (:mod:`.versioning`), so workers reload their policies on their next request.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models.signals import post_delete, post_save, pre_save
from django.forms.models import model_to_dict

from ..identity import Subject
from ..models import AuditEntry, EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier, rows_updated
from ..policies.values import Check
from .versioning import advance_on_commit

__all__ = ["AUDITED", "audit_context", "connect", "record", "record_bulk_update", "record_reset", "snapshot"]

#: The policy models whose every change is audited.
AUDITED: tuple[type[models.Model], ...] = (Tier, SubjectAssignment, EndpointPolicy, Override, FleetSettings)


@dataclass(frozen=True)
class _Context:
    actor: Any = None
    reason: str = ""


# _Context is frozen, so sharing one default instance is safe.
_context: contextvars.ContextVar[_Context] = contextvars.ContextVar("ratelimits_audit", default=_Context())  # noqa: B039


@contextlib.contextmanager
def audit_context(actor: Any = None, reason: str = "") -> Iterator[None]:
    """Attribute every policy change made inside the block to ``actor``, for ``reason``."""
    token = _context.set(_Context(_user(actor), reason))
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
    context = _context.get()
    using = instance._state.db or "default"
    AuditEntry.objects.using(using).create(
        actor=context.actor,
        action=action,
        model=instance._meta.label,
        object_id=str(instance.pk),
        object_repr=str(instance)[:300],
        before=before,
        after=after,
        reason=reason or context.reason or getattr(instance, "reason", "") or "",
    )
    advance_on_commit(using)


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


def record_reset(subject: Subject, checks: Sequence[Check], *, actor: Any = None, reason: str) -> AuditEntry:
    """Audit that the counters of ``checks`` (a subject's own) were cleared in the limiter's store."""
    return AuditEntry.objects.create(
        actor=_user(actor) or _context.get().actor,
        action="reset",
        model="ratelimits.counters",
        object_id=f"{subject.kind}:{subject.value}"[:100],
        object_repr=f"counters of {subject.kind} {subject.value}"[:300],
        after={
            "policies": sorted({c.policy.name for c in checks}),
            "subjects": sorted({str(c.subject.kind) for c in checks}),
        },
        reason=reason,
    )


def _user(actor: Any) -> Any:
    """``actor`` if it is a saved user (an anonymous user or a bare object is nobody)."""
    return actor if getattr(actor, "pk", None) is not None else None


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


def _after_bulk_update(
    sender: type[models.Model], before: list[models.Model], changes: dict[str, Any], **kwargs: Any
) -> None:
    record_bulk_update(sender, before, changes)


def connect() -> None:
    """Connect the audit signals (called from ``AppConfig.ready``)."""
    for model in AUDITED:
        uid = f"ratelimits.audit.{model.__name__}"
        pre_save.connect(_before_save, sender=model, dispatch_uid=f"{uid}.pre_save")
        post_save.connect(_after_save, sender=model, dispatch_uid=f"{uid}.post_save")
        post_delete.connect(_after_delete, sender=model, dispatch_uid=f"{uid}.post_delete")
        rows_updated.connect(_after_bulk_update, sender=model, dispatch_uid=f"{uid}.rows_updated")
