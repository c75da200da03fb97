"""Notices: one row per crossing, the signal, and their delivery to each customer's webhooks.

A notice is made once per subject, rule, threshold and period, whichever process saw it first
(the rows are unique; the process that made the row sends :data:`notice_created`, so the signal
fires once too). Making it makes a :class:`~ratelimits.models.Delivery` for each enabled webhook
endpoint of its subject, in the same transaction: from then on the database holds what is owed,
and :func:`send_due` pays it, from the periodic work, until the receiver answers 2xx or
``USAGE['NOTICES']['RETRY_FOR']`` has passed. A receiver down for an hour, or a worker killed mid-send,
loses nothing: the delivery is still pending, and the next sweep sends it.

Each delivery is claimed before it is sent (a conditional update, on any database), so two
sweeps never send it at once. Delivered once, except where no design can help: a sender killed
between the receiver's 2xx and its own record of it sends it again once its claim has lapsed;
the ``Ratelimits-Event`` header names the event, the same on every attempt, for a receiver to
drop the second.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.signals import request_finished
from django.db import router, transaction
from django.db.models import F, Q, Sum
from django.dispatch import Signal
from django.utils import timezone

from ..conf import conf
from ..models import Delivery, DeliveryAttempt, Notice, UsageRecord, WebhookEndpoint
from ..periods import from_us
from ..thresholds import Crossing, threshold_watch
from ..usage.records import OVERFLOW, UNRESOLVED
from ..webhooks import post

__all__ = [
    "QUOTA_THRESHOLD",
    "REFUSALS",
    "backoff_s",
    "claim_s",
    "connect",
    "find_refusals",
    "notice_created",
    "payload",
    "record",
    "send_due",
    "sweep",
    "write_pending",
]

logger = logging.getLogger("ratelimits")

QUOTA_THRESHOLD = "quota.threshold"
REFUSALS = "refusals"

#: Sent once per notice, by the process that made its row, after the transaction committed:
#: ``notice_created.send(sender=Notice, notice=notice)``.
notice_created = Signal()

#: How long past its attempt's deadline a claim holds: time enough to resolve the receiver's name
#: and record what came of the attempt. A sender that died lets go of its claim then.
_CLAIM_MARGIN_S = 10.0
#: The most deliveries one sweep sends (the rest wait for the next sweep, or another worker's).
SWEEP_LIMIT = 200
#: How long one sweep goes on taking deliveries: receivers that each take their whole timeout
#: must not hold one worker (or the drain command's loop) for long.
SWEEP_BUDGET_S = 30.0


def connect() -> None:
    """Write the crossings this process saw after every response (called once the app is ready)."""
    request_finished.connect(write_pending, dispatch_uid="ratelimits.store.notices.write_pending")


def write_pending(**kwargs: Any) -> int:
    """Make the notices of the crossings this process saw and has not written; return how many were new.

    Connected to ``request_finished``: on the request's thread, after its response left. A write
    that fails is logged, and its crossings are reported again by their subjects' next requests.
    """
    watch = threshold_watch()
    if watch is None or not watch.pending:
        return 0
    crossings = watch.take()
    try:
        return len(record(crossings))
    except Exception:  # the database down, its tables missing: the response has left, nothing to fail
        watch.forget(crossings)
        logger.exception(
            "ratelimits: could not write %d notice(s); their subjects' next requests report them again",
            len(crossings),
        )
        return 0


def sweep() -> dict[str, int]:
    """The periodic work of notices: repeated refusals made notices, then the deliveries due sent."""
    if not conf.usage.notices.enabled:
        return {}
    try:
        refusals = len(find_refusals())
    except Exception:  # the deliveries due are sent all the same
        logger.exception("ratelimits: looking for repeated refusals failed")
        refusals = 0
    return {"refusals": refusals, "delivered": send_due()}


def record(crossings: Sequence[Crossing]) -> list[Notice]:
    """The notices of ``crossings`` that no process had made yet, made (with their deliveries)."""
    made = []
    for crossing in crossings:
        notice = _make(
            kind=QUOTA_THRESHOLD,
            subject_kind=crossing.subject_kind,
            subject_id=crossing.subject_id,
            policy=crossing.policy,
            threshold=crossing.threshold,
            period_start=from_us(crossing.period_start_us),
            used=crossing.used,
            limit=crossing.limit,
        )
        if notice is not None:
            made.append(notice)
    return made


def find_refusals(now: datetime | None = None) -> list[Notice]:
    """Subjects refused ``USAGE['NOTICES']['REFUSALS']`` times or more within ``REFUSALS_WITHIN``: their notices, made.

    Read from the drained minutes of the usage records (the counters every decision already
    keeps), so a burst is seen a drain after its minute closed. Once per subject and clock hour.
    """
    settings = conf.usage.notices
    if not settings.enabled or settings.refusals is None:
        return []
    now = now or timezone.now()
    minutes = int(settings.refusals_within // 60)  # whole minutes, checked with the setting
    since = now.replace(second=0, microsecond=0) - timedelta(minutes=minutes)
    rows = (
        UsageRecord.objects.filter(granularity="minute", period_start__gte=since, throttled__gt=0)
        .values("subject_kind", "subject_id")
        .annotate(refused=Sum("throttled"))
        .filter(refused__gte=settings.refusals)
    )
    hour = now.replace(minute=0, second=0, microsecond=0)
    made = []
    for row in rows:
        if row["subject_kind"] == OVERFLOW or row["subject_id"].startswith(UNRESOLVED):
            continue  # not one customer: nobody to tell
        notice = _make(
            kind=REFUSALS,
            subject_kind=row["subject_kind"],
            subject_id=row["subject_id"],
            policy="",
            threshold=settings.refusals,
            period_start=hour,
            used=int(row["refused"]),
            limit=settings.refusals,
        )
        if notice is not None:
            made.append(notice)
    return made


def _make(**fields: Any) -> Notice | None:
    """The notice of ``fields``, made with its deliveries if no process made it before; else ``None``."""
    unique = {k: fields.pop(k) for k in ("kind", "subject_kind", "subject_id", "policy", "threshold", "period_start")}
    with transaction.atomic(using=router.db_for_write(Notice)):
        notice, created = Notice.objects.get_or_create(**unique, defaults=fields)
        if not created:
            return None
        endpoints = WebhookEndpoint.objects.filter(
            subject_kind=notice.subject_kind, subject_id=notice.subject_id, enabled=True
        )
        Delivery.objects.bulk_create(Delivery(notice=notice, endpoint=endpoint) for endpoint in endpoints)
        transaction.on_commit(lambda: _announce(notice))
    return notice


def _announce(notice: Notice) -> None:
    try:
        notice_created.send(sender=Notice, notice=notice)
    except Exception:  # a receiver's bug must not undo what the notice did
        logger.exception("ratelimits: a receiver of notice_created failed for %s", notice)


def payload(notice: Notice) -> bytes:
    """What each delivery of ``notice`` carries: the same bytes on every attempt."""
    data: dict[str, Any] = {
        "threshold": notice.threshold,
        "used": notice.used,
        "limit": notice.limit,
        "period_start": notice.period_start.astimezone(UTC).isoformat().replace("+00:00", "Z"),
    }
    if notice.kind == QUOTA_THRESHOLD:
        data["policy"] = notice.policy
    body = {
        "id": event_id(notice),
        "type": notice.kind,
        "created": notice.created_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "subject": {"kind": notice.subject_kind, "id": notice.subject_id},
        "data": data,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def event_id(notice: Notice) -> str:
    return f"ntc_{notice.pk}"


def backoff_s(attempts: int) -> float:
    """The wait after ``attempts`` failed attempts: ``RETRY_FIRST``, doubling, at most ``RETRY_LONGEST``."""
    settings = conf.usage.notices
    doublings = min(max(attempts - 1, 0), 40)  # past 40 the longest wait has long been reached
    return float(min(settings.retry_first * 2.0**doublings, settings.retry_longest))


def claim_s() -> float:
    """How long a sender holds a delivery: its attempt's deadline, and time to record what came of it."""
    return conf.usage.notices.timeout + _CLAIM_MARGIN_S


