"""Notices: quota thresholds read from the decisions, repeated refusals, and signed webhooks that lose nothing.

Against real parts: decisions of the memory backend and of a private Redis, the database, and a
webhook receiver over HTTP on a loopback port. Times that a test needs to pass (a retry's wait,
a claim's lapse) are passed as ``now`` to the sweep, never slept. The Celery worker and beat, a
worker killed mid-outage, and gunicorn: ``test_notices_celery.py``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends.memory import MemoryBackend
from ratelimits.checks import W024, check_database
from ratelimits.counters import OVERFLOW
from ratelimits.identity import Subject
from ratelimits.models import Delivery, DeliveryAttempt, Notice, SubjectAssignment, Tier, UsageRecord, WebhookEndpoint
from ratelimits.periods import LONGEST_US, BillingPeriod, Unit
from ratelimits.policies import Check, Policy
from ratelimits.policies.values import Role
from ratelimits.rates import Rate
from ratelimits.store import notices
from ratelimits.thresholds import ThresholdWatch
from ratelimits.webhooks import EVENT_HEADER, SIGNATURE_HEADER, UnsafeURL, check_url, post, sign, verify

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.clock import FakeClock
from .support.receiver import Receiver
from .support.redis_server import RedisServer
from .support.settings import merged

ACME = Subject("api_key", "acme")
MONTH = BillingPeriod(Unit.MONTH)
DECEMBER = datetime(2026, 12, 1, tzinfo=UTC)
#: Retries in a test: the first after a second, at most two seconds apart, given up after a minute.
FAST = {"RETRY_FIRST": "1s", "RETRY_LONGEST": "2s", "RETRY_FOR": "1m", "ALLOW_PRIVATE_URLS": True, "TIMEOUT": "5s"}


def monthly(limit: int, *, shadow: bool = False) -> Policy:
    return Policy(
        "tier:pro:quota",
        Rate(limit, LONGEST_US[Unit.MONTH]),
        limit,
        Algorithm.FIXED_WINDOW,
        role=Role.QUOTA,
        period=MONTH,
        shadow=shadow,
    )


def us(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000)


@pytest.fixture
def fast(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": FAST}})


# -- the signature and one attempt -------------------------------------------------------------


def test_a_signature_verifies_and_nothing_else_does() -> None:
    body = b'{"type": "quota.threshold", "threshold": 80}'
    header = sign("whsec_1", body, timestamp=1_800_000_000)
    assert verify("whsec_1", body, header, now=1_800_000_010)
    assert not verify("whsec_2", body, header, now=1_800_000_010)  # another secret
    assert not verify("whsec_1", body + b" ", header, now=1_800_000_010)  # another body
    assert not verify("whsec_1", body, header, now=1_800_000_000 + 301)  # replayed too late
    assert verify("whsec_1", body, f"{header},v1=00ff", now=1_800_000_000)  # a rolled secret's second v1
    for junk in ("", "t=abc,v1=", "v1=deadbeef", "t=1800000000", ",,,=", "t=1800000000,v1=\u00e9", "t=" + "9" * 5000):
        assert not verify("whsec_1", body, junk, now=1_800_000_000)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:8000/hooks", "not a public address"),
        ("http://10.1.2.3/hooks", "not a public address"),
        ("http://169.254.169.254/latest/meta-data", "not a public address"),  # a cloud's metadata service
        ("http://[::1]/hooks", "not a public address"),
        ("http://[::ffff:10.0.0.1]/hooks", "not a public address"),  # IPv4-mapped
        ("http://[64:ff9b::a00:1]/hooks", "not a public address"),  # NAT64 to 10.0.0.1
        ("http://[2002:a00:1::1]/hooks", "not a public address"),  # 6to4 from 10.0.0.1
        ("http://localhost/hooks", "not a public address"),
        ("ftp://example.com/hooks", "not an http:// or https:// URL"),
        ("https:///hooks", "not an http:// or https:// URL"),
        ("https://user:secret@example.com/hooks", "carries credentials"),
        ("https://example.com:99999/hooks", "out of range"),
    ],
)
def test_a_url_that_leads_inside_is_refused(url: str, why: str) -> None:
    with pytest.raises(UnsafeURL, match=why):
        check_url(url)
    with pytest.raises(UnsafeURL, match=why):
        check_url(url, resolve=False)


def test_private_urls_pass_when_allowed_and_names_are_checked_once_resolved() -> None:
    assert check_url("http://127.0.0.1:8000/hooks", allow_private=True)[1] == "127.0.0.1"
    assert check_url("https://hooks.example.com/x", resolve=False)[1] == "hooks.example.com"  # a form's check
    assert check_url("http://localhost:8000/hooks", allow_private=True)[1] in ("127.0.0.1", "::1")


def test_an_attempt_is_signed_follows_no_redirect_and_a_receiver_down_is_an_attempt_to_retry() -> None:
    with Receiver() as good, Receiver() as inside, Receiver(status=302) as moved:
        moved.location = inside.url
        body = b'{"type":"quota.threshold"}'
        attempt = post(good.url, "whsec_9", body, event="ntc_1", allow_private=True)
        redirected = post(moved.url, "whsec_9", body, event="ntc_1", allow_private=True)
        refused = post(good.url, "whsec_9", body, event="ntc_1")  # loopback, not allowed
        good.down()
        down = post(good.url, "whsec_9", body, event="ntc_1", timeout_s=2, allow_private=True)
    assert attempt.delivered and attempt.status == 204
    [got] = good.received
    assert got.body == body and got.headers[EVENT_HEADER] == "ntc_1" and got.path == "/hooks"
    assert verify("whsec_9", got.body, got.headers[SIGNATURE_HEADER])
    assert redirected.status == 302 and not redirected.delivered and inside.received == []  # not followed
    assert refused.status is None and "not a public address" in refused.error and len(good.received) == 1
    assert not down.delivered and down.status is None and "Connection" in down.error


def test_a_url_typed_with_other_characters_is_sent_percent_encoded() -> None:
    with Receiver() as receiver:
        attempt = post(f"{receiver.url}/caf\u00e9?q=\u00e0 b", "whsec_9", b"{}", event="ntc_2", allow_private=True)
    assert attempt.delivered
    assert [r.path for r in receiver.received] == ["/hooks/caf%C3%A9?q=%C3%A0%20b"]


def test_an_attempt_ends_at_its_deadline_whatever_the_receiver_does() -> None:
    """A receiver that drips its answer a byte at a time, each within the socket's timeout, is cut
    off when the attempt's time is up (it would drip for 30 s)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            for _ in range(300):  # 30 s at most, then the test's server ends
                if stop.wait(0.1):
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(b"X")

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/hooks"
    try:
        started = time.monotonic()
        attempt = post(url, "whsec_9", b"{}", event="ntc_3", timeout_s=1.0, allow_private=True)
        took = time.monotonic() - started
    finally:
        stop.set()
        dripping.join(5)
        server.close()
    assert not attempt.delivered and attempt.status is None
    assert took < 15  # cut at 1 s; the margin is for a loaded machine, far below the 30 s of drip


