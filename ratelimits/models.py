"""Admin-managed policies: tiers, subject assignments, endpoint policies, overrides, fleet settings.

Every change is audited in the same transaction and, once committed, bumps the policy version
stamp in Redis so every worker reloads its in-process copy on its next request
(see :mod:`ratelimits.store.audit` and :mod:`ratelimits.store.database`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import secrets
from decimal import Decimal
from typing import Any, ClassVar

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.dispatch import Signal
from django.utils import timezone

from . import documentation
from .algorithms import RATE_ALGORITHMS, Algorithm
from .choices import HTTP_METHODS, SHEDDABLE, Counts, FailMode, Priority
from .conf import conf
from .exceptions import ConfigurationError
from .identity import ASSIGNABLE_KINDS, SubjectKind
from .periods import QuotaMode, parse_calendar_quota, zone_info
from .rates import MAX_LIMIT, check_burst, parse_rate
from .webhooks import UnsafeURL, check_url

ALGORITHM_CHOICES = [(a.value, a.value.replace("_", " ")) for a in RATE_ALGORITHMS]
FAIL_MODE_CHOICES = [("", "fleet default"), *((mode.value, mode.description) for mode in FailMode)]
PRIORITY_CHOICES = [(p.value, p.value) for p in Priority]
COUNTS_CHOICES = [(c.value, c.description) for c in Counts]
METHOD_CHOICES = [(m, m) for m in ("ANY", *HTTP_METHODS)]
SCOPE_CHOICES = [("region", "each region"), ("global", "global: shared by every region")]
QUOTA_MODE_CHOICES = [
    (QuotaMode.HARD.value, "hard: refuse once spent"),
    (QuotaMode.SOFT.value, "soft: admit, count the overage"),
]
_SCOPE_HELP = "Global: one limit for every region together, each enforcing its share (token bucket only)."
SUBJECT_KINDS = [(kind.value, kind.label) for kind in ASSIGNABLE_KINDS]

#: Sent by a policy queryset's ``update()`` with the rows as they were (``before``) and the
#: ``changes``: the audit trail records them (:mod:`ratelimits.store.audit`).
rows_updated = Signal()
# Not starting with "/": that is a URL path, which never matches an endpoint name.
#: The longest endpoint name (the columns that hold one are this wide).
MAX_ENDPOINT_LENGTH = 150
#: The most keys one hot budget may be split over (hot-key sharding): far more than a cluster has masters.
MAX_SHARDS = 1024
_ENDPOINT = re.compile(rf"[A-Za-z0-9_.:-][A-Za-z0-9_.:/-]{{0,{MAX_ENDPOINT_LENGTH - 1}}}", re.ASCII)
_IDENTIFIER = re.compile(r"[^\s\x00-\x1f\x7f]{1,200}")


def describe_limit(rate: str, burst: int | None) -> str:
    """``"100 / second, burst 200"`` for a rate and burst as the admin stores them (the text if invalid)."""
    try:
        parsed = parse_rate(rate)
    except ConfigurationError:
        return rate
    return f"{parsed.describe()}, burst {burst or parsed.limit}"


class ConcurrentEdit(ValidationError):
    """Someone else saved this object since it was loaded; saving would silently undo their change."""


def validate_rate(value: str) -> None:
    """A model-field validator: ``"100/s"``, ``"5/10m"``; the message names the input."""
    try:
        parse_rate(value, field="rate")
    except ConfigurationError as exc:
        raise ValidationError(str(exc).removeprefix("rate: ")) from None


def validate_quota(value: str) -> None:
    """A model-field validator: a calendar quota (``"50000/month"``) or a fixed window's rate (``"500/h"``)."""
    try:
        if parse_calendar_quota(value, field="quota") is None:
            parse_rate(value, field="quota")
    except ConfigurationError as exc:
        raise ValidationError(str(exc).removeprefix("quota: ")) from None


def validate_zone(value: str) -> None:
    """A model-field validator: an IANA time zone name this system knows."""
    try:
        zone_info(value, field="zone")
    except ConfigurationError as exc:
        raise ValidationError(str(exc).removeprefix("zone: ")) from None


def quota_limit(value: str) -> int | None:
    """A quota's limit, calendar or not (``None`` if it is not one)."""
    try:
        calendar = parse_calendar_quota(value)
        return calendar[0] if calendar is not None else parse_rate(value).limit
    except ConfigurationError:
        return None