def send_due(now: datetime | None = None, *, limit: int = SWEEP_LIMIT) -> int:
    """Send the deliveries that are due and claimed by no live sender; return how many were delivered.

    ``now`` (for tests) moves the sweep's clock: each delivery is read at ``now`` plus the time
    the sweep has run. A sweep stops taking deliveries after :data:`SWEEP_BUDGET_S`; the next
    sweep, or another worker's, takes the rest.
    """
    started = timezone.now()
    offset = (now - started) if now is not None else timedelta(0)

    def clock() -> datetime:
        return timezone.now() + offset

    due = Delivery.objects.filter(_unclaimed(clock()), state="pending", next_attempt_at__lte=clock())
    delivered = 0
    for pk in list(due.order_by("next_attempt_at").values_list("pk", flat=True)[:limit]):
        if timezone.now() - started > timedelta(seconds=SWEEP_BUDGET_S):
            break
        moment, token = clock(), secrets.token_hex(16)
        taken = Delivery.objects.filter(_unclaimed(moment), pk=pk, state="pending", next_attempt_at__lte=moment)
        if not taken.update(claimed_until=moment + timedelta(seconds=claim_s()), claim=token):
            continue  # another sender has it, or has just tried it
        try:
            delivery = Delivery.objects.select_related("notice", "endpoint").get(pk=pk)
            delivered += _attempt(delivery, token, moment)
        except Exception:  # one delivery's trouble (a row deleted meanwhile) must not stop the others
            logger.exception("ratelimits: the delivery %s could not be attempted", pk)
            Delivery.objects.filter(pk=pk, claim=token).update(claim="", claimed_until=None)
    return delivered