# -- thresholds from the decisions -------------------------------------------------------------


def test_each_threshold_of_a_period_is_reported_once() -> None:
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    clock.now = us(DECEMBER + timedelta(days=6))
    watch = ThresholdWatch([80, 100])
    reported = []
    for _ in range(12):  # 10 admitted, 2 refused: the refusals are past 100% too, and said already
        reported += watch.crossings(backend.decide([Check(monthly(10), ACME)]))
    assert [(c.threshold, c.used, c.period_start_us) for c in reported] == [
        (80, 8, us(DECEMBER)),
        (100, 10, us(DECEMBER)),
    ]
    clock.now = us(datetime(2027, 1, 1, 1, tzinfo=UTC))  # the next period: each threshold again
    for _ in range(8):
        reported += watch.crossings(backend.decide([Check(monthly(10), ACME)]))
    assert [(c.threshold, c.period_start_us) for c in reported[2:]] == [(80, us(datetime(2027, 1, 1, tzinfo=UTC)))]


def test_a_request_refused_by_another_limit_spends_nothing_and_crosses_nothing() -> None:
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    clock.now = us(DECEMBER + timedelta(days=1))
    tight = Policy("tier:pro", Rate(1, 60_000_000), 1)
    watch = ThresholdWatch([50])
    first = backend.decide([Check(tight, ACME), Check(monthly(2), ACME)])  # admitted: 1 of 2 spent, 50%
    second = backend.decide([Check(tight, ACME), Check(monthly(2), ACME)])  # refused by the rate
    assert first.allowed and not second.allowed
    assert [c.used for c in watch.crossings(first)] == [1]
    assert watch.crossings(second) == [] and ThresholdWatch([50]).crossings(second) == []