def _renews(quota: str) -> bool:
    """Whether a quota renews by calendar period, so that an anchor moves it."""
    try:
        return parse_calendar_quota(quota) is not None
    except ConfigurationError:
        return False


def validate_endpoint(value: str) -> None:
    if not _ENDPOINT.fullmatch(value):
        raise ValidationError(
            f"{value!r} is not an endpoint name: use the view's throttle_scope or route name "
            "(letters, digits and _ . : / -), not a path or a regular expression."
        )


def validate_subject(kind: str, identifier: str) -> str:
    """The canonical identifier of a subject, or a ``ValidationError`` saying what is wrong."""
    identifier = identifier.strip()
    if not _IDENTIFIER.fullmatch(identifier):
        raise ValidationError({"subject_id": "Enter an identifier of 1 to 200 visible characters."})
    if kind == SubjectKind.IP:
        try:
            network = ipaddress.ip_network(identifier, strict=False)
        except ValueError:
            raise ValidationError(
                {"subject_id": f"{identifier!r} is not an IP address or network such as 203.0.113.7 or 2001:db8::/48."}
            ) from None
        # One address is stored as the address ("203.0.113.7", not "/32"): the value of the IP subject
        # a request from it has, which overrides are matched against.
        return str(network.network_address) if network.prefixlen == network.max_prefixlen else str(network)
    if kind == SubjectKind.USER and not identifier.isdigit():
        raise ValidationError({"subject_id": "A user is identified by its primary key (a number)."})
    return identifier


def validate_storable(
    instance: models.Model, *, rates: tuple[tuple[str, str | None], ...] = (), counts: tuple[str, ...] = ()
) -> None:
    """Refuse values the limiter's store cannot carry (the bounds in :mod:`ratelimits.rates`), by field.

    ``rates`` pairs a rate field with its burst field (or ``None``); ``counts`` are limits on
    requests in flight, costs or capacities, each at most ``MAX_LIMIT``.
    """
    errors: dict[str, str] = {}
    for rate_field, burst_field in rates:
        try:
            rate = parse_rate(getattr(instance, rate_field))
        except ConfigurationError:
            continue  # blank, or the field's own validator reports it
        burst = getattr(instance, burst_field) if burst_field else None
        try:
            check_burst(rate, burst or rate.limit)
        except ConfigurationError as exc:
            errors[burst_field or rate_field] = str(exc).removeprefix("burst: ")
    for count_field in counts:
        value = getattr(instance, count_field)
        if value is not None and value > MAX_LIMIT:
            errors[count_field] = f"{value} is too large; at most {MAX_LIMIT:,} can be counted."
    if errors:
        raise ValidationError(errors)


def expired(expires_at: dt.datetime | None, *, now: dt.datetime) -> bool:
    """Whether a row with this expiry (an override's, an assignment's) has stopped applying: it applies until then.

    Not a reason for the model to refuse the row: every row expires in time and stays valid. Only
    saving an expiry that has already passed is questioned, by the admin and by an import.
    """
    return expires_at is not None and expires_at <= now


class RevisionedQuerySet(models.QuerySet):  # type: ignore[type-arg]
    """``update()`` through the app's API is audited and bumps the policy version like ``save()``."""

    def update(self, **kwargs: Any) -> int:
        # Bumped like save() does, so a copy loaded before this update cannot silently undo it.
        kwargs.setdefault("revision", models.F("revision") + 1)
        with transaction.atomic(using=self.db):
            before = list(self)
            count = super().update(**kwargs)
            rows_updated.send(sender=self.model, before=before, changes=kwargs)
        return count


class Revisioned(models.Model):
    """Optimistic locking: a save based on a stale copy is refused instead of undoing another edit."""

    revision = models.PositiveIntegerField(default=0, help_text="Bumped on every save; guards against lost edits.")
    updated_at = models.DateTimeField(auto_now=True)

    objects = RevisionedQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("update_fields") is not None:
            if not kwargs["update_fields"]:
                return  # Django saves nothing then, so nothing is revised either
            kwargs["update_fields"] = {*kwargs["update_fields"], "revision"}
        with transaction.atomic(using=kwargs.get("using")):
            if self.pk is not None and not kwargs.get("force_insert"):
                stored = (
                    type(self)
                    ._default_manager.select_for_update()
                    .filter(pk=self.pk)
                    .values_list("revision", flat=True)
                    .first()
                )
                if stored is not None and stored != self.revision:
                    raise ConcurrentEdit(
                        f"This {self._meta.verbose_name} was changed by someone else while you were editing it "
                        f"(revision {stored}, you started from {self.revision}). Reload it and apply your change again."
                    )
            self.revision += 1
            try:
                super().save(*args, **kwargs)
            except BaseException:
                self.revision -= 1  # nothing was saved: this copy still stands for the stored revision
                raise


