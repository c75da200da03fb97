"""The usage report's live minutes: counters not drained yet, read without claiming them, and counted once.

The read (``peek_usage``) runs on every backend: memory, a private Redis and a private Redis
Cluster. The report runs on the memory backend and the private Redis, with real requests counted
by real decisions; the drain then moves them, and the report counts them as rows instead.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.backends.cluster import ClusterBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.counters import ALLOWED, LIMITED, caller_rows, parse_field, usage_for
from ratelimits.engine.breaker import BreakerState
from ratelimits.identity import Subject, SubjectKind
from ratelimits.usage import drain
from ratelimits.usage.live import LIVE_MINUTES, live_minutes, read_live
from ratelimits.usage.subjects import write_pending

from .support.redis_server import free_port
from .support.settings import merged

URL = "/admin/ratelimits/fleetsettings/usage/"
#: A minute since the epoch (2025-02-19 05:20 UTC), far from now: no live minute of a report.
MINUTE = 29_000_000
LIMITS = {"TIERS": {"anonymous": {"rate": "5/m"}, "authenticated": {"rate": "3/m"}}}


def row_of(ip: str, endpoint: str = "ping") -> str:
    """The counter row of an anonymous caller from ``ip`` on ``endpoint``, as a decision counts it."""
    return usage_for(Subject(SubjectKind.IP, ip), None, "anonymous", endpoint, 1).field


def metrics(counts: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    """The metric fields of peeked counters (not the row markers and row counts the stores keep beside them)."""
    return {minute: {f: n for f, n in fields.items() if parse_field(f)} for minute, fields in counts.items()}


# -- the read -----------------------------------------------------------------------------------------


def test_a_peek_reads_the_minutes_asked_for_and_claims_nothing(backend: Any) -> None:
    first, second = row_of("198.51.100.1"), row_of("198.51.100.2")
    backend.add_usage(
        {
            (MINUTE, first + ALLOWED): 3,
            (MINUTE, first + LIMITED): 2,
            (MINUTE + 1, second + ALLOWED): 1,
            (MINUTE - 5, first + ALLOWED): 7,
        }
    )
    peek = backend.peek_usage([MINUTE + 1, MINUTE], 1000)
    assert not peek.truncated
    assert metrics(peek.counts) == {MINUTE: {first + ALLOWED: 3, first + LIMITED: 2}, MINUTE + 1: {second + ALLOWED: 1}}
    assert backend.peek_usage([MINUTE + 1, MINUTE], 1000) == peek  # read, not taken

    # The drain still claims every minute, the ones peeked at too...
    assert sorted({minute for _, minute in backend.claim_usage(MINUTE + 2)}) == [MINUTE - 5, MINUTE, MINUTE + 1]
    # ...and a claimed minute is the drain's: a peek sees only the counts that arrived after the claim.
    assert backend.peek_usage([MINUTE + 1, MINUTE], 1000).counts == {}
    backend.add_usage({(MINUTE, first + ALLOWED): 4})
    assert metrics(backend.peek_usage([MINUTE + 1, MINUTE], 1000).counts) == {MINUTE: {first + ALLOWED: 4}}


def test_a_peek_reads_at_most_max_fields_the_first_minute_first(backend: Any) -> None:
    busy = {(MINUTE, row_of(f"198.51.100.{n}") + ALLOWED): n for n in range(1, 31)}
    earlier = {(MINUTE - 1, row_of(f"203.0.113.{n}") + ALLOWED): 1 for n in range(1, 6)}
    backend.add_usage({**busy, **earlier})

    short = backend.peek_usage([MINUTE, MINUTE - 1], 10)
    assert short.truncated
    assert list(short.counts) == [MINUTE]
    assert 0 < len(short.counts[MINUTE]) <= 10

    whole = backend.peek_usage([MINUTE, MINUTE - 1], 1000)
    assert not whole.truncated
    assert metrics(whole.counts) == {
        MINUTE: {field: n for (_, field), n in busy.items()},
        MINUTE - 1: {field: n for (_, field), n in earlier.items()},
    }


def test_a_peek_for_one_caller_reads_their_rows_alone(backend: Any) -> None:
    """The customer API's read: one caller's rows (every endpoint of theirs), whatever the store holds beside them."""
    mine = [row_of("198.51.100.9", endpoint) for endpoint in ("ping", "charges")]
    others = [row_of("198.51.100.90"), row_of("198.51.100.91", "ping*[x]?")]
    # The prefix is JSON, '["ip","<digest>",': Redis's MATCH must read its "[" literally.
    backend.add_usage({(MINUTE, row + ALLOWED): n + 1 for n, row in enumerate([*mine, *others])})
    prefix = caller_rows(Subject(SubjectKind.IP, "198.51.100.9"))
    if isinstance(backend, ClusterBackend):  # any slot's hash may hold them: not read per caller
        with pytest.raises(NotImplementedError, match="drained so far only"):
            backend.peek_usage([MINUTE], 1000, row_prefix=prefix)
        return
    peek = backend.peek_usage([MINUTE], 1000, row_prefix=prefix)
    assert metrics(peek.counts) == {MINUTE: {mine[0] + ALLOWED: 1, mine[1] + ALLOWED: 2}}
    assert all(field.startswith(prefix) for field in peek.counts[MINUTE])


def test_the_live_minutes_are_the_recent_ones_of_the_range_newest_first() -> None:
    now = MINUTE * 60 + 42.0
    at = datetime.fromtimestamp(MINUTE * 60, tz=UTC)
    assert live_minutes(at - timedelta(hours=3), at + timedelta(hours=1), now) == list(
        range(MINUTE, MINUTE - LIVE_MINUTES, -1)
    )
    assert live_minutes(at - timedelta(minutes=2), at + timedelta(hours=1), now) == [MINUTE, MINUTE - 1, MINUTE - 2]
    assert live_minutes(at - timedelta(minutes=2), at, now) == [MINUTE - 1, MINUTE - 2]  # the end is excluded
    assert live_minutes(at - timedelta(days=3), at - timedelta(days=2), now) == []  # drained long ago


def test_a_store_that_cannot_be_read_leaves_the_live_part_out_and_says_why() -> None:
    dead = RedisBackend(make_client(f"redis://127.0.0.1:{free_port()}/0", 0.5, 0.5))
    now = time.time()
    end = datetime.fromtimestamp(now, tz=UTC)
    live = read_live(end - timedelta(hours=1), end, backend=dead, now=now)
    assert live.rows == ()
    assert len(live.minutes) == LIVE_MINUTES
    assert live.error.startswith("the limiter's store could not be read (")


# -- the report ---------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis", "redis, counted by the worker"])
def store(request: pytest.FixtureRequest, settings: Any) -> str:
    """Decisions counted on the memory backend, or on the private Redis: by the decide script, or
    by the worker and added in one call (``USAGE['FLUSH_EVERY']``; :func:`requests_from` flushes)."""
    if request.param != "memory":
        request.getfixturevalue("use_redis")
    settings.RATELIMITS = {**settings.RATELIMITS, **LIMITS}
    if request.param == "redis, counted by the worker":
        settings.RATELIMITS = {**settings.RATELIMITS, "USAGE": {"FLUSH_EVERY": "60s"}}
    return str(request.param)


def requests_from(ip: str, count: int) -> list[int]:
    """``count`` requests to the test view; their statuses, once their usage is in the store and labelled."""
    client = APIClient(REMOTE_ADDR=ip)
    statuses = [client.get("/t/ping").status_code for _ in range(count)]
    engine.get_limiter().flush_usage(now=True)  # what the worker answered from memory, counted in the store
    write_pending()
    return statuses


def report(admin_client: Client, **params: str) -> dict[str, Any]:
    """The report page's series (rows of totals) and top consumers, as the page has them."""
    response = admin_client.get(URL, params)
    assert response.status_code == 200
    assert response.context["form"].is_valid(), response.context["form"].errors
    sections = {section["table"].name: section["table"] for section in response.context["sections"]}
    series = sections["series"].rows
    return {
        "form": response.context["form"].cleaned_data,
        "html": response.content.decode(),
        "totals": {m: sum(row[m] for row in series) for m in ("requests", "allowed", "throttled", "tokens")},
        "busy_are_live": {bool(row["live"]) for row in series if row["requests"]},
        "live": sum(1 for row in series if row["live"]),
        "consumers": [(r["subject_kind"], r["subject_id"], r["requests"]) for r in sections["top_consumers"].rows],
        "throttled": [(r["subject_id"], r["throttled"]) for r in sections["throttled_subjects"].rows],
    }