def test_a_refusal_shows_what_was_spent_before_it() -> None:
    """A request costing more than is left is refused, and the quota is not spent: no 100% yet."""
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    clock.now = us(DECEMBER + timedelta(days=1))
    watch = ThresholdWatch([80, 100])
    for _ in range(8):
        watch.crossings(backend.decide([Check(monthly(10), ACME)]))
    refused = backend.decide([Check(monthly(10), ACME, cost=5)])
    assert not refused.allowed and watch.crossings(refused) == []
    spent = [backend.decide([Check(monthly(10), ACME)]) for _ in range(3)]  # 9, 10, then refused
    assert [d.allowed for d in spent] == [True, True, False]
    assert [c.threshold for c in watch.crossings(spent[1])] == [100]
    assert [c.used for c in ThresholdWatch([100]).crossings(spent[2])] == [10]  # another process: from the refusal


def test_an_answer_from_memory_reports_nothing() -> None:
    """A remembered refusal or a lease was timed by the worker's clock: the store's next answer tells."""
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    clock.now = us(DECEMBER + timedelta(days=1))
    decision = backend.decide([Check(monthly(1), ACME)])
    assert [c.threshold for c in ThresholdWatch([100]).crossings(decision)] == [100]
    assert ThresholdWatch([100]).crossings(replace(decision, local="lease")) == []


def test_a_shadow_quota_reports_nothing() -> None:
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    clock.now = us(DECEMBER + timedelta(days=1))
    decision = backend.decide([Check(monthly(1, shadow=True), ACME)])
    assert ThresholdWatch([100]).crossings(decision) == []


# -- notices in the database -------------------------------------------------------------------


def crossing_of(subject_id: str, threshold: int) -> Any:
    watch = ThresholdWatch([threshold])
    clock = FakeClock()
    clock.now = us(DECEMBER + timedelta(days=3))
    backend = MemoryBackend(clock=clock)
    found = []
    for _ in range(10):
        found += watch.crossings(backend.decide([Check(monthly(10), Subject("api_key", subject_id))]))
    return found


@pytest.mark.django_db(transaction=True)
def test_a_crossing_seen_by_two_processes_is_one_notice_one_signal_and_a_delivery_per_endpoint() -> None:
    first = WebhookEndpoint.objects.create(subject_kind="api_key", subject_id="ApiKey:1", url="https://a.example/h")
    second = WebhookEndpoint.objects.create(subject_kind="api_key", subject_id="ApiKey:1", url="https://b.example/h")
    WebhookEndpoint.objects.create(
        subject_kind="api_key", subject_id="ApiKey:1", url="https://c.example", enabled=False
    )
    WebhookEndpoint.objects.create(subject_kind="api_key", subject_id="ApiKey:2", url="https://d.example/h")
    heard: list[Notice] = []

    def receiver(sender: Any, notice: Notice, **kwargs: Any) -> None:
        heard.append(notice)

    notices.notice_created.connect(receiver)
    try:
        made = notices.record(crossing_of("ApiKey:1", 80))  # one process
        again = notices.record(crossing_of("ApiKey:1", 80))  # another, which saw it too
    finally:
        notices.notice_created.disconnect(receiver)
    [notice] = made
    assert again == [] and Notice.objects.count() == 1 and heard == [notice]
    assert (notice.kind, notice.subject_id, notice.policy, notice.threshold) == (
        "quota.threshold",
        "ApiKey:1",
        "tier:pro:quota",
        80,
    )
    assert (notice.used, notice.limit, notice.period_start) == (8, 10, DECEMBER)
    assert {d.endpoint for d in Delivery.objects.all()} == {first, second}


