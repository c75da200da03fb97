"""Move policies between environments: a versioned JSON document, exported and imported by natural keys.

The document::

    {"format": "ratelimits-policies", "version": 1,
     "tiers": [...], "assignments": [...], "endpoints": [...], "overrides": [...], "fleet": {...}}

Rows are identified by natural keys, never by primary key: a tier by its name, an endpoint policy
by endpoint and method, an assignment by subject, tier and start, an override by subject, endpoint
and expiry. Tiers are referred to by name. Datetimes are ISO 8601 in UTC, multipliers strings.

An import is validated as a whole before anything stays written: every item's fields first (each
model's field validation, without touching the database), then, inside one transaction, the rows
are written and every created or changed row gets its model's ``full_clean()`` against the
resulting state, so a guardrail that compares rows (a tier's capacity against endpoint costs)
sees the policies as they will be. Any error rolls the whole import back. A dry run goes through
the same steps and always rolls back.

A document is read with :func:`load_document`, which refuses one larger than ``POLICIES['IMPORT_MAX_SIZE']``
before reading it and one nested deeper than :data:`MAX_DEPTH` before parsing it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import stat
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import accumulate
from typing import IO, Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, models, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ..conf import SIZE_UNITS, Policies, conf
from ..models import EndpointPolicy, FleetSettings, Override, SubjectAssignment, Tier, expired, validate_subject
from .audit import audit_context

__all__ = [
    "FORMAT",
    "MAX_DEPTH",
    "VERSION",
    "ImportReport",
    "PolicyImportError",
    "export_policies",
    "import_policies",
    "load_document",
]

FORMAT = "ratelimits-policies"
VERSION = 1

#: How deep a document may nest. An export nests three levels (the document, a section, an item);
#: a value of the wrong shape, a level or two more, still gets an error naming its field. Far
#: deeper is no export, and would make json's recursive parser raise RecursionError.
MAX_DEPTH = 16

#: The list sections, in the order they are applied; ``fleet`` (one object or null) comes after tiers.
SECTIONS: tuple[str, ...] = ("tiers", "assignments", "endpoints", "overrides")
_MODELS: dict[str, type[models.Model]] = {
    "tiers": Tier,
    "assignments": SubjectAssignment,
    "endpoints": EndpointPolicy,
    "overrides": Override,
    "fleet": FleetSettings,
}
_NOUNS = {
    "tiers": "tier",
    "assignments": "assignment",
    "endpoints": "endpoint policy",
    "overrides": "override",
    "fleet": "fleet settings",
}
#: Environment-specific bookkeeping, never exported.
_NOT_EXPORTED = frozenset({"id", "revision", "updated_at", "created_by", "created_at"})


class PolicyImportError(Exception):
    """The document cannot be imported; ``errors`` names each item and field at fault. Nothing was changed."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@dataclass
class ImportReport:
    """What an import changed (or, for a dry run, would change), per section."""

    dry_run: bool = False
    replace: bool = False
    created: Counter[str] = field(default_factory=Counter)
    updated: Counter[str] = field(default_factory=Counter)
    deleted: Counter[str] = field(default_factory=Counter)
    unchanged: Counter[str] = field(default_factory=Counter)
    #: One line per change, e.g. ``"update tier gold"``.
    changes: list[str] = field(default_factory=list)

    @property
    def total_created(self) -> int:
        return sum(self.created.values())

    @property
    def total_updated(self) -> int:
        return sum(self.updated.values())

    @property
    def total_deleted(self) -> int:
        return sum(self.deleted.values())

    @property
    def total_unchanged(self) -> int:
        return sum(self.unchanged.values())

    @property
    def changed(self) -> bool:
        return bool(self.total_created or self.total_updated or self.total_deleted)


# -- export --------------------------------------------------------------------------------------


def export_policies() -> dict[str, Any]:
    """Every policy row as a JSON-safe document (see the module docstring), in a stable order."""
    tiers = list(Tier.objects.all())
    assignments = list(SubjectAssignment.objects.select_related("tier"))
    endpoints = list(EndpointPolicy.objects.all())
    overrides = list(Override.objects.all())
    fleet = FleetSettings.objects.filter(pk=1).select_related("anonymous_tier", "authenticated_tier").first()
    return {
        "format": FORMAT,
        "version": VERSION,
        "tiers": [_export_row(row) for row in _ordered("tiers", tiers)],
        "assignments": [_export_row(row) for row in _ordered("assignments", assignments)],
        "endpoints": [_export_row(row) for row in _ordered("endpoints", endpoints)],
        "overrides": [_export_row(row) for row in _ordered("overrides", overrides)],
        "fleet": _export_row(fleet) if fleet is not None else None,
    }