@pytest.mark.django_db
def test_minutes_not_drained_are_live_and_once_drained_are_counted_from_their_rows(
    store: str, admin_client: Client
) -> None:
    statuses = requests_from("198.51.100.20", 7)
    assert statuses == [200] * 5 + [429] * 2

    # A fresh install, nothing drained: no parameters give the last hour by minute, all of it live.
    fresh = report(admin_client)
    assert fresh["form"]["granularity"] == "minute"
    assert fresh["form"]["to"] - fresh["form"]["from"] == timedelta(hours=1)
    assert fresh["totals"] == {"requests": 7, "allowed": 5, "throttled": 2, "tokens": 5}
    assert fresh["busy_are_live"] == {True}
    assert fresh["consumers"] == [("ip", "198.51.100.20", 7)]
    assert fresh["throttled"] == [("198.51.100.20", 2)]
    assert 'id="usage-live"' in fresh["html"] and 'data-live="1"' in fresh["html"]
    # By hour, the hour under way is summed too: its minutes are not rolled up, and one is live.
    hourly = report(admin_client, granularity="hour")
    assert hourly["totals"] == fresh["totals"] and hourly["busy_are_live"] == {True}

    # Drained: the same counts, from the minute rows now, and nothing live.
    assert drain(now=time.time() + 120) >= 1
    drained = report(admin_client)
    assert drained["totals"] == fresh["totals"] and drained["consumers"] == fresh["consumers"]
    assert drained["live"] == 0 and 'id="usage-live"' not in drained["html"]

    # Requests after the drain, in a minute it has drained: their counters are live, the drained
    # ones rows, and each request is counted once.
    assert requests_from("198.51.100.21", 3) == [200] * 3
    mixed = report(admin_client)
    assert mixed["totals"] == {"requests": 10, "allowed": 8, "throttled": 2, "tokens": 8}
    assert mixed["consumers"] == [("ip", "198.51.100.20", 7), ("ip", "198.51.100.21", 3)]
    assert mixed["live"] >= 1
    csv_rows = admin_client.get(URL, {"format": "csv"}).content.decode().splitlines()
    assert csv_rows[0].endswith(",Live") and sum(row.endswith(",live") for row in csv_rows) == mixed["live"]


