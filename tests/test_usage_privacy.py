"""No raw identity in Redis: usage counters name callers and organisations by digest only.

Real traffic (API keys of organisations, a logged-in user, anonymous IPv4 and IPv6 clients) goes
through the throttle and the middleware into the private Redis; then every key, field, member and
value in that Redis is read back and searched for the identities. The drain turns the digests back
into the labels staff and customers see.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.backends import layout
from ratelimits.counters import SubjectLabels, usage_for
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import UsageRecord, UsageSubject
from ratelimits.usage import drain, purge_labels
from ratelimits.usage.records import UNRESOLVED
from ratelimits.usage.subjects import KEEP_FOR, write_pending

from .factories import ApiKeyFactory, UserFactory
from .support.redis_server import RedisServer
from .support.settings import merged

pytestmark = pytest.mark.django_db

LIMITS = {
    "TIERS": {"anonymous": {"rate": "100/m"}, "authenticated": {"rate": "100/m"}},
    "DIMENSIONS": {"ip": "1000/m", "org": "1000/m"},
    "IDENTITY": {"ORGANIZATION_FUNC": "project.payments.auth.organization_of"},
}
IPS = ["198.51.100.41", "198.51.100.42", "203.0.113.77"]
IPV6 = "2001:db8:7:7::1"
IPV6_SUBJECT = "2001:db8:7:7::/64"


def everything_stored(client: redis.Redis) -> list[bytes]:
    """Every key name in the server, and everything stored under each: values, fields, members."""
    found: list[bytes] = []
    for key in client.scan_iter(count=1000):
        found.append(key)
        kind = client.type(key)
        if kind == b"string":
            found.append(client.get(key) or b"")
        elif kind == b"hash":
            for field, value in client.hscan_iter(key, count=1000):
                found += [field, value]
        elif kind == b"zset":
            found += [member for member, _ in client.zscan_iter(key, count=1000)]
        elif kind == b"set":
            found += list(client.sscan_iter(key, count=1000))
        else:
            pytest.fail(f"{key!r} is a {kind!r}: read it here too")
    return found


def test_no_raw_identity_is_stored_in_redis_and_the_drained_rows_carry_the_labels(
    settings: Any, use_redis: RedisServer, redis_client: redis.Redis
) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **LIMITS}
    keys = [ApiKeyFactory(raw=f"sk_privacy_{n}", organization=f"org-privacy-{n}") for n in range(2)]
    for n in range(2):
        caller = APIClient(REMOTE_ADDR="192.0.2.200")
        caller.credentials(HTTP_AUTHORIZATION=f"Bearer sk_privacy_{n}")
        assert caller.get("/v1/customers").status_code == 200
    user = UserFactory(username="privacy-user")
    browser = Client(REMOTE_ADDR="192.0.2.201")
    browser.force_login(user)
    assert browser.get("/t/plain").status_code == 200
    for ip in [*IPS, IPV6]:
        assert APIClient(REMOTE_ADDR=ip).get("/t/ping").status_code == 200

    stored = everything_stored(redis_client)
    assert any(b":usage:" in item for item in stored), "the decisions counted usage"
    identities = [
        *IPS,
        IPV6_SUBJECT,
        "192.0.2.200",
        "192.0.2.201",
        *(f"ApiKey:{key.pk}" for key in keys),
        *(key.organization for key in keys),
        user.username,
    ]
    leaks = sorted({(identity, item) for item in stored for identity in identities if identity.encode() in item})
    assert leaks == []

    # The first subjects' labels were written as their responses finished; the rest wait for the
    # pace of about one write a second, and the next request's end would write them.
    assert set(UsageSubject.objects.values_list("kind", "value")) >= {("api_key", f"ApiKey:{keys[0].pk}")}
    write_pending()
    assert drain(now=time.time() + 120) in (1, 2)  # two when the requests fell either side of a minute's end
    rows = {(r.subject_kind, r.subject_id, r.organization, r.endpoint) for r in UsageRecord.objects.all()}
    assert rows == {
        ("api_key", f"ApiKey:{keys[0].pk}", "org-privacy-0", "customers"),
        ("api_key", f"ApiKey:{keys[1].pk}", "org-privacy-1", "customers"),
        ("user", str(user.pk), "", "plain"),
        *{("ip", ip, "", "ping") for ip in [*IPS, IPV6_SUBJECT]},
    }
    # The customer usage API finds the caller's own rows by its raw identity.
    caller = APIClient()
    caller.credentials(HTTP_AUTHORIZATION="Bearer sk_privacy_0")
    listed = caller.get("/v1/usage?granularity=minute").json()
    # The drained row, and this very call, counted live (reading usage is itself a request counted).
    assert [(r["endpoint"], r["allowed"], r["live"]) for r in listed["results"]] == [
        ("customers", 1, False),
        ("usage", 1, True),
    ]


def test_labels_are_written_at_once_at_first_then_about_once_a_second() -> None:
    now = [0.0]
    labels = SubjectLabels(clock=lambda: now[0])
    subjects = [Subject(SubjectKind.IP, f"192.0.2.{n}") for n in range(SubjectLabels.BURST + 2)]
    for subject in subjects[: SubjectLabels.BURST]:
        labels.note(subject)
        assert labels.due() == {subject.digest: ("ip", subject.value)}
    labels.done({s.digest: ("ip", s.value) for s in subjects[: SubjectLabels.BURST]})
    labels.note(subjects[0])  # written already: not noted again
    labels.note(subjects[-2])
    labels.note(subjects[-1])
    assert labels.due() == {}  # the burst is spent: the next write waits about a second
    now[0] += SubjectLabels.INTERVAL_S
    assert set(labels.due()) == {subjects[-2].digest, subjects[-1].digest}
    # Many waiting are written whatever the pace.
    many = [Subject(SubjectKind.USER, str(n)) for n in range(SubjectLabels.BATCH)]
    for subject in many:
        labels.note(subject)
    assert len(labels.due()) == SubjectLabels.BATCH


def test_a_subject_counted_all_along_is_written_again_after_an_hour() -> None:
    """So its label's last_seen stays fresh, and purging never takes the label of a live subject."""
    now = [0.0]
    labels = SubjectLabels(clock=lambda: now[0])
    subject = Subject(SubjectKind.API_KEY, "ApiKey:7")
    labels.note(subject)
    labels.done(labels.due())
    labels.note(subject)
    assert labels.due() == {}  # written already
    now[0] += SubjectLabels.REFRESH_S + 1
    assert labels.due() == {}  # the response after the hour forgets what was written...
    labels.note(subject)
    assert labels.due() == {subject.digest: ("api_key", "ApiKey:7")}  # ...and the subject's next request notes it
    assert timedelta(seconds=SubjectLabels.REFRESH_S + layout.USAGE_TTL_S) < KEEP_FOR