def _fields(model: type[models.Model]) -> list[models.Field[Any, Any]]:
    return [f for f in model._meta.concrete_fields if f.name not in _NOT_EXPORTED]


def _export_row(row: models.Model, refs: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The row's exported fields; foreign keys (to tiers) by name, from ``refs`` when given."""
    data: dict[str, Any] = {}
    for f in _fields(type(row)):
        if f.is_relation:
            if refs is not None:
                data[f.name] = refs.get(f.name)
            else:
                related = getattr(row, f.name)
                data[f.name] = related.name if related is not None else None
        else:
            data[f.name] = _export_value(f, getattr(row, f.attname))
    return data


def _export_value(f: models.Field[Any, Any], value: Any) -> Any:
    if value is None:
        return None
    if isinstance(f, models.DateTimeField):
        return _format_datetime(value)
    if isinstance(f, models.DecimalField):
        places = f.decimal_places or 0
        return str(Decimal(value).quantize(Decimal(1).scaleb(-places)))
    return value


def _format_datetime(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def _ordered(section: str, rows: Iterable[models.Model]) -> list[models.Model]:
    """Rows sorted by natural key (then primary key, so duplicates keep a stable order)."""

    def sort_key(row: models.Model) -> tuple[Any, ...]:
        return (*((value is not None, value) for value in _key(section, row)), row.pk)

    return sorted(rows, key=sort_key)


def _key(section: str, row: Any, tier: str | None = None) -> tuple[Any, ...]:
    """The natural key of a row (``tier`` overrides the assignment's tier name before it is linked)."""
    if section == "tiers":
        return (row.name,)
    if section == "endpoints":
        return (row.endpoint, row.method)
    if section == "assignments":
        return (row.subject_kind, row.subject_id, tier if tier is not None else row.tier.name, row.starts_at)
    if section == "overrides":
        return (row.subject_kind, row.subject_id, row.endpoint, row.expires_at)
    return ("fleet",)


def _describe_key(section: str, key: tuple[Any, ...]) -> str:
    def text(value: Any) -> str:
        return _format_datetime(value) if isinstance(value, dt.datetime) else str(value)

    if section == "tiers":
        return str(key[0])
    if section == "endpoints":
        return str(key[0]) if key[1] == "ANY" else f"{key[1]} {key[0]}"
    if section == "assignments":
        start = f" from {text(key[3])}" if key[3] is not None else ""
        return f"{key[0]} {key[1]} -> {key[2]}{start}"
    if section == "overrides":
        scope = f" on {key[2]}" if key[2] else ""
        return f"{key[0]} {key[1]}{scope} until {text(key[3])}"
    return "fleet settings"


# -- reading a document --------------------------------------------------------------------------

#: A JSON string, escapes included (in UTF-8: no byte of a multi-byte character is ASCII).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def load_document(stream: IO[bytes], *, name: str) -> Any:
    """The JSON document in ``stream`` (called ``name`` in errors), or a :class:`PolicyImportError` saying why not.

    A document larger than ``POLICIES['IMPORT_MAX_SIZE']`` is refused before it is read: a file
    by its size, a pipe once the limit is read and one byte more. One nested deeper than
    :data:`MAX_DEPTH` is refused before it is parsed.
    """
    limit = conf.policies.import_max_size
    allowed = f"the {_describe_size(limit)} {Policies.import_max_size.field} allows"
    size = _file_size(stream)
    if size is not None and size > limit:
        raise PolicyImportError([f"{name} is {size:,} bytes, over {allowed}."])
    raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise PolicyImportError([f"{name} is over {allowed}."])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyImportError([f"{name} is not UTF-8 text: {exc}"]) from None
    if _nests_deeper(raw, MAX_DEPTH):
        raise PolicyImportError([f"{name} nests deeper than {MAX_DEPTH} levels; a ratelimits export nests 3."])
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PolicyImportError([f"{name} is not a JSON document: {exc}"]) from None


def _file_size(stream: IO[bytes]) -> int | None:
    """The size of the regular file behind ``stream``, unread; ``None`` for a pipe or a stream in memory."""
    try:
        status = os.fstat(stream.fileno())
    except (OSError, ValueError):  # no file descriptor (io.UnsupportedOperation is both)
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _nests_deeper(raw: bytes, limit: int) -> bool:
    """Whether the JSON in ``raw`` (UTF-8) opens more than ``limit`` arrays and objects inside one another.

    Counted on the bytes, before parsing, because json's parser recurses once per level and only
    the interpreter's recursion limit stops it (a RecursionError from deep inside). Strings go
    first, so brackets inside them are text; a quote left over opens a string that never ends,
    where the parser refuses the document before nesting any deeper. Every step runs in C
    (``re``, ``bytes.translate``, ``accumulate``, ``max``): 10 MB take well under a second.
    """
    outside = _STRING.sub(b"", raw).partition(b'"')[0]
    brackets = outside.translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def _describe_size(size: int) -> str:
    """``"10 MB"`` for a size that is a whole number of a unit, else its bytes."""
    for unit in ("gb", "mb", "kb"):
        if size % SIZE_UNITS[unit] == 0:
            return f"{size // SIZE_UNITS[unit]} {unit.upper()}"
    return f"{size:,} bytes"


# -- import --------------------------------------------------------------------------------------


@dataclass
class _Item:
    """One row of the document, cleaned field by field and matched to the database."""

    section: str
    label: str
    key: tuple[Any, ...]
    #: What gets saved: the matched row with the document's values applied, or a new instance.
    instance: models.Model
    #: Foreign keys to set before saving: field name to tier name (or None).
    refs: dict[str, str | None]
    action: str  # "create", "update" or "unchanged"


@dataclass
class _Plan:
    items: dict[str, list[_Item]] = field(default_factory=lambda: defaultdict(list))
    deletions: dict[str, list[models.Model]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)


class _Rollback(Exception):
    def __init__(self, errors: list[str]) -> None:
        self.errors = errors


def import_policies(
    data: dict[str, Any], *, actor: Any = None, reason: str, replace: bool = False, dry_run: bool = False
) -> ImportReport:
    """Make the policy tables match ``data``; all or nothing, every change audited for ``reason``.

    Rows in the document are created or updated (matched by natural key); with ``replace`` every
    row that is not in the document is deleted, without it such rows are left alone. With
    ``dry_run`` nothing is kept: the report says what would change. Raises
    :class:`PolicyImportError` listing every problem (``"tiers[2].rate: ..."``) if any.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise PolicyImportError(["reason: say why these policies are being imported (it goes into the audit trail)."])
    plan = _plan(data, replace=replace)
    if plan.errors:
        raise PolicyImportError(plan.errors)
    report = _report(plan, dry_run=dry_run, replace=replace)
    try:
        with audit_context(actor, reason.strip()), transaction.atomic():
            errors = _apply(plan, actor)
            if errors or dry_run:
                raise _Rollback(errors)
    except _Rollback as rollback:
        if rollback.errors:
            raise PolicyImportError(rollback.errors) from None
    return report


def _report(plan: _Plan, *, dry_run: bool, replace: bool) -> ImportReport:
    report = ImportReport(dry_run=dry_run, replace=replace)
    for section in (*SECTIONS[:1], "fleet", *SECTIONS[1:]):
        for item in plan.items.get(section, ()):
            counter = {"create": report.created, "update": report.updated, "unchanged": report.unchanged}[item.action]
            counter[section] += 1
            if item.action != "unchanged":
                report.changes.append(_change(item.action, section, item.key))
        for row in plan.deletions.get(section, ()):
            report.deleted[section] += 1
            report.changes.append(_change("delete", section, _key(section, row)))
    return report


def _change(action: str, section: str, key: tuple[Any, ...]) -> str:
    if section == "fleet":
        return f"{action} fleet settings"
    return f"{action} {_NOUNS[section]} {_describe_key(section, key)}"


def _plan(data: Any, *, replace: bool) -> _Plan:
    """Check the document's shape and every item's fields; match items to rows. Reads only."""
    plan = _Plan()
    if not isinstance(data, dict):
        plan.errors.append(f"The document must be a JSON object, not {type(data).__name__}.")
        return plan
    if data.get("format") != FORMAT:
        plan.errors.append(f"format: expected {FORMAT!r}, got {data.get('format')!r}; is this a ratelimits export?")
    version = data.get("version")
    if version != VERSION or isinstance(version, bool):
        plan.errors.append(f"version: this ratelimits reads version {VERSION} documents, not {version!r}.")
    unknown = set(data) - {"format", "version", "fleet", *SECTIONS}
    if unknown:
        plan.errors.append(f"Unknown sections: {', '.join(sorted(map(str, unknown)))}.")
    for section in (*SECTIONS, "fleet"):
        if section not in data and replace:
            plan.errors.append(
                f"{section}: missing; replace deletes whatever the document leaves out, so every section must be "
                + (
                    "given (null for no fleet settings row)."
                    if section == "fleet"
                    else "given (an empty list for none)."
                )
            )
    for section in SECTIONS:
        if not isinstance(data.get(section, []), list):
            plan.errors.append(f"{section}: expected a list, got {type(data[section]).__name__}.")
    fleet = data.get("fleet")
    if fleet is not None and not isinstance(fleet, dict):
        plan.errors.append(f"fleet: expected an object or null, got {type(fleet).__name__}.")
    if plan.errors:
        return plan

    existing_tiers = set(Tier.objects.values_list("name", flat=True))
    file_tiers = {
        item["name"] for item in data.get("tiers", []) if isinstance(item, dict) and isinstance(item.get("name"), str)
    }
    known_tiers = file_tiers if replace else file_tiers | existing_tiers

    def tier_ref(name: Any, *, nullable: bool) -> str | None:
        if name is None and nullable:
            return None
        if not isinstance(name, str) or name not in known_tiers:
            where = "the document" if replace else "the document or the database"
            raise ValidationError(f"{name!r} is not a tier in {where}.")
        return name

    now = timezone.now()
    for section in SECTIONS:
        if section not in data:
            continue
        rows = _existing(section)
        unique = section in ("tiers", "endpoints")
        first_seen: dict[tuple[Any, ...], str] = {}
        for index, raw in enumerate(data[section]):
            label = f"{section}[{index}]"
            item = _clean_item(section, label, raw, plan.errors, tier_ref)
            if item is None:
                continue
            if unique and item.key in first_seen:
                plan.errors.append(f"{label}: the same {_NOUNS[section]} as {first_seen[item.key]}.")
                continue
            first_seen.setdefault(item.key, label)
            candidates = rows.get(item.key)
            _match(item, candidates.pop(0) if candidates else None)
            plan.errors.extend(_passed_expiry(item, now))
            plan.items[section].append(item)
        if replace:
            plan.deletions[section] = [row for matches in rows.values() for row in matches]

    stored_fleet = FleetSettings.objects.filter(pk=1).select_related("anonymous_tier", "authenticated_tier").first()
    if isinstance(fleet, dict):
        item = _clean_item("fleet", "fleet", fleet, plan.errors, tier_ref)
        if item is not None:
            _match(item, stored_fleet)
            plan.items["fleet"].append(item)
    elif replace and "fleet" in data and stored_fleet is not None:
        plan.deletions["fleet"] = [stored_fleet]
    return plan


def _existing(section: str) -> dict[tuple[Any, ...], list[models.Model]]:
    """The stored rows of a section by natural key, each key's rows in primary-key order."""
    queryset = _MODELS[section]._default_manager.all()
    if section == "assignments":
        queryset = queryset.select_related("tier")
    rows: dict[tuple[Any, ...], list[models.Model]] = defaultdict(list)
    for row in queryset.order_by("pk"):
        rows[_key(section, row)].append(row)
    return rows


def _clean_item(
    section: str,
    label: str,
    raw: Any,
    errors: list[str],
    tier_ref: Callable[..., str | None],
) -> _Item | None:
    """A new instance holding the item's values, checked field by field; ``None`` (and errors) if invalid."""
    if not isinstance(raw, dict):
        errors.append(f"{label}: expected an object, got {type(raw).__name__}.")
        return None
    model = _MODELS[section]
    fields = {f.name: f for f in _fields(model)}
    unknown = set(raw) - set(fields)
    if unknown:
        errors.append(f"{label}: unknown fields {', '.join(sorted(map(str, unknown)))}; known: {', '.join(fields)}.")
        return None
    instance = model()
    refs: dict[str, str | None] = {}
    problems: dict[str, list[str]] = {}
    for name, value in raw.items():
        f = fields[name]
        try:
            if f.is_relation:
                refs[name] = tier_ref(value, nullable=f.null)
            else:
                setattr(instance, f.attname, _import_value(f, value))
        except ValidationError as exc:
            problems.setdefault(name, []).extend(exc.messages)
    for name, f in fields.items():
        if f.is_relation and name not in raw:
            try:
                refs[name] = tier_ref(None, nullable=f.null)
            except ValidationError:
                problems.setdefault(name, []).append("This field is required: name a tier.")
    try:
        instance.clean_fields(exclude=[name for name, f in fields.items() if f.is_relation or name in problems])
    except ValidationError as exc:
        for name, messages in exc.message_dict.items():
            problems.setdefault(name, []).extend(messages)
    if section in ("assignments", "overrides") and not {"subject_kind", "subject_id"} & set(problems):
        try:
            subject_id = validate_subject(instance.subject_kind, instance.subject_id)  # type: ignore[attr-defined]
        except ValidationError as exc:
            for name, messages in exc.message_dict.items():
                problems.setdefault(name, []).extend(messages)
        else:
            instance.subject_id = subject_id  # type: ignore[attr-defined]
    if problems:
        errors.extend(_messages(label, problems))
        return None
    key = _key(section, instance, tier=refs.get("tier"))
    return _Item(section, label, key, instance, refs, "create")


def _import_value(f: models.Field[Any, Any], value: Any) -> Any:
    """A JSON value for a model field; strict about types JSON has, lenient where Django converts."""
    if isinstance(value, (dict, list)):
        raise ValidationError(f"expected a single value, got {type(value).__name__}.")
    if isinstance(f, models.BooleanField):
        if not isinstance(value, bool):
            raise ValidationError(f"expected true or false, got {value!r}.")
        return value
    if isinstance(value, bool):
        raise ValidationError(f"expected {'a number' if _numeric(f) else 'text'}, got {str(value).lower()}.")
    if isinstance(f, models.DateTimeField) and value is not None:
        parsed = parse_datetime(value) if isinstance(value, str) else None
        if parsed is None:
            raise ValidationError(f"{value!r} is not an ISO 8601 date and time such as 2025-01-31T12:00:00Z.")
        if parsed.tzinfo is None:
            raise ValidationError(f"{value!r} has no UTC offset; write it as 2025-01-31T12:00:00Z or with +hh:mm.")
        return parsed
    return value


def _numeric(f: models.Field[Any, Any]) -> bool:
    return isinstance(f, (models.IntegerField, models.DecimalField, models.FloatField))


def _match(item: _Item, stored: models.Model | None) -> None:
    """Carry the item's values over to the stored row it matches, or leave it to be created."""
    if stored is None:
        return
    before = _export_row(stored)
    after = _export_row(item.instance, item.refs)
    for f in _fields(type(stored)):
        if not f.is_relation:
            setattr(stored, f.attname, getattr(item.instance, f.attname))
    item.instance = stored
    item.action = "unchanged" if before == after else "update"


def _passed_expiry(item: _Item, now: dt.datetime) -> list[str]:
    """The error of an item that would save an expiry that has already passed, as the admin asks to confirm.

    An import cannot ask, so it refuses. A stored row the document leaves unchanged is not saved,
    so an export of rows that have since expired imports again as it is.
    """
    expires_at = getattr(item.instance, "expires_at", None)
    if item.action == "unchanged" or expires_at is None or not expired(expires_at, now=now):
        return []
    return [
        f"{item.label}.expires_at: {_format_datetime(expires_at)} has already passed: the "
        f"{_NOUNS[item.section]} would never apply. Give a later expiry, or leave it out."
    ]


def _apply(plan: _Plan, actor: Any) -> list[str]:
    """Write the plan, then validate every written row against the result; the errors, if any."""
    errors: list[str] = []
    written: list[_Item] = []
    tiers: dict[str, Tier] = {}

    def save(item: _Item) -> None:
        if item.action == "unchanged":
            return
        for name, tier_name in item.refs.items():
            setattr(item.instance, name, tiers[tier_name] if tier_name is not None else None)
        if item.action == "create" and isinstance(item.instance, Override):
            item.instance.created_by = actor if getattr(actor, "pk", None) is not None else None
        try:
            item.instance.save()
        except ValidationError as exc:  # ConcurrentEdit: changed since the plan was read
            errors.extend(f"{item.label}: {message}" for message in exc.messages)
        except DatabaseError as exc:
            errors.append(f"{item.label}: the database refused it: {exc}")
        else:
            written.append(item)

    def delete(section: str) -> None:
        for row in plan.deletions.get(section, ()):
            try:
                with transaction.atomic():
                    row.delete()
            except DatabaseError as exc:
                errors.append(f"deleting {_NOUNS[section]} {_describe_key(section, _key(section, row))}: {exc}")

    for item in plan.items.get("tiers", ()):
        save(item)
    if errors:
        return errors
    tiers = {tier.name: tier for tier in Tier.objects.all()}
    for section in ("fleet", "endpoints", "assignments", "overrides"):
        for item in plan.items.get(section, ()):
            save(item)
    if errors:
        return errors
    for section in ("overrides", "assignments", "endpoints", "fleet", "tiers"):
        delete(section)
    if errors:
        return errors
    for item in written:
        try:
            item.instance.full_clean(exclude=["created_by"])
        except ValidationError as exc:
            errors.extend(_messages(item.label, exc.message_dict))
    return errors


def _messages(label: str, problems: dict[str, list[str]]) -> list[str]:
    lines: list[str] = []
    for name, messages in problems.items():
        where = label if name == "__all__" else f"{label}.{name}"
        lines.extend(f"{where}: {message}" for message in messages)
    return lines