@pytest.mark.django_db(transaction=True)
def test_requests_past_a_monthly_quota_make_each_notice_once(settings: Any) -> None:
    """Through the request path: the crossings are written after the responses, once each."""
    tier = Tier.objects.create(name="metered", rate="100/s", burst=100, quota="10/month")
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    key = ApiKeyFactory(raw="sk_noticed_customer")
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=tier)
    engine.reset()
    client = client_for("sk_noticed_customer")
    statuses = [client.get("/v1/customers").status_code for _ in range(12)]
    assert statuses == [200] * 10 + [429] * 2
    rows = list(Notice.objects.order_by("threshold").values_list("subject_id", "policy", "threshold", "used"))
    assert rows == [
        (f"ApiKey:{key.pk}", "tier:metered:quota", 80, 8),
        (f"ApiKey:{key.pk}", "tier:metered:quota", 100, 10),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_notice_that_cannot_be_written_is_written_after_the_next_request(settings: Any, caplog: Any) -> None:
    """The table missing: the API keeps serving, and the crossing is not lost."""
    tier = Tier.objects.create(name="metered", rate="100/s", burst=100, quota="10/month")
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}, "USAGE": {"NOTICES": {"QUOTA_THRESHOLDS": [50]}}}
    )
    key = ApiKeyFactory(raw="sk_unwritten_customer")
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=tier)
    engine.reset()
    client = client_for("sk_unwritten_customer")
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE ratelimits_notice RENAME TO ratelimits_notice_away")
    try:
        assert [client.get("/v1/customers").status_code for _ in range(5)] == [200] * 5  # the 5th crosses 50%
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE ratelimits_notice_away RENAME TO ratelimits_notice")
    assert "could not write 1 notice(s)" in caplog.text and Notice.objects.count() == 0
    assert client.get("/v1/customers").status_code == 200
    assert list(Notice.objects.values_list("threshold", "used")) == [(50, 6)]  # seen again, by the next request


@pytest.mark.django_db
def test_repeated_refusals_make_one_notice_an_hour(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": {"REFUSALS": 50}}})
    now = datetime(2026, 12, 7, 10, 30, 20, tzinfo=UTC)

    def minute(ago: int, subject: str, throttled: int, kind: str = "api_key") -> UsageRecord:
        start = now.replace(second=0) - timedelta(minutes=ago)
        return UsageRecord(period_start=start, subject_kind=kind, subject_id=subject, endpoint="e", throttled=throttled)

    UsageRecord.objects.bulk_create(
        [
            minute(1, "ApiKey:1", 30),
            minute(3, "ApiKey:1", 30),  # 60 in the last five minutes: over
            minute(2, "ApiKey:2", 49),  # under
            minute(9, "ApiKey:2", 40),  # outside the window
            minute(1, "*", 100, kind=OVERFLOW),  # the overflow row: no one customer
        ]
    )
    [notice] = notices.find_refusals(now)
    assert (notice.kind, notice.subject_id, notice.used, notice.threshold) == ("refusals", "ApiKey:1", 60, 50)
    assert notice.period_start == datetime(2026, 12, 7, 10, tzinfo=UTC)
    assert notices.find_refusals(now + timedelta(minutes=2)) == []  # the same hour: said already
    UsageRecord.objects.create(
        period_start=now.replace(minute=58, second=0), subject_kind="api_key", subject_id="ApiKey:1", throttled=50
    )
    assert notices.find_refusals(now.replace(minute=59)) == []  # 80 more, still the 10:00 hour: said already
    [later] = notices.find_refusals(datetime(2026, 12, 7, 11, 0, 30, tzinfo=UTC))  # the next hour, 10:55 on
    assert (later.used, later.period_start) == (50, datetime(2026, 12, 7, 11, tzinfo=UTC))


# -- deliveries --------------------------------------------------------------------------------


def noticed(url: str, *, threshold: int = 80) -> tuple[WebhookEndpoint, Notice]:
    endpoint = WebhookEndpoint.objects.create(subject_kind="api_key", subject_id="ApiKey:7", url=url)
    [notice] = notices.record(crossing_of("ApiKey:7", threshold))
    return endpoint, notice


@pytest.mark.django_db(transaction=True)
def test_a_receiver_down_loses_nothing_and_gets_each_notice_once(fast: None) -> None:
    with Receiver() as receiver:
        receiver.down()
        endpoint, notice = noticed(receiver.url)
        start = timezone.now()
        assert notices.send_due(start) == 0  # refused at connect: retried in 1 s
        assert notices.send_due(start + timedelta(milliseconds=500)) == 0  # not due yet: no attempt
        assert notices.send_due(start + timedelta(seconds=2)) == 0  # the second attempt: then 2 s
        delivery = Delivery.objects.get()
        assert (delivery.state, delivery.attempts) == ("pending", 2)
        assert [a.status for a in DeliveryAttempt.objects.all()] == [None, None]
        receiver.up()  # back, on the same port
        assert notices.send_due(start + timedelta(seconds=3)) == 0  # the wait is 2 s now: not due
        assert notices.send_due(start + timedelta(seconds=5)) == 1
        assert notices.send_due(start + timedelta(minutes=5)) == 0  # delivered: never again
    [got] = receiver.received
    assert verify(endpoint.secret, got.body, got.headers[SIGNATURE_HEADER])
    assert got.headers[EVENT_HEADER] == f"ntc_{notice.pk}"
    sent = json.loads(got.body)
    assert sent == {
        "id": f"ntc_{notice.pk}",
        "type": "quota.threshold",
        "created": notice.created_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "subject": {"kind": "api_key", "id": "ApiKey:7"},
        "data": {
            "policy": "tier:pro:quota",
            "threshold": 80,
            "used": 8,
            "limit": 10,
            "period_start": "2026-12-01T00:00:00Z",
        },
    }
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status) == ("delivered", 3, 204)
    assert [a.status for a in DeliveryAttempt.objects.order_by("at")] == [None, None, 204]