class Tier(Revisioned):
    """A named set of limits that subjects are assigned to."""

    name = models.SlugField(max_length=50, unique=True)
    rate = models.CharField(max_length=32, validators=[validate_rate], help_text='Sustained rate, e.g. "100/s".')
    burst = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests allowed at once (default: N of the rate).",
    )
    concurrency = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)], help_text="Requests in flight at once (optional)."
    )
    quota = models.CharField(
        max_length=32,
        blank=True,
        validators=[validate_quota],
        help_text=(
            'Optional quota: per calendar day, week or month ("10000/d", "50000/week", "1000000/month"), '
            'renewing on each customer\'s anchor; any other period is a fixed window ("500/h").'
        ),
    )
    quota_zone = models.CharField(
        max_length=64,
        blank=True,
        validators=[validate_zone],
        help_text="The time zone of the quota's days, weeks and months (an IANA name, e.g. Europe/Paris; empty: UTC).",
    )
    quota_mode = models.CharField(
        max_length=4,
        choices=QUOTA_MODE_CHOICES,
        default=QuotaMode.HARD.value,
        help_text="Soft: admit past the quota and count the overage (billed), instead of refusing.",
    )
    algorithm = models.CharField(max_length=20, choices=ALGORITHM_CHOICES, default=Algorithm.TOKEN_BUCKET.value)
    fail_mode = models.CharField(max_length=10, choices=FAIL_MODE_CHOICES, blank=True)
    scope = models.CharField(max_length=10, choices=SCOPE_CHOICES, default="region", help_text=_SCOPE_HELP)
    enabled = models.BooleanField(default=True, help_text="A disabled tier's limits are not applied.")
    shadow = models.BooleanField(default=False, help_text="Count and report, but never deny.")
    description = models.TextField(blank=True)

    class Meta:
        ordering: ClassVar = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def capacity(self) -> int | None:
        """The most one subject can spend at once (``None`` while the rate is invalid)."""
        try:
            rate = parse_rate(self.rate)
        except ConfigurationError:
            return None
        return (self.burst or rate.limit) if self.algorithm == Algorithm.TOKEN_BUCKET.value else rate.limit

    def clean(self) -> None:
        """Refuse limits the store cannot carry, or under which every request of some endpoint would be denied."""
        validate_storable(self, rates=(("rate", "burst"),), counts=("concurrency",))
        if self.scope == "global":
            validate_global(self.algorithm, self.quota)
        self._validate_quota()
        capacity = self.capacity
        if capacity is None or not self.enabled:
            return  # the field validator reports a bad rate; a disabled tier limits nothing
        if self.quota:
            limit = quota_limit(self.quota)
            if limit is None:
                return  # the field validator reports it
            capacity = min(capacity, limit)
        costly = EndpointPolicy.objects.filter(enabled=True, exempt=False, cost__gt=capacity).order_by("-cost").first()
        if costly is not None:
            raise ValidationError(
                f"With a capacity of {capacity}, every request to {costly} (cost {costly.cost}) from this tier would "
                f"be denied. Raise the burst to at least {costly.cost} or lower that endpoint's cost."
            )

    def _validate_quota(self) -> None:
        """A zone or the soft mode only with a quota by calendar day, week or month."""
        if not self.quota:
            if self.quota_zone or self.quota_mode == QuotaMode.SOFT.value:
                field = "quota_zone" if self.quota_zone else "quota_mode"
                raise ValidationError({field: "There is no quota to apply this to: give a quota, or leave it empty."})
            return
        if quota_limit(self.quota) is None:
            return  # the field validator reports it
        if parse_calendar_quota(self.quota) is None and (self.quota_zone or self.quota_mode == QuotaMode.SOFT.value):
            field = "quota_zone" if self.quota_zone else "quota_mode"
            raise ValidationError(
                {
                    field: "A time zone or the soft mode needs a quota per calendar day, week or month "
                    "(such as 50000/month)."
                }
            )

    def describe(self) -> str:
        """``"100 / second, burst 200"``."""
        return describe_limit(self.rate, self.burst)