def _unclaimed(now: datetime) -> Q:
    return Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)


def _attempt(delivery: Delivery, token: str, started: datetime) -> bool:
    settings = conf.usage.notices
    endpoint, notice = delivery.endpoint, delivery.notice
    if started - delivery.retry_from > timedelta(seconds=settings.retry_for):
        _settle(delivery, token, "failed", None, f"given up after {delivery.attempts} attempts", started, tried=False)
        return False
    if not endpoint.enabled:
        _settle(delivery, token, "failed", None, "the endpoint was disabled", started, tried=False)
        return False
    attempt = post(
        endpoint.url,
        endpoint.secret,
        payload(notice),
        event=event_id(notice),
        timeout_s=settings.timeout,
        allow_private=settings.allow_private_urls,
    )
    DeliveryAttempt.objects.create(
        delivery=delivery, at=started, status=attempt.status, error=attempt.error[:500], took_ms=attempt.took_ms
    )
    if attempt.delivered:
        _settle(delivery, token, "delivered", attempt.status, "", started, delivered=True)
        return True
    logger.info("ratelimits: delivery of %s to %s failed: %s", event_id(notice), endpoint.url, attempt.error)
    _settle(delivery, token, "pending", attempt.status, attempt.error, started)
    return False


def _settle(
    delivery: Delivery,
    token: str,
    state: str,
    status: int | None,
    error: str,
    at: datetime,
    *,
    delivered: bool = False,
    tried: bool = True,
) -> None:
    """Record what came of an attempt (``tried``) or of giving up, and let go of the claim.

    Only while the claim is still this sender's: a sender that overran its claim records nothing
    (its attempt is in the log), and the row stays as the sender that took it over leaves it.
    """
    attempts = delivery.attempts + tried
    settled = Delivery.objects.filter(pk=delivery.pk, claim=token).update(
        state=state,
        attempts=F("attempts") + int(tried),
        last_status=status,
        last_error=error[:500],
        delivered_at=at if delivered else None,
        next_attempt_at=at + timedelta(seconds=backoff_s(attempts)),
        claimed_until=None,
        claim="",
    )
    if not settled:
        logger.warning("ratelimits: the delivery %s overran its claim; another sender has it", delivery.pk)