@pytest.mark.django_db(transaction=True)
def test_a_claimed_delivery_is_sent_by_no_other_sweep_until_its_claim_lapses(fast: None) -> None:
    with Receiver() as receiver:
        noticed(receiver.url)
        now = timezone.now()
        Delivery.objects.update(claimed_until=now + timedelta(seconds=10))  # another sender has it
        assert notices.send_due(now) == 0 and receiver.received == []
        assert notices.send_due(now + timedelta(seconds=20)) == 1  # that sender died: its claim lapsed
    assert len(receiver.received) == 1


@pytest.mark.django_db(transaction=True)
def test_a_delivery_is_given_up_after_retry_for_and_an_endpoint_turned_off_gets_nothing(fast: None) -> None:
    with Receiver(status=500) as receiver:
        endpoint, _ = noticed(receiver.url)
        now = timezone.now()
        assert notices.send_due(now) == 0  # a 500: tried again later
        assert notices.send_due(now + timedelta(minutes=2)) == 0  # past RETRY_FOR: given up, not sent
        delivery = Delivery.objects.get()
        assert (delivery.state, delivery.attempts, delivery.last_status) == ("failed", 1, None)
        assert "given up after 1 attempts" in delivery.last_error and len(receiver.received) == 1
        Delivery.objects.update(state="pending", next_attempt_at=now, retry_from=now)  # as "send again" does
        WebhookEndpoint.objects.update(enabled=False)
        assert notices.send_due(now + timedelta(seconds=1)) == 0
    delivery.refresh_from_db()
    assert (delivery.state, delivery.last_error) == ("failed", "the endpoint was disabled")
    assert len(receiver.received) == 1 and endpoint.pk


@pytest.mark.django_db
def test_a_webhook_url_inside_is_refused_on_its_field_unless_allowed(settings: Any) -> None:
    endpoint = WebhookEndpoint(subject_kind="api_key", subject_id=" ApiKey:7 ", url="http://10.0.0.5/hooks")
    with pytest.raises(ValidationError) as refused:
        endpoint.full_clean()
    [message] = refused.value.message_dict["url"]
    assert "is not a public address" in message and "ALLOW_PRIVATE_URLS" in message
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": {"ALLOW_PRIVATE_URLS": True}}})
    endpoint.full_clean()
    assert endpoint.subject_id == "ApiKey:7" and endpoint.secret.startswith("whsec_") and len(endpoint.secret) > 40
    endpoint.save()
    twice = WebhookEndpoint(subject_kind="api_key", subject_id="ApiKey:7", url="http://10.0.0.5/hooks")
    with pytest.raises(ValidationError, match="already exists"):  # every notice would be sent twice
        twice.full_clean()


@pytest.mark.django_db
def test_endpoints_that_nothing_sends_to_are_a_warning(settings: Any) -> None:
    WebhookEndpoint.objects.create(subject_kind="api_key", subject_id="ApiKey:7", url="https://hooks.example/h")
    assert [m.id for m in check_database(databases=["default"]) if m.id == W024] == []
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": False}})
    [warning] = [m for m in check_database(databases=["default"]) if m.id == W024]
    assert "1 webhook endpoint(s) are enabled" in warning.msg


@pytest.mark.django_db(transaction=True)
def test_a_sender_that_overran_its_claim_records_nothing(fast: None) -> None:
    """Only the claim's holder settles a delivery: a late sender cannot undo what the next one did."""
    with Receiver() as receiver:
        noticed(receiver.url)
        assert notices.send_due() == 1
    delivery = Delivery.objects.get()
    notices._settle(delivery, "a-claim-that-lapsed", "pending", 500, "HTTP 500", timezone.now())
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts, delivery.last_status, delivery.claim) == ("delivered", 1, 204, "")