class SubjectAssignment(Revisioned):
    """Puts one subject (API key, user, organisation, IP or network) on a tier, optionally for a while."""

    subject_kind = models.CharField(max_length=10, choices=SUBJECT_KINDS)
    subject_id = models.CharField(
        max_length=200, help_text="API key identity, user id, organisation id, or an IP address/network."
    )
    tier = models.ForeignKey(Tier, on_delete=models.PROTECT, related_name="assignments")
    starts_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    quota_anchor = models.DateTimeField(
        null=True,
        blank=True,
        help_text=(
            "When this customer's billing periods renew (their subscription's start): a monthly quota renews "
            "on its day of the month at its time, in the tier's quota zone. Empty: the calendar's own starts."
        ),
    )
    note = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering: ClassVar = ["subject_kind", "subject_id"]
        indexes: ClassVar = [models.Index(fields=["subject_kind", "subject_id"])]

    def __str__(self) -> str:
        return f"{self.get_subject_kind_display()} {self.subject_id} → {self.tier}"

    def clean(self) -> None:
        self.subject_id = validate_subject(self.subject_kind, self.subject_id)
        if self.starts_at and self.expires_at and self.expires_at <= self.starts_at:
            raise ValidationError({"expires_at": "The expiry must come after the start."})
        if self.quota_anchor is not None and self.tier_id is not None and not _renews(self.tier.quota):
            # An anchor the tier's quota has no use for would silently do nothing.
            raise ValidationError(
                {
                    "quota_anchor": f"Tier {self.tier} has no quota per calendar day, week or month to renew "
                    f"({self.tier.quota or 'no quota'}): leave the anchor empty, or give the tier such a quota."
                }
            )


class EndpointPolicy(Revisioned):
    """How one endpoint is treated: cost, priority, and its own limits."""

    endpoint = models.CharField(
        max_length=MAX_ENDPOINT_LENGTH,
        validators=[validate_endpoint],
        help_text="The view's throttle_scope or route name.",
    )
    method = models.CharField(max_length=8, choices=METHOD_CHOICES, default="ANY")
    cost = models.PositiveIntegerField(default=1, validators=[MinValueValidator(1)], help_text="Tokens per request.")
    priority = models.CharField(max_length=10, choices=PRIORITY_CHOICES, default=Priority.NORMAL.value)
    per_caller_rate = models.CharField(
        max_length=32, blank=True, validators=[validate_rate], help_text="Limit per caller on this endpoint."
    )
    per_caller_burst = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    endpoint_rate = models.CharField(
        max_length=32, blank=True, validators=[validate_rate], help_text="Limit for all callers together."
    )
    endpoint_burst = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    endpoint_shards = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_SHARDS)],
        help_text="Split the all-callers limit over this many keys, which spread over a Redis Cluster's nodes "
        "(hot-key sharding; see docs/scaling.md). 1: one key.",
    )
    counts = models.CharField(
        max_length=20,
        choices=COUNTS_CHOICES,
        default=Counts.ALL.value,
        help_text="Which responses are charged; the cost of the others is given back once they are sent.",
    )
    max_cost = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="The most a view may true a request's cost up to (request.ratelimit_cost): admitted at the "
        "cost, charged what the view says after the response. Empty: the cost is fixed.",
    )
    exempt = models.BooleanField(default=False, help_text="Never limited (health checks, staff tools).")
    enabled = models.BooleanField(default=True)
    shadow = models.BooleanField(default=False, help_text="Count and report, but never deny.")
    description = models.TextField(blank=True)

    class Meta:
        verbose_name_plural = "endpoint policies"
        ordering: ClassVar = ["endpoint", "method"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["endpoint", "method"], name="ratelimits_endpoint_method")
        ]

    def __str__(self) -> str:
        return self.endpoint if self.method == "ANY" else f"{self.method} {self.endpoint}"

    def clean(self) -> None:
        validate_storable(
            self,
            rates=(("per_caller_rate", "per_caller_burst"), ("endpoint_rate", "endpoint_burst")),
            counts=("cost", "max_cost"),
        )
        if self.max_cost is not None and self.cost and self.max_cost < self.cost:
            raise ValidationError(
                {
                    "max_cost": f"{self.max_cost} is less than the cost {self.cost}, which every request is "
                    "admitted at: the most a view may true a request's cost up to is at least that."
                }
            )
        if self.enabled and not self.exempt and self.cost:
            for tier in Tier.objects.filter(enabled=True):
                capacity = tier.capacity
                if capacity is not None and self.cost > capacity:
                    raise ValidationError(
                        {
                            "cost": f"A cost of {self.cost} exceeds the capacity {capacity} of tier {tier.name!r}: "
                            "every request to this endpoint from that tier would be denied."
                        }
                    )
        if self.endpoint_shards and self.endpoint_shards > 1:
            self._clean_shards()
        for rate_field, burst_field in (("per_caller_rate", "per_caller_burst"), ("endpoint_rate", "endpoint_burst")):
            rate, burst = getattr(self, rate_field), getattr(self, burst_field)
            if burst and not rate:
                raise ValidationError({burst_field: "A burst needs a rate."})
            if rate:
                try:
                    capacity = burst or parse_rate(rate).limit
                except ConfigurationError:
                    continue  # the field's validator reports the bad rate
                if self.cost and self.cost > capacity:
                    raise ValidationError(
                        {
                            "cost": f"A cost of {self.cost} exceeds the {rate_field.replace('_', ' ')}'s capacity of "
                            f"{capacity}: every request to this endpoint would be denied."
                        }
                    )

    def _clean_shards(self) -> None:
        if not self.endpoint_rate:
            raise ValidationError({"endpoint_shards": "Shards split the all-callers rate: give one."})
        try:
            capacity = self.endpoint_burst or parse_rate(self.endpoint_rate).limit
        except ConfigurationError:
            return  # the rate's validator reports it
        if self.endpoint_shards > capacity:
            raise ValidationError(
                {"endpoint_shards": f"{self.endpoint_shards} shards exceed the capacity {capacity}: each needs one."}
            )
        if self.cost and self.cost > capacity // self.endpoint_shards:
            raise ValidationError(
                {
                    "cost": f"A cost of {self.cost} exceeds what each of the {self.endpoint_shards} shards holds "
                    f"({capacity // self.endpoint_shards}): every request to this endpoint would be denied."
                }
            )