def test_labels_are_bounded_and_given_up_after_failing_a_few_times() -> None:
    now = [0.0]
    labels = SubjectLabels(clock=lambda: now[0])
    labels.PENDING_MAX = 3
    for n in range(5):
        labels.note(Subject(SubjectKind.IP, f"192.0.2.{n}"))
    assert len(labels.pending) == 3
    labels.note(Subject(SubjectKind.ORG, "x" * (SubjectLabels.VALUE_MAX + 1)))  # too long for the table
    due = labels.take()
    assert len(due) == 3
    for attempt in range(1, SubjectLabels.ATTEMPTS):
        assert labels.failed(due) == 0  # kept for a later try...
        assert labels.due() == {}  # ...not before RETRY_AFTER_S
        now[0] += SubjectLabels.RETRY_AFTER_S
        due = labels.due()
        assert len(due) == 3, attempt
    assert labels.failed(due) == 3  # given up: their counts stay under their digests
    assert labels.pending == {}


def test_a_failed_label_write_never_fails_the_response_and_is_tried_again(
    settings: Any, use_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **LIMITS}
    table = UsageSubject._meta.db_table
    with connection.cursor() as cursor:  # the database refuses the write: the table is not there
        cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        with caplog.at_level(logging.WARNING, logger="ratelimits"):
            assert APIClient(REMOTE_ADDR="198.51.100.90").get("/t/ping").status_code == 200
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
    assert any("usage subject labels not written" in r.getMessage() for r in caplog.records)
    assert write_pending() == 1  # a later response writes it
    assert UsageSubject.objects.get(value="198.51.100.90").kind == "ip"
    assert drain(now=time.time() + 120) == 1
    assert UsageRecord.objects.get().subject_id == "198.51.100.90"


def test_a_subject_without_a_label_is_recorded_under_its_digest_and_logged(
    settings: Any, use_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **LIMITS}
    for ip in ("198.51.100.91", "198.51.100.92"):
        assert APIClient(REMOTE_ADDR=ip).get("/t/ping").status_code == 200
    write_pending()
    UsageSubject.objects.filter(value="198.51.100.92").delete()  # as if its writes had failed for good
    with caplog.at_level(logging.WARNING, logger="ratelimits"):
        # One minute drained, or two when the requests fell either side of a minute's end (CI met one).
        assert drain(now=time.time() + 120) in (1, 2)
    digest = Subject(SubjectKind.IP, "198.51.100.92").digest
    assert {(r.subject_id, r.allowed) for r in UsageRecord.objects.all()} == {
        ("198.51.100.91", 1),
        (f"{UNRESOLVED}{digest}", 1),
    }
    assert any("1 subjects of usage minute" in r.getMessage() for r in caplog.records)


def test_labels_no_counter_can_name_any_more_are_purged() -> None:
    now = timezone.now()
    UsageSubject.objects.create(digest="old", kind="ip", value="192.0.2.1", last_seen=now - KEEP_FOR - timedelta(1))
    UsageSubject.objects.create(digest="recent", kind="ip", value="192.0.2.2", last_seen=now - KEEP_FOR + timedelta(1))
    assert purge_labels(now=now) == 1
    # (Threads of other tests count, and write labels outside their tests' transactions: only these two are ours.)
    assert list(UsageSubject.objects.filter(digest__in=["old", "recent"]).values_list("digest", flat=True)) == [
        "recent"
    ]
    assert timedelta(seconds=layout.USAGE_TTL_S) < KEEP_FOR


def test_a_subject_under_two_digests_in_one_minute_is_one_row(settings: Any, use_redis: RedisServer) -> None:
    """The hash key changed within the minute: its counters name the subject twice, its row once."""
    ip, minute = "198.51.100.93", int(time.time() // 60) - 3
    counts = {}
    for hash_key in ("first-hash-key", "second-hash-key"):
        settings.RATELIMITS = merged(settings.RATELIMITS, {"IDENTITY": {"HASH_KEY": hash_key}})
        counts[(minute, usage_for(Subject(SubjectKind.IP, ip), None, "", "ping", 1).field + "a")] = 2
        write_pending()
    assert len(counts) == 2
    engine.get_limiter().backend.add_usage(counts)
    assert drain(now=time.time()) == 1
    assert [(r.subject_id, r.allowed, r.tokens) for r in UsageRecord.objects.all()] == [(ip, 4, 4)]