@pytest.mark.django_db(transaction=True)
def test_the_admin_lists_notices_and_each_deliverys_log_and_sends_a_given_up_one_again(
    fast: None, admin_client: Any
) -> None:
    with Receiver(status=500) as receiver:
        _, notice = noticed(receiver.url)
        now = timezone.now()
        notices.send_due(now)
        notices.send_due(now + timedelta(minutes=2))  # past RETRY_FOR: given up
        delivery = Delivery.objects.get()
        assert delivery.state == "failed"
        listing = admin_client.get(reverse("admin:ratelimits_notice_changelist"))
        page = admin_client.get(reverse("admin:ratelimits_delivery_change", args=[delivery.pk]))
        again = admin_client.post(
            reverse("admin:ratelimits_delivery_changelist"),
            {"action": "send_again", "_selected_action": [delivery.pk]},
            follow=True,
        )
        receiver.status = 204  # the customer fixed their receiver
        assert notices.send_due() == 1  # retried for RETRY_FOR from the click: sent at once
    assert listing.status_code == 200 and "0 of 1" in listing.content.decode()  # its one endpoint, not reached
    assert page.status_code == 200 and "HTTP 500" in page.content.decode()  # the log
    assert admin_client.get(reverse("admin:ratelimits_notice_add")).status_code == 403  # the app writes them
    assert "1 deliveries will be sent on the next sweep" in again.content.decode()
    delivery.refresh_from_db()
    assert (delivery.state, delivery.attempts) == ("delivered", 2) and len(receiver.received) == 2
    assert notice.pk


# -- the request path's cost -------------------------------------------------------------------


def commands_of(own_redis: RedisServer, settings: Any, tier: Tier, raw: str, notices_setting: Any) -> dict[str, int]:
    """What Redis ran for 11 requests of one customer of ``tier`` (a quota of 10 a month), by command."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": notices_setting}})
    key = ApiKeyFactory(raw=raw)
    SubjectAssignment.objects.create(subject_kind="api_key", subject_id=f"ApiKey:{key.pk}", tier=tier)
    engine.reset()
    client = client_for(raw)
    assert client.get("/v1/balance").status_code == 200  # scripts loaded, connections made, labels written
    redis = own_redis.client()
    redis.config_resetstat()
    statuses = [client.get("/v1/customers").status_code for _ in range(10)]
    stats = redis.info("commandstats")
    redis.close()
    assert statuses == [200] * 9 + [429]
    calls = {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}
    return {name: n for name, n in calls.items() if name not in ("config|resetstat", "info")}


@pytest.mark.django_db(transaction=True)
def test_notices_cost_no_redis_call(settings: Any, own_redis: RedisServer) -> None:
    """The same traffic, crossing 50%, 80% and 100% of a quota, runs the same commands with notices on or off."""
    tier = Tier.objects.create(name="metered", rate="100/s", burst=100, quota="10/month")
    redis = {"URL": own_redis.url, "SOCKET_TIMEOUT": "2s", "CONNECT_TIMEOUT": "2s"}
    # No leases: when a worker takes and gives back a lease depends on timing, not on notices.
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {"BACKEND": "redis", "REDIS": redis, "POLICIES": {"SOURCE": "database"}, "LOCAL_PATH": {"LEASES": False}},
    )
    on = commands_of(own_redis, settings, tier, "sk_noticed_one", {"QUOTA_THRESHOLDS": [50, 80, 100]})
    assert Notice.objects.count() == 3
    off = commands_of(own_redis, settings, tier, "sk_unnoticed_two", False)
    assert Notice.objects.count() == 3
    assert on == off and on["fcall"] + on.get("evalsha", 0) == 10  # one script call per decision, whatever else


@pytest.mark.django_db
def test_a_bad_notices_setting_never_refuses_a_request(settings: Any) -> None:
    """``manage.py check`` names it (ratelimits.E185); requests are served without notices."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"NOTICES": {"QUOTA_THRESHOLDS": "80"}}})
    ApiKeyFactory(raw="sk_badly_noticed")
    engine.reset()
    assert [client_for("sk_badly_noticed").get("/v1/customers").status_code for _ in range(2)] == [200, 200]
    assert Notice.objects.count() == 0