class Override(Revisioned):
    """Replacement limits (or a multiplier) for one subject, optionally on one endpoint, until it expires."""

    subject_kind = models.CharField(max_length=10, choices=SUBJECT_KINDS)
    subject_id = models.CharField(max_length=200)
    endpoint = models.CharField(
        max_length=MAX_ENDPOINT_LENGTH, blank=True, validators=[validate_endpoint], help_text="Blank: every endpoint."
    )
    rate = models.CharField(max_length=32, blank=True, validators=[validate_rate], help_text="Replacement rate.")
    burst = models.PositiveIntegerField(null=True, blank=True, validators=[MinValueValidator(1)])
    multiplier = models.DecimalField(
        max_digits=8,
        decimal_places=3,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal("0.001")), MaxValueValidator(Decimal("10000"))],
        help_text="Scales the tier's rate and burst instead of replacing them.",
    )
    concurrency = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Replacement limit on requests in flight (optional).",
    )
    scope = models.CharField(
        max_length=10,
        choices=[("", "as the tier's"), *SCOPE_CHOICES],
        blank=True,
        help_text="Of the replacement rate or the multiplied one. " + _SCOPE_HELP,
    )
    quota = models.CharField(
        max_length=32,
        blank=True,
        validators=[validate_quota],
        help_text=(
            'Replacement quota for every endpoint (a deal: "2000000/month"), counted in the tier\'s quota zone '
            "from the subject's anchor; what was spent of the tier's in the period carries over, as a share."
        ),
    )
    quota_mode = models.CharField(
        max_length=4,
        choices=[("", "as the tier's"), *QUOTA_MODE_CHOICES],
        blank=True,
        help_text="Of the replacement quota. Soft: admit past it and count the overage.",
    )
    reason = models.TextField(help_text="Why: shown in the audit trail.")
    expires_at = models.DateTimeField(help_text="After this the override stops applying on its own.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    enabled = models.BooleanField(default=True)
    shadow = models.BooleanField(default=False, help_text="Count and report, but never deny.")

    class Meta:
        ordering: ClassVar = ["-created_at"]
        indexes: ClassVar = [models.Index(fields=["subject_kind", "subject_id"])]

    def __str__(self) -> str:
        scope = f" on {self.endpoint}" if self.endpoint else ""
        return f"{self.get_subject_kind_display()} {self.subject_id}{scope}"

    @property
    def is_active(self) -> bool:
        return self.enabled and not expired(self.expires_at, now=timezone.now())

    def describe(self) -> str:
        """``"2 / second, burst 5"``, ``"x 1.5"``, plus the concurrency limit if it has one."""
        parts = []
        if self.multiplier is not None:
            parts.append(f"x {self.multiplier}")
        elif self.rate:
            parts.append(describe_limit(self.rate, self.burst))
        if self.concurrency:
            parts.append(f"{self.concurrency} in flight")
        if self.quota:
            parts.append(f"quota {self.quota}" + (f" ({self.quota_mode})" if self.quota_mode else ""))
        return "; ".join(parts) or "—"

    def clean(self) -> None:
        self.subject_id = validate_subject(self.subject_kind, self.subject_id)
        if not self.reason or not self.reason.strip():
            raise ValidationError({"reason": "Say why this override exists."})
        if self.multiplier is not None and (self.rate or self.burst):
            raise ValidationError("Give either replacement values (rate, burst) or a multiplier, not both.")
        if self.burst and not self.rate:
            raise ValidationError({"burst": "A burst needs a rate."})
        if self.multiplier is None and not self.rate and not self.concurrency and not self.quota:
            raise ValidationError("Give a replacement rate, a multiplier, a concurrency limit, or a quota.")
        if self.quota and self.endpoint:
            raise ValidationError({"quota": "A quota counts every endpoint: leave the endpoint empty for it."})
        if self.quota_mode and not self.quota:
            raise ValidationError({"quota_mode": "A mode applies to a replacement quota: give one."})
        if self.quota_mode == QuotaMode.SOFT.value and quota_limit(self.quota) is not None and not _renews(self.quota):
            raise ValidationError(
                {"quota_mode": "The soft mode needs a quota per calendar day, week or month (such as 50000/month)."}
            )
        if self.scope and self.multiplier is None and not self.rate:
            raise ValidationError({"scope": "A scope applies to a rate: give a replacement rate or a multiplier."})
        validate_storable(self, rates=(("rate", "burst"),), counts=("concurrency",))


def validate_global(algorithm: str, quota: str) -> None:
    """A global tier counts a token bucket, and has no quota (a window's count cannot be split between regions)."""
    if algorithm != Algorithm.TOKEN_BUCKET.value:
        raise ValidationError(
            {"scope": f"A global tier needs the token bucket algorithm, not {algorithm.replace('_', ' ')}."}
        )
    if quota:
        raise ValidationError(
            {
                "quota": "A global tier cannot have a quota: keep the quota on a regional tier "
                f"({documentation.page('regions', 'not-supported')})."
            }
        )


class FleetSettings(Revisioned):
    """The one row of fleet-wide settings."""

    default_fail_mode = models.CharField(max_length=10, choices=FAIL_MODE_CHOICES[1:], default=FailMode.OPEN.value)
    shadow = models.BooleanField(default=False, help_text="Global shadow switch: count everything, deny nothing.")
    anonymous_tier = models.ForeignKey(
        Tier, null=True, blank=True, on_delete=models.PROTECT, related_name="+", help_text="Tier of anonymous callers."
    )
    authenticated_tier = models.ForeignKey(
        Tier,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="Tier of authenticated callers without an assignment.",
    )
    capacity = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests in flight the whole fleet can serve; empty: no fleet load shedding.",
    )
    shed_low_percent = models.PositiveSmallIntegerField(default=60, validators=[MaxValueValidator(100)])
    shed_normal_percent = models.PositiveSmallIntegerField(default=75, validators=[MaxValueValidator(100)])
    shed_high_percent = models.PositiveSmallIntegerField(default=90, validators=[MaxValueValidator(100)])

    class Meta:
        verbose_name = "fleet settings"
        verbose_name_plural = "fleet settings"

    def __str__(self) -> str:
        return "Fleet settings"

    def clean(self) -> None:
        validate_storable(self, counts=("capacity",))
        if not self.shed_low_percent <= self.shed_normal_percent <= self.shed_high_percent:
            raise ValidationError("Shedding thresholds must rise with priority: low ≤ normal ≤ high.")

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.pk = 1  # one row only
        super().save(*args, **kwargs)

    def shed_thresholds(self) -> dict[Priority, int]:
        """The share of the capacity, per class, above which the fleet sheds it (percent)."""
        percents = (self.shed_low_percent, self.shed_normal_percent, self.shed_high_percent)
        return dict(zip(SHEDDABLE, percents, strict=True))

    @classmethod
    def load(cls) -> FleetSettings:
        return cls.objects.get_or_create(pk=1)[0]