@pytest.mark.django_db
def test_a_worker_that_counts_usage_itself_adds_it_when_due_in_one_call(settings: Any, use_redis: Any) -> None:
    """With ``USAGE['FLUSH_EVERY']`` the decide script counts nothing: the worker counts each
    answer as the script would have (allowed, throttled, tokens) and adds them once due, all in one
    call; a response before then adds nothing."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {**LIMITS, "USAGE": {"FLUSH_EVERY": "60s"}})
    limiter = engine.get_limiter()
    backend = limiter.backend
    client = APIClient(REMOTE_ADDR="198.51.100.30")
    minute = int(time.time() // 60)
    assert [client.get("/t/ping").status_code for _ in range(7)] == [200] * 5 + [429] * 2
    minutes = list(range(minute + 1, minute - 2, -1))  # a minute may have turned meanwhile
    assert backend.peek_usage(minutes, 1000).counts == {}  # each response's flush: not due yet
    calls = backend.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    def counted() -> dict[str, int]:
        found: dict[str, int] = {}
        for fields in metrics(backend.peek_usage(minutes, 1000).counts).values():
            for field, n in fields.items():
                found[field] = found.get(field, 0) + n
        return found

    limiter.flush_usage(now=True)
    row = row_of("198.51.100.30")
    assert counted() == {row + ALLOWED: 5, row + LIMITED: 2}
    assert backend.client.info("commandstats")["cmdstat_evalsha"]["calls"] == calls + 1  # one call, add_usage.lua
    limiter.flush_usage(now=True)  # what was added is taken: nothing is added twice
    assert counted() == {row + ALLOWED: 5, row + LIMITED: 2}


@pytest.mark.django_db
def test_a_worker_that_exits_adds_the_usage_it_counted_even_with_its_breaker_open(
    settings: Any, use_redis: Any
) -> None:
    """The exit hook adds what the worker holds (``USAGE['FLUSH_EVERY']``), though its breaker,
    opened by failures a while ago, keeps the flush after each response from asking the store."""
    from ratelimits.engine import limiter as limiter_module

    settings.RATELIMITS = merged(settings.RATELIMITS, {**LIMITS, "USAGE": {"FLUSH_EVERY": "60s"}})
    limiter = engine.get_limiter()
    client = APIClient(REMOTE_ADDR="198.51.100.31")
    assert [client.get("/t/ping").status_code for _ in range(3)] == [200] * 3
    for _ in range(limiter.breaker.min_calls):
        limiter.breaker.record_failure()
    assert limiter.breaker.state is not BreakerState.CLOSED
    limiter.flush_usage(now=True)  # what a response's flush does now: nothing
    minute = int(time.time() // 60)
    minutes = [minute + 1, minute, minute - 1]
    assert limiter.backend.peek_usage(minutes, 100).counts == {}

    limiter_module._flush_at_exit()
    counted = [fields for fields in metrics(limiter.backend.peek_usage(minutes, 100).counts).values()]
    assert sum(fields.get(row_of("198.51.100.31") + ALLOWED, 0) for fields in counted) == 3


@pytest.mark.django_db
def test_the_report_renders_without_its_live_part_when_the_store_is_down(settings: Any, admin_client: Client) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": f"redis://127.0.0.1:{free_port()}/0"}}
    )
    response = admin_client.get(URL)
    assert response.status_code == 200
    html = response.content.decode()
    warning = html.split('id="usage-live-error"')[1].split("</p>")[0]
    assert "The minutes not drained yet are left out: the limiter&#x27;s store could not be read (" in warning
    assert 'id="usage-chart"' in html
    assert admin_client.get(URL, {"format": "csv"}).status_code == 200