class PolicyVersion(models.Model):
    """The policy version: one counter, raised in the same transaction as any policy change.

    The database holds the truth; the limiter's store only carries a copy back with every
    decision. A change committed while the store was unreachable is therefore not lost: the
    next worker that notices the store lagging behind publishes the counter again.
    """

    value = models.BigIntegerField(default=0)

    class Meta:
        verbose_name = "policy version"

    def __str__(self) -> str:
        return f"policy version {self.value}"

    @classmethod
    def current(cls, using: str = "default") -> int:
        """The committed version (0 before any change)."""
        value = cls.objects.using(using).filter(pk=1).values_list("value", flat=True).first()
        return int(value or 0)

    @classmethod
    def advance(cls, using: str = "default") -> None:
        """Raise the version inside the current transaction (row-locked until it commits)."""
        if not cls.objects.using(using).filter(pk=1).update(value=models.F("value") + 1):
            cls.objects.using(using).create(pk=1, value=1)


class AuditEntry(models.Model):
    """Who changed which policy, when, from what to what, and why."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    action = models.CharField(max_length=10, choices=[(a, a) for a in ("created", "changed", "deleted", "reset")])
    model = models.CharField(max_length=100)
    object_id = models.CharField(max_length=100)
    object_repr = models.CharField(max_length=300)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True)

    class Meta:
        verbose_name_plural = "audit entries"
        ordering: ClassVar = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M} {self.action} {self.model} {self.object_repr}"


GRANULARITIES = [("minute", "minute"), ("hour", "hour"), ("day", "day")]


class UsageRecord(models.Model):
    """What one subject did on one endpoint in one period: drained from the per-minute counters."""

    granularity = models.CharField(max_length=6, choices=GRANULARITIES, default="minute")
    period_start = models.DateTimeField()
    subject_kind = models.CharField(max_length=10)
    subject_id = models.CharField(max_length=200)
    organization = models.CharField(max_length=200, blank=True)
    tier = models.CharField(max_length=50, blank=True)
    endpoint = models.CharField(max_length=MAX_ENDPOINT_LENGTH)
    allowed = models.PositiveBigIntegerField(default=0)
    throttled = models.PositiveBigIntegerField(default=0, help_text="Denied with 429.")
    shed = models.PositiveBigIntegerField(default=0, help_text="Denied with 503 by the load shedder.")
    degraded = models.PositiveBigIntegerField(default=0, help_text="Decided without the limiter's store.")
    tokens = models.PositiveBigIntegerField(default=0, help_text="Tokens spent by allowed requests.")

    class Meta:
        ordering: ClassVar = ["-period_start"]
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["granularity", "period_start", "subject_kind", "subject_id", "endpoint"],
                name="ratelimits_usage_period_subject_endpoint",
            )
        ]
        indexes: ClassVar = [
            models.Index(fields=["subject_kind", "subject_id", "granularity", "period_start"]),
            models.Index(fields=["granularity", "period_start"]),
        ]

    def __str__(self) -> str:
        period = f"{self.granularity} of {self.period_start:%Y-%m-%d %H:%M}"
        return f"{self.subject_kind} {self.subject_id} on {self.endpoint}, {period}"

    @property
    def requests(self) -> int:
        return self.allowed + self.throttled + self.shed + self.degraded


class UsageBatch(models.Model):
    """A drained batch of counters, recorded in the same transaction as its rows: never applied twice."""

    batch = models.CharField(max_length=200, unique=True)
    applied_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.batch


class UsageSubject(models.Model):
    """Who a digest in the usage counters stands for: the label the drain writes into ``UsageRecord`` rows.

    The counters name callers and organisations by digest only, so that the store never holds a
    raw identity. Workers write a row here when they first count a subject, and again now and then
    while they keep counting it (``last_seen``); rows no counter can name any more are purged.
    """

    digest = models.CharField(max_length=32, primary_key=True)
    kind = models.CharField(max_length=10)
    value = models.CharField(max_length=200)
    first_seen = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"{self.kind} {self.value}"


def new_webhook_secret() -> str:
    """A fresh signing secret: 32 random bytes, with a prefix that says what it is when it leaks."""
    return "whsec_" + secrets.token_urlsafe(32)


class WebhookEndpoint(models.Model):
    """Where one customer (a subject) is told of its notices: a URL, signed with its own secret."""

    subject_kind = models.CharField(max_length=10, choices=SUBJECT_KINDS)
    subject_id = models.CharField(
        max_length=200, help_text="API key identity, user id or organisation id, as on its tier assignment."
    )
    url = models.URLField(max_length=500, help_text="Receives a signed POST for each notice (https:// in production).")
    secret = models.CharField(
        max_length=100,
        default=new_webhook_secret,
        help_text="Signs each delivery (HMAC-SHA256): give it to the customer, who verifies with it.",
    )
    enabled = models.BooleanField(default=True, help_text="Off: new notices are not delivered here.")
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering: ClassVar = ["subject_kind", "subject_id", "url"]
        constraints: ClassVar = [
            # The same URL twice would get every notice twice.
            models.UniqueConstraint(
                fields=["subject_kind", "subject_id", "url"], name="ratelimits_webhook_once_per_subject"
            )
        ]

    def __str__(self) -> str:
        return f"{self.get_subject_kind_display()} {self.subject_id} → {self.url}"

    def clean(self) -> None:
        self.subject_id = validate_subject(self.subject_kind, self.subject_id)
        try:
            check_url(self.url, allow_private=conf.usage.notices.allow_private_urls, resolve=False)
        except UnsafeURL as exc:
            hint = " (RATELIMITS['USAGE']['NOTICES']['ALLOW_PRIVATE_URLS'] allows it, for development)"
            raise ValidationError({"url": f"{exc}{hint if 'public' in str(exc) else ''}."}) from None


NOTICE_KINDS = [
    ("quota.threshold", "quota threshold crossed"),
    ("refusals", "refused again and again"),
]


class Notice(models.Model):
    """A subject crossed a threshold in one period: made once, whichever process saw it first.

    ``threshold`` is a percentage of the quota (``quota.threshold``) or the number of refusals
    within the rule's window (``refusals``); ``period_start`` names the billing period (or, for
    refusals, the hour) it is deduplicated in.
    """

    kind = models.CharField(max_length=20, choices=NOTICE_KINDS)
    subject_kind = models.CharField(max_length=10)
    subject_id = models.CharField(max_length=200)
    policy = models.CharField(max_length=200, blank=True, help_text="The quota crossed (empty for refusals).")
    threshold = models.PositiveIntegerField()
    period_start = models.DateTimeField()
    used = models.PositiveBigIntegerField(help_text="What was spent (or refused) when it was seen.")
    limit = models.PositiveBigIntegerField(help_text="The quota (or the rule's number of refusals).")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering: ClassVar = ["-created_at"]
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["kind", "subject_kind", "subject_id", "policy", "threshold", "period_start"],
                name="ratelimits_notice_once_per_period",
            )
        ]
        indexes: ClassVar = [models.Index(fields=["subject_kind", "subject_id", "created_at"])]

    def __str__(self) -> str:
        if self.kind == "refusals":
            return f"{self.subject_kind} {self.subject_id} refused {self.used} times"
        return f"{self.subject_kind} {self.subject_id} past {self.threshold}% of {self.policy}"


DELIVERY_STATES = [("pending", "pending"), ("delivered", "delivered"), ("failed", "given up")]


class Delivery(models.Model):
    """One notice to one webhook endpoint: tried until the receiver answers 2xx, or given up."""

    notice = models.ForeignKey(Notice, on_delete=models.CASCADE, related_name="deliveries")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    state = models.CharField(max_length=10, choices=DELIVERY_STATES, default="pending")
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    #: Until when a sender has it: no other sender takes it before (a sender that died lets go then).
    claimed_until = models.DateTimeField(null=True, blank=True)
    #: Which sender has it: only that sender records what came of its attempt.
    claim = models.CharField(max_length=32, blank=True)
    #: Retried until ``USAGE['NOTICES']['RETRY_FOR']`` after this (its creation, or "send again").
    retry_from = models.DateTimeField(default=timezone.now)
    last_status = models.PositiveIntegerField(null=True, blank=True, help_text="The receiver's last HTTP status.")
    last_error = models.CharField(max_length=500, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name_plural = "deliveries"
        ordering: ClassVar = ["-created_at"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["notice", "endpoint"], name="ratelimits_delivery_once_per_endpoint")
        ]
        indexes: ClassVar = [models.Index(fields=["state", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.notice} → {self.endpoint.url} ({self.state})"


class DeliveryAttempt(models.Model):
    """One POST of a delivery, and what came of it: the delivery log."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="log")
    at = models.DateTimeField(default=timezone.now)
    status = models.PositiveIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    took_ms = models.PositiveIntegerField(default=0)

    class Meta:
        ordering: ClassVar = ["-at"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.status or self.error}"
