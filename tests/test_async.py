"""Async views decided on the event loop: the 429 contract, slots, usage, the breaker and fail modes.

Every request goes through Django's ASGI handler (``AsyncClient``) to async views: a plain one
with ``@ratelimit``, one limited by ``RateLimitMiddleware`` in async mode, and an adrf view with
``AsyncRateLimitThrottle``. The store is a real redis-server, asked with ``redis.asyncio`` on one
long-lived event loop (in a thread of its own, as an ASGI server's). The ASGI handler runs a
request's sync parts (a DRF authentication's query) in threads with connections of their own:
tests with API keys commit them (``transaction=True``).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import http.client
import json
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
import pytest
import redis
from asgiref.sync import SyncToAsync, async_to_sync, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.test import AsyncClient

from ratelimits import engine, usage
from ratelimits.algorithms import Algorithm
from ratelimits.backends import aio
from ratelimits.backends.aio import AsyncClients, async_pool_factory
from ratelimits.backends.base import in_thread, store_threads
from ratelimits.backends.redis import DECIDE, RedisBackend, make_client
from ratelimits.choices import FailMode
from ratelimits.conf import LocalPathSettings
from ratelimits.engine import evaluation
from ratelimits.engine.breaker import BreakerState, CircuitBreaker
from ratelimits.engine.limiter import build_limiter
from ratelimits.engine.local import LEASE
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import Notice, UsageRecord
from ratelimits.policies import Check, concurrency_policy
from ratelimits.store.database import DatabasePolicySource

from .factories import ApiKeyFactory
from .support.aio import CALL_TIMEOUT_S, EventLoopThread, asgi_get, event_loop_thread
from .support.bursts import close_thread_connections, in_flight
from .support.demo import demo_server
from .support.gate import Gate
from .support.http import HTTP_TIMEOUT, Reply, fetch
from .support.polling import wait_until
from .support.redis_server import RedisServer, script_calls
from .support.settings import merged
from .test_local_path import check as local_check
from .test_local_path import limiter_on
from .test_metrics import scrape, total

pytestmark = pytest.mark.django_db

T = TypeVar("T")

BASE = {
    "TIERS": {"free": {"rate": "3/s"}, "anon": {"rate": "3/s"}},
    "POLICIES": {
        "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
}


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    """One event loop for the module's requests, running as long as an ASGI server's does."""
    with event_loop_thread() as running:
        yield running
    # The database connections the requests' threads opened: asgiref's one thread for sync work
    # outside a request context keeps its own, and those of threads that ended wait for the
    # collector. Closed here, or PostgreSQL refuses to drop the test database at the end.
    SyncToAsync.single_thread_executor.submit(close_thread_connections).result(CALL_TIMEOUT_S)
    gc.collect()


@pytest.fixture(autouse=True)
def _serving(loop: EventLoopThread) -> Iterator[None]:
    global _loop
    _loop = loop
    yield
    _loop = None


_loop: EventLoopThread | None = None


def run(scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``scenario`` on the module's long-lived loop (``redis.asyncio`` is used on such a loop)."""
    assert _loop is not None
    return _loop.run(scenario())


def burst(path: str, count: int, **headers: str) -> list[Any]:
    async def scenario() -> list[Any]:
        client = AsyncClient()
        return [await client.get(path, headers=headers) for _ in range(count)]

    return run(scenario)


@pytest.fixture
def limits(settings: Any, use_redis: RedisServer) -> dict[str, Any]:
    settings.RATELIMITS = {**settings.RATELIMITS, **BASE}
    return settings.RATELIMITS  # type: ignore[no-any-return]


def test_an_async_view_gets_the_429_contract_decided_on_the_event_loop(limits: Any) -> None:
    responses = burst("/t/async/plain", 5)
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
    ok, denied = responses[0], responses[3]
    assert ok.content == b"async plain ok"
    assert ok["RateLimit"] == '"tier:anon";r=2;t=1'
    assert ok["X-RateLimit-Remaining"] == "2"
    assert denied["Content-Type"] == "application/problem+json"
    assert int(denied["Retry-After"]) >= 1
    body = json.loads(denied.content)
    assert body["status"] == 429 and body["violated-policies"] == ["tier:anon"]
    assert denied["RateLimit"].startswith('"tier:anon";r=0;')
    # Decided with redis.asyncio on the request's loop, not in a thread.
    backend = engine.get_limiter().backend
    assert isinstance(backend, RedisBackend) and isinstance(backend._async, AsyncClients)


def test_sync_and_async_views_decide_alike(limits: Any) -> None:
    def shape(response: Any) -> tuple[Any, ...]:
        return (response.status_code, response.get("RateLimit-Policy"), response.get("X-RateLimit-Limit"))

    sync = [shape(r) for r in burst("/t/plain", 5)]
    engine.get_limiter().backend.client.flushdb()
    engine.reset()
    asynchronous = [shape(r) for r in burst("/t/async/plain", 5)]
    assert asynchronous == sync


def test_the_middleware_limits_async_views_and_leaves_drf_to_its_throttle(settings: Any, limits: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "ratelimits.middleware.RateLimitMiddleware"]

    async def scenario() -> list[int]:
        client = AsyncClient()
        statuses = [(await client.get("/t/ping")).status_code for _ in range(2)]
        statuses += [(await client.get("/t/async/unmarked")).status_code for _ in range(2)]
        return statuses

    # One tier bucket of 3 for the caller: two DRF requests charged once each, then the plain view.
    assert run(scenario) == [200, 200, 200, 429]


@pytest.mark.django_db(transaction=True)
def test_an_adrf_view_with_the_async_throttle(limits: Any) -> None:
    ApiKeyFactory(raw="sk_free_async", tier="free")
    responses = burst("/t/async/ping", 5, authorization="Bearer sk_free_async")
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
    assert responses[0]["X-RateLimit-Resource"] == "tier:free"
    denied = responses[-1]
    assert denied["Content-Type"] == "application/problem+json"
    assert json.loads(denied.content)["violated-policies"] == ["tier:free"]


@pytest.mark.django_db(transaction=True)
def test_an_async_views_quota_crossings_are_noticed_off_the_loop(settings: Any, limits: Any) -> None:
    """The crossings are seen on the loop, in memory; their rows are written after each response,
    in a thread (Django's async ``request_finished``), never a query on the loop."""
    tiers = {**BASE["TIERS"], "anon": {"rate": "1000/s", "quota": "5/month"}}
    settings.RATELIMITS = {**limits, "TIERS": tiers, "USAGE": {"NOTICES": {"QUOTA_THRESHOLDS": [60, 100]}}}
    responses = burst("/t/async/plain", 7)
    assert [r.status_code for r in responses] == [200] * 5 + [429] * 2
    rows = list(Notice.objects.order_by("threshold").values_list("subject_kind", "policy", "threshold", "used"))
    assert rows == [("ip", "tier:anon:quota", 60, 3), ("ip", "tier:anon:quota", 100, 5)]


def test_slots_are_held_while_an_async_view_runs_and_released_after(settings: Any, limits: Any, gate: Gate) -> None:
    settings.RATELIMITS = {**limits, "TIERS": {**BASE["TIERS"], "anon": {"rate": "1000/s", "concurrency": 2}}}

    async def scenario() -> tuple[list[int], int, int]:
        client = AsyncClient()
        held = [asyncio.ensure_future(client.get("/t/async/gated")) for _ in range(2)]
        assert await sync_to_async(gate.wait_inside, thread_sensitive=False)(2)
        inside = await sync_to_async(in_flight, thread_sensitive=False)(backend(), concurrency())
        third = (await client.get("/t/async/gated")).status_code
        gate.open()
        statuses = [(await request).status_code for request in held] + [third]
        after = await sync_to_async(in_flight, thread_sensitive=False)(backend(), concurrency())
        return statuses, inside, after

    def backend() -> Any:
        return engine.get_limiter().backend

    def concurrency() -> Check:
        from django.test import RequestFactory

        from ratelimits.identity import identify

        request = RequestFactory().get("/t/async/gated")
        identity = identify(request, endpoint="async-gated")
        checks = engine.get_policy_source().checks_for(request, identity)
        (found,) = [c for c in checks if c.policy.holds_slots]
        return found

    statuses, inside, after = run(scenario)
    assert statuses == [200, 200, 429]
    assert (inside, after) == (2, 0)


def concurrency_check(path: str, endpoint: str) -> Check:
    """The concurrency check an anonymous request to ``path`` gets."""
    (found,) = [c for c in limiter_checks(path, endpoint) if c.policy.holds_slots]
    return found


def status_of(sent: list[dict[str, Any]]) -> int | None:
    """The status an ASGI response started with (``None``: no response was started)."""
    starts = [message["status"] for message in sent if message["type"] == "http.response.start"]
    return starts[0] if starts else None


def one_at_a_time(limits: dict[str, Any]) -> dict[str, Any]:
    """``limits`` with an anonymous concurrency of 1 and a worker shedder: a leak refuses the next request."""
    anon = {"rate": "1000/s", "concurrency": 1}
    return merged(limits, {"TIERS": {**BASE["TIERS"], "anon": anon}, "SHEDDING": {"WORKER_CAPACITY": 4}})


def test_under_an_asgi_server_each_response_gives_its_slots_back(settings: Any, limits: Any) -> None:
    """As under uvicorn, not AsyncClient: the handler closes each response from its own context."""
    settings.RATELIMITS = one_at_a_time(limits)

    async def scenario() -> list[int | None]:
        app = ASGIHandler()
        return [status_of(await asgi_get(app, path)) for path in ["/t/async/plain", "/t/ping"] * 3]

    assert run(scenario) == [200] * 6  # an async view, then a sync DRF one, in turn
    assert in_flight(engine.get_limiter().backend, concurrency_check("/t/async/plain", "async-plain")) == 0
    shedder = engine.get_worker_shedder()
    assert shedder is not None and shedder.in_flight == 0


def test_a_client_that_goes_away_mid_view_leaves_no_slot_behind(settings: Any, limits: Any, gate: Gate) -> None:
    """Django cancels the view and closes no response: the request's slot and its place in the
    worker shedder are given back by the request_finished it sends (in the request's context)."""
    settings.RATELIMITS = one_at_a_time(limits)
    check = concurrency_check("/t/async/gated", "async-gated")
    backend = engine.get_limiter().backend

    async def scenario() -> tuple[int, list[dict[str, Any]]]:
        app = ASGIHandler()
        gone = asyncio.Event()
        request = asyncio.ensure_future(asgi_get(app, "/t/async/gated", disconnect=gone))
        assert await sync_to_async(gate.wait_inside, thread_sensitive=False)(1)
        inside = await sync_to_async(in_flight, thread_sensitive=False)(backend, check)
        gone.set()
        return inside, await request

    inside, sent = run(scenario)
    assert inside == 1
    assert status_of(sent) is None  # the view was cancelled: no response
    # Released by Django's request_finished, before the handler returned.
    shedder = engine.get_worker_shedder()
    assert shedder is not None
    assert (slots_taken(backend, check), shedder.in_flight) == (0, 0)
    gate.open()
    assert status_of(run(lambda: asgi_get(ASGIHandler(), "/t/async/gated"))) == 200
    assert in_flight(backend, check) == 0


def test_a_request_no_response_closes_gives_its_slots_back_once_collected(settings: Any, limits: Any) -> None:
    from django.test import RequestFactory

    settings.RATELIMITS = one_at_a_time(limits)
    check = concurrency_check("/t/plain", "plain")
    backend = engine.get_limiter().backend
    request = RequestFactory().get("/t/plain")
    _, decision = evaluation.evaluate(request, endpoint="plain")
    shedder = engine.get_worker_shedder()
    assert shedder is not None
    assert decision.allowed and (slots_taken(backend, check), shedder.in_flight) == (1, 1)
    del request, decision
    gc.collect()  # the request's close wrapper and the request refer to each other
    # Released by the releasing thread, which the finalizer only hands the list to.
    assert wait_until(lambda: (slots_taken(backend, check), shedder.in_flight) == (0, 0), 5.0)


def test_a_streaming_response_under_wsgi_holds_its_slot_until_its_body_is_sent(settings: Any, limits: Any) -> None:
    """Nothing but the response keeps the request alive once the handler returned: a collection
    mid-stream must not release the slot (Django's test Client would keep the request itself)."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import RequestFactory

    settings.RATELIMITS = one_at_a_time(limits)
    check = concurrency_check("/t/streaming", "streaming")
    backend = engine.get_limiter().backend
    environ = RequestFactory().get("/t/streaming").environ
    statuses: list[str] = []
    body = WSGIHandler()(environ, lambda status, headers: statuses.append(status))
    chunks = iter(body)
    first = next(chunks)
    gc.collect()
    during = slots_taken(backend, check)
    rest = b"".join(chunks)
    body.close()
    assert statuses == ["200 OK"] and first + rest == b"one two three"
    assert (during, slots_taken(backend, check)) == (1, 0)


def slots_taken(backend: Any, check: Check) -> int:
    """The slots in ``check``'s key, read in one command (a release made meanwhile cannot split it)."""
    return int(backend.client.zcard(check.key(backend.prefix)))


@pytest.mark.parametrize("counted_by", ["script", "worker"])
def test_async_decisions_are_counted_in_usage(settings: Any, limits: Any, counted_by: str) -> None:
    """Counted by the decide script, or (``USAGE['FLUSH_EVERY']``) by the worker, as the store answered."""
    if counted_by == "worker":
        settings.RATELIMITS = {**limits, "USAGE": {"FLUSH_EVERY": "60s"}}
    statuses = [r.status_code for r in burst("/t/async/plain", 5)]
    store = engine.get_limiter().backend
    now = int(time.time() // 60)
    in_store = store.peek_usage([now + 1, now, now - 1], 100).counts
    assert bool(in_store) is (counted_by == "script")
    # The last 429 was answered from this worker's memory of the first: counted here, added to the
    # store's counters within a second, or now.
    engine.get_limiter().flush_usage(now=True)
    minute = int(time.time() // 60)
    assert usage.drain(now=(minute + 2) * 60.0) >= 1
    rows = UsageRecord.objects.filter(granularity="minute", endpoint="async-plain")
    assert sum(row.allowed for row in rows) == statuses.count(200) == 3
    assert sum(row.throttled for row in rows) == statuses.count(429) == 2


@pytest.mark.django_db(transaction=True)
def test_a_dead_store_fails_open_and_closed_by_policy_and_opens_the_breaker(
    settings: Any, own_redis: RedisServer
) -> None:
    settings.RATELIMITS = merged(
        merged(settings.RATELIMITS, BASE),
        {
            "TIERS": {"free": {"rate": "100/s", "fail_mode": "closed"}, "anon": {"rate": "100/s"}},
            "BACKEND": "redis",
            "REDIS": {"URL": own_redis.url},
            "FAILURE": {"BREAKER_MIN_CALLS": 2, "BREAKER_COOLDOWN": "30s"},
        },
    )
    ApiKeyFactory(raw="sk_free_closed", tier="free")
    assert [r.status_code for r in burst("/t/async/plain", 1)] == [200]
    own_redis.kill()
    anonymous = burst("/t/async/plain", 3)
    assert [r.status_code for r in anonymous] == [200, 200, 200]
    assert all(r["X-RateLimit-Degraded"] == "1" for r in anonymous)
    assert engine.get_limiter().breaker.state is BreakerState.OPEN
    closed = burst("/t/async/ping", 2, authorization="Bearer sk_free_closed")
    assert [r.status_code for r in closed] == [503, 503]
    assert closed[0]["Content-Type"] == "application/problem+json"
    assert 1 <= int(closed[0]["Retry-After"]) <= 30


def test_a_stalled_store_never_blocks_the_event_loop(settings: Any, own_redis: RedisServer) -> None:
    settings.RATELIMITS = merged(
        merged(settings.RATELIMITS, BASE),
        {"BACKEND": "redis", "REDIS": {"URL": own_redis.url, "SOCKET_TIMEOUT": "400ms"}},
    )
    assert [r.status_code for r in burst("/t/async/plain", 1)] == [200]
    limiter = engine.get_limiter()
    (check,) = [Check(c.policy, c.subject, c.cost) for c in limiter_checks("/t/async/plain", "async-plain")]
    own_redis.pause()  # SIGSTOP: the connection stays open, nothing answers

    async def scenario() -> tuple[Any, int, float]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)  # the loop's heartbeat, counted while the decision waits
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        started = time.monotonic()
        decision = await limiter.adecide([check])
        waited = time.monotonic() - started
        ticker.cancel()
        return decision, ticks, waited

    try:
        decision, ticks, waited = run(scenario)
    finally:
        own_redis.resume()
    assert decision.allowed and decision.degraded  # failed open once the socket timed out
    assert waited >= 0.35
    # A blocked loop would not have ticked; a free one ticks about every 5 ms of the wait.
    assert ticks >= 0.5 * waited / 0.005, (ticks, waited)


def test_a_loop_made_for_one_call_asks_synchronously_and_keeps_no_client(
    limits: Any, redis_server: RedisServer
) -> None:
    """async_to_sync (an async view under WSGI) makes a loop per call: no connection is made for it."""
    assert burst("/t/async/plain", 1)[0].status_code == 200  # the long-lived loop's client
    backend = engine.get_limiter().backend
    assert isinstance(backend._async, AsyncClients)
    connected = redis_server.client().info("clients")["connected_clients"]
    (check,) = limiter_checks("/t/async/plain", "async-plain")
    decisions = [async_to_sync(engine.get_limiter().adecide)([check]) for _ in range(30)]
    assert all(decision.allowed for decision in decisions[:2])
    assert len(backend._async._clients) == 1
    assert (
        redis_server.client().info("clients")["connected_clients"] <= connected + 2
    )  # a thread or two of the executor


def limiter_checks(path: str, endpoint: str) -> list[Check]:
    """The checks an anonymous request to ``path`` gets, as the policy source makes them."""
    from django.test import RequestFactory

    from ratelimits.identity import identify

    request = RequestFactory().get(path)
    return engine.get_policy_source().checks_for(request, identify(request, endpoint=endpoint))


def test_async_connections_are_made_like_the_sync_ones(redis_server: RedisServer) -> None:
    client = make_client(redis_server.url, 0.25, 0.5)
    factory = async_pool_factory(client.connection_pool, (0.1, 0.2))
    assert factory is not None
    pool = factory()
    assert pool.connection_kwargs["socket_timeout"] == 0.1
    assert pool.connection_kwargs["socket_connect_timeout"] == 0.2
    assert pool.connection_kwargs["port"] == redis_server.port
    assert pool.connection_kwargs["retry"].get_retries() == 0
    # A burst waits for one of 64 connections, as long as a connect may take (else POOL_WAIT_S).
    assert (pool.max_connections, pool.timeout) == (aio.MAX_CONNECTIONS, 0.2)
    untimed_client = redis.Redis(port=redis_server.port, socket_timeout=None, socket_connect_timeout=None)
    untimed = async_pool_factory(untimed_client.connection_pool, None)
    assert untimed is not None and untimed().timeout == aio.POOL_WAIT_S
    sentinel = make_client(f"redis+sentinel://127.0.0.1:{redis_server.port}/mymaster", 0.25, 0.5)
    assert async_pool_factory(sentinel.connection_pool, None) is None  # asked from a thread instead


# -- the demo under an ASGI server ---------------------------------------------------------------

ACME_KEY = "sk_free_demo_acme_0000000000"
#: The demo's free tier is 25/s, burst 50 (ratelimits/migrations/0002_seed_tiers.py): the uvicorn test
#: lowers it to this first, as an admin would, so that its requests outrun the refill on any machine.
FREE_RATE, FREE_BURST = 5, 20
VERSION_KEY = "rl:policy-version"


def lower_the_free_tier(demo: Any) -> None:
    """The free tier at FREE_RATE and FREE_BURST in the demo's tables, published as a commit in the admin would."""
    with psycopg.connect(demo.database_url, autocommit=True) as editor:
        editor.execute(
            "UPDATE ratelimits_tier SET rate = %s, burst = %s WHERE name = 'free'", [f"{FREE_RATE}/s", FREE_BURST]
        )
        editor.execute("UPDATE ratelimits_policyversion SET value = value + 1 WHERE id = 1")
        version = editor.execute("SELECT value FROM ratelimits_policyversion WHERE id = 1").fetchone()
    assert version is not None
    client = demo.redis.client()
    try:
        client.set(VERSION_KEY, str(version[0]))
    finally:
        client.close()


def free_limit(port: int, headers: dict[str, str]) -> int | None:
    """The free tier's limit as ``/v1/rate_limit`` reports it to the caller."""
    reply = fetch(port, "GET", "/v1/rate_limit", headers=headers)
    if reply.status != 200:
        return None
    return next((r["limit"] for r in reply.json()["resources"] if r["policy"] == "tier:free"), None)


def kept_alive_gets(port: int, path: str, headers: dict[str, str], count: int) -> list[Reply]:
    """``count`` GETs one after another on one kept-alive connection (none set up per request)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    try:
        replies = []
        for _ in range(count):
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
            replies.append(Reply(response.status, response.headers, response.read()))
        return replies
    finally:
        connection.close()


@pytest.mark.slow
def test_the_demo_under_uvicorn_limits_its_async_and_sync_views() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="ratelimits-asgi-metrics-") as directory,
        demo_server("asgi", workers=1, asgi=True, env={"PROMETHEUS_MULTIPROC_DIR": directory}) as demo,
    ):
        auth = {"Authorization": f"Bearer {ACME_KEY}"}
        lower_the_free_tier(demo)
        # Applied once the status endpoint (which spends nothing) shows the new burst: a bounded poll.
        assert wait_until(lambda: free_limit(demo.port, auth) == FREE_BURST, 10.0), "the tier change never applied"
        started = time.monotonic()
        replies = kept_alive_gets(demo.port, "/v1/balance", auth, 300)
        elapsed = time.monotonic() - started
        statuses = collections.Counter(reply.status for reply in replies)
        print(f"\n300 requests on one connection in {elapsed:.2f} s: {dict(statuses)}")
        # 300 requests outrun the refill unless they take (300 - 21) / 5 = 56 s, 186 ms each. On one
        # connection kept alive they took 3 s with both cores hogged (most are 429s, quicker than a
        # 200): over 10x the room. (At the seeded 25/s they had to take under 10 s, 33 ms each, and
        # with the hogs took 14 s.)
        assert set(statuses) == {200, 429}, (statuses, elapsed)
        # Exact, as on the sync path: at most the burst and what refilled meanwhile (+1 for rounding).
        assert FREE_BURST <= statuses[200] <= FREE_BURST + FREE_RATE * elapsed + 1
        ok = next(reply for reply in replies if reply.status == 200)
        assert ok.json().keys() == {"amount", "charges"}
        assert '"tier:free"' in ok.headers["RateLimit-Policy"] and ok.headers["X-RateLimit-Limit"] == str(FREE_BURST)
        denied = [reply for reply in replies if reply.status == 429]
        print(
            "DEBUG",
            [
                (r.status, r.headers.get("X-RateLimit-Degraded"), r.headers.get("X-RateLimit-Local"))
                for r in replies[:60]
            ],
            denied[0].json() if denied else None,
        )
        assert all(reply.headers["Content-Type"] == "application/problem+json" for reply in denied)
        assert all(int(reply.headers["Retry-After"]) >= 1 for reply in denied)
        # The free tier runs 2 requests at once: a slot an async request failed to give back would
        # soon refuse every request for concurrency. None did.
        assert {tuple(reply.json()["violated-policies"]) for reply in denied} == {("tier:free",)}

        # A sync DRF view under the same server, in a thread of the ASGI handler.
        customers = fetch(
            demo.port, "GET", "/v1/customers", headers={"Authorization": "Bearer sk_std_demo_globex_000000000"}
        )
        assert customers.status == 200 and "RateLimit" in customers.headers

        samples = scrape(fetch(demo.port, "GET", "/metrics").text)
        decided = {
            verdict: total(samples, "ratelimits_decisions_total", endpoint="balance", verdict=verdict)
            for verdict in ("allow", "limited")
        }
        assert decided == {"allow": statuses[200], "limited": statuses[429]}


# -- the limiter's async path beside its sync one -------------------------------------------------


def test_leases_on_the_async_path_spend_tokens_taken_from_the_store(own_redis: RedisServer) -> None:
    limiter = limiter_on(own_redis, prefix="alease", local=LocalPathSettings(leases=True, lease_share=0.25))
    hot = local_check("hot", "1000/s", 200, Algorithm.TOKEN_BUCKET, "hana")
    own_redis.client().config_resetstat()

    async def scenario() -> tuple[list[Any], float]:
        decisions = []
        started = time.monotonic()
        for _ in range(400):
            decisions.append(await limiter.adecide([hot]))
            await asyncio.sleep(1 / 800)  # about 80 % of the rate: paced, never caught up in a burst
        return decisions, time.monotonic() - started

    decisions, elapsed = run(scenario)
    leased = [d for d in decisions if d.local == LEASE]
    calls = script_calls(own_redis)
    assert len(leased) > 0.5 * len(decisions), limiter.local_path.counts if limiter.local_path else None
    assert calls < 0.25 * len(decisions)
    assert sum(d.allowed for d in decisions) <= 200 + 1000 * elapsed + 1
    assert all(d.allowed for d in decisions)


def test_a_policy_the_store_cannot_decide_goes_by_its_fail_mode_on_the_async_path(own_redis: RedisServer) -> None:
    limiter = limiter_on(own_redis, prefix="afail", local=None)
    broken = local_check("broken", "10/s", 10, Algorithm.TOKEN_BUCKET, "ivan")
    sound = local_check("sound", "10/s", 2, Algorithm.TOKEN_BUCKET, "ivan")
    own_redis.client().hset(broken.key("afail"), "not", "a bucket")  # a key of another type: WRONGTYPE

    async def scenario() -> list[Any]:
        return [await limiter.adecide([broken, sound]) for _ in range(3)]

    decisions = run(scenario)
    # The broken check fails open (left out); the sound one is still decided by the store.
    assert [d.allowed for d in decisions] == [True, True, False]
    assert [r.check.policy.name for r in decisions[-1].violated] == ["sound"]
    assert limiter.breaker.state is BreakerState.CLOSED  # a bad policy is not an outage


@pytest.mark.parametrize("refused", [False, True], ids=["lost", "refused"])
def test_a_lost_or_refused_function_on_the_async_path_decides_the_same(own_redis: RedisServer, refused: bool) -> None:
    """The event loop's client reloads a library the store lost, and sends the script to a store
    that refuses Functions (an ACL here): either way each call is decided once, exactly."""
    url = own_redis.url
    if refused:
        own_redis.client().acl_setuser(
            "scripts", enabled=True, nopass=True, keys=["*"], channels=["*"], commands=["+@all", "-fcall", "-function"]
        )
        url = f"redis://scripts@127.0.0.1:{own_redis.port}/0"
    backend = RedisBackend(make_client(url, 2.0, 2.0), prefix="afunction")
    check = local_check("lost", "3/m", 3, Algorithm.TOKEN_BUCKET, "lena")

    async def scenario() -> list[int]:
        remaining = [(await backend.adecide([check])).results[0].remaining]
        own_redis.client().function_flush()
        remaining += [(await backend.adecide([check])).results[0].remaining for _ in range(3)]
        return remaining

    assert run(scenario) == [2, 1, 0, 0]
    assert backend.functions.enabled is not refused
    assert bool(own_redis.client().function_list(library=DECIDE.function)) is not refused


def test_a_timed_out_async_decision_hands_back_the_slot_it_may_have_taken(own_redis: RedisServer) -> None:
    client = make_client(own_redis.url, 0.2, 0.5)
    backend = RedisBackend(client, prefix="astray")
    slots = Check(concurrency_policy("slots", 2, fail_mode=FailMode.OPEN), Subject(SubjectKind.API_KEY, "jon"))
    own_redis.pause()

    async def scenario() -> BaseException:
        try:
            await backend.adecide([slots])
        except BackendUnavailable as exc:
            return exc
        raise AssertionError("a paused store answered")

    try:
        failure = run(scenario)
    finally:
        own_redis.resume()
    assert isinstance(failure, BackendUnavailable)
    assert failure.stray_slot is not None and failure.stray_slot[1] == (slots.key("astray"),)


def test_a_request_cancelled_while_the_store_decides_gives_back_the_slot_once_it_is_taken(
    own_redis: RedisServer,
) -> None:
    """The limiter lets a cancelled request's call finish (shielded): the slot the script takes
    when the store answers is given back, and the breaker hears the store answered."""
    limiter = limiter_on(own_redis, prefix="acancel", local=None)
    slots = Check(concurrency_policy("slots", 1, fail_mode=FailMode.OPEN), Subject(SubjectKind.API_KEY, "kai"))
    first = run(lambda: limiter.adecide([slots]))  # the loop's client, connected
    assert first.allowed
    limiter.release(first)
    own_redis.pause()

    async def scenario() -> bool:
        request = asyncio.ensure_future(limiter.adecide([slots]))
        pool = limiter.backend._async.current().connection_pool
        for _ in range(10_000):  # until the script is out: yields, no sleeps
            await asyncio.sleep(0)
            if pool._in_use_connections:
                break
        sent = bool(pool._in_use_connections)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        return sent

    try:
        assert run(scenario)
    finally:
        own_redis.resume()
    outcomes = limiter.breaker._outcomes
    # The cancelled call reported (a second outcome) and its slot, taken when the store woke, is back.
    assert wait_until(lambda: len(outcomes) == 2 and slots_taken(limiter.backend, slots) == 0, 5.0), (
        list(outcomes),
        slots_taken(limiter.backend, slots),
    )
    assert list(outcomes) == [True, True] and limiter.breaker.state is BreakerState.CLOSED


def test_a_probe_cancelled_as_its_loop_closes_lets_the_next_call_probe(own_redis: RedisServer) -> None:
    limiter = limiter_on(own_redis, prefix="aprobe", local=None)
    rate = local_check("rate", "1000/s", 100, Algorithm.TOKEN_BUCKET, "mia")
    breaker = limiter.breaker
    with breaker._lock:
        breaker._opened_at = time.monotonic() - breaker.cooldown  # open, and cooled down: half-open
    own_redis.pause()

    async def scenario() -> bool:
        probe = asyncio.ensure_future(limiter.adecide([rate]))  # left running when the loop closes
        for _ in range(10_000):  # until it is the probe: yields, no sleeps
            await asyncio.sleep(0)
            if breaker._probing:
                break
        return breaker._probing and not probe.done()

    try:
        assert asyncio.run(scenario())  # asyncio.run cancels what is left: the probe never reports
    finally:
        own_redis.resume()
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()  # the next call probes: the breaker is not stuck waiting on the first
    assert not breaker.allow()  # and only one does


def test_a_thread_hop_given_up_undoes_its_result_exactly_once() -> None:
    """``in_thread``: the awaiting task cancelled while the call runs, or once it is done."""
    undone: list[int] = []
    started, finish = threading.Event(), threading.Event()

    def call() -> int:
        started.set()
        assert finish.wait(CALL_TIMEOUT_S)
        return 7

    async def cancelled_while_running() -> None:
        hop = asyncio.ensure_future(in_thread(call, undone.append, executor=store_threads()))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, CALL_TIMEOUT_S)
        hop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hop

    run(cancelled_while_running)
    assert undone == []  # not done yet: the thread undoes it once it is
    finish.set()
    assert wait_until(lambda: undone == [7], 5.0), undone

    # Cancelled once the thread was done but before its result reached the task: the cancelled
    # side undoes it (in a store thread). The loop is held while the thread finishes.
    class Signalling(ThreadPoolExecutor):
        def __init__(self) -> None:
            super().__init__(max_workers=1)
            self.ran = threading.Event()

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            def signalling(*a: Any, **k: Any) -> Any:
                try:
                    return fn(*a, **k)
                finally:
                    self.ran.set()

            return super().submit(signalling, *args, **kwargs)

    executor = Signalling()

    async def cancelled_once_done() -> None:
        hop = asyncio.ensure_future(in_thread(lambda: 8, undone.append, executor=executor))
        await asyncio.sleep(0)  # the hop sends the call to the thread
        assert executor.ran.wait(CALL_TIMEOUT_S)  # blocks the loop: the result cannot arrive yet
        hop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hop

    try:
        run(cancelled_once_done)
    finally:
        executor.shutdown()
    assert wait_until(lambda: undone == [7, 8], 5.0), undone

    async def delivered() -> int:
        return await in_thread(lambda: 9, undone.append, executor=store_threads())

    assert run(delivered) == 9
    assert undone == [7, 8]  # a result that reached its task is the caller's: never undone


def test_a_probe_given_up_by_its_request_still_reports(own_redis: RedisServer) -> None:
    """The probe is shielded: cancelled, it runs on until the store answers or times out, and the
    breaker learns it (else every later request would probe again, and the breaker never learn)."""
    backend = RedisBackend(make_client(own_redis.url, 0.3, 0.3), prefix="aprobed")
    limiter = build_limiter(backend, CircuitBreaker(cooldown=30.0), LocalPathSettings(denials=False, leases=False))
    rate = local_check("rate", "1000/s", 100, Algorithm.TOKEN_BUCKET, "noa")
    assert run(lambda: limiter.adecide([rate])).allowed  # the loop's client, connected
    breaker = limiter.breaker
    with breaker._lock:
        breaker._opened_at = time.monotonic() - breaker.cooldown  # open, and cooled down: half-open
    own_redis.pause()

    async def scenario() -> bool:
        probe = asyncio.ensure_future(limiter.adecide([rate]))
        for _ in range(10_000):  # until it is the probe: yields, no sleeps
            await asyncio.sleep(0)
            if breaker._probing:
                break
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        return breaker._probing

    try:
        assert run(scenario)
        # The call times out (0.3 s): the probe failed, and the breaker is open for a new cooldown.
        assert wait_until(lambda: not breaker._probing, 5.0), breaker.state
    finally:
        own_redis.resume()
    assert breaker.state is BreakerState.OPEN


def test_loops_of_asyncio_run_leave_no_client_behind(own_redis: RedisServer) -> None:
    limiter = limiter_on(own_redis, prefix="arun", local=None)
    rate = local_check("rate", "1000/s", 100, Algorithm.TOKEN_BUCKET, "lin")
    connected = own_redis.client().info("clients")["connected_clients"]
    for _ in range(6):
        assert asyncio.run(limiter.adecide([rate])).allowed  # a script's loop, closed after each
    assert len(limiter.backend._async) == 1  # the last loop's; the others dropped as clients were made
    gc.collect()
    assert own_redis.client().info("clients")["connected_clients"] <= connected + 2


def querying_tier(request: Any, identity: Any) -> str | None:
    """A ``POLICIES['TIER_FUNC']`` that queries (and, in a thread, waits at the gate while the test says so)."""
    from .support.gate import GATE

    if _hold_tier_func:
        GATE.pass_through()
    UsageRecord.objects.exists()  # a query: SynchronousOnlyOperation on the event loop
    return None


_hold_tier_func = False


def test_a_tier_func_that_queries_moves_async_checks_to_a_thread(settings: Any, limits: Any) -> None:
    settings.RATELIMITS = merged(limits, {"POLICIES": {"TIER_FUNC": "tests.test_async.querying_tier"}})
    statuses = [r.status_code for r in burst("/t/async/plain", 4)]
    assert statuses == [200, 200, 200, 429]  # the first one's checks made again, in a thread
    assert evaluation._async_state.get().prepare_in_thread
    engine.reset()
    assert not evaluation._async_state.get().prepare_in_thread  # learnt again after the settings change


def test_a_request_cancelled_while_its_checks_are_made_in_a_thread_counts_itself_out(
    settings: Any, limits: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    global _hold_tier_func
    settings.RATELIMITS = merged(one_at_a_time(limits), {"POLICIES": {"TIER_FUNC": "tests.test_async.querying_tier"}})
    evaluation._async_state.get().prepare_in_thread = True
    shedder = engine.get_worker_shedder()
    assert shedder is not None
    given_up: list[asyncio.Event] = []
    thread_hop = evaluation.in_thread

    async def watched(call: Any, undo: Any, **kwargs: Any) -> Any:
        try:
            return await thread_hop(call, undo, **kwargs)
        except asyncio.CancelledError:
            given_up[0].set()  # Django gave up on the view while the checks' thread ran
            raise

    monkeypatch.setattr(evaluation, "in_thread", watched)

    async def scenario() -> list[dict[str, Any]]:
        gone = asyncio.Event()
        given_up.append(asyncio.Event())
        request = asyncio.ensure_future(asgi_get(ASGIHandler(), "/t/async/plain", disconnect=gone))
        assert await sync_to_async(gate.wait_inside, thread_sensitive=False)(1)
        assert shedder.in_flight == 1  # counted in before the checks, which wait in the thread
        gone.set()
        await given_up[0].wait()
        gate.open()  # the checks' thread goes on; request_finished's sync receivers wait for it
        return await request

    _hold_tier_func = True
    try:
        sent = run(scenario)
    finally:
        _hold_tier_func = False
        gate.open()
    assert status_of(sent) is None
    assert shedder.in_flight == 0  # counted out by the thread, before request_finished's receivers ran


class UnhashableSource(DatabasePolicySource):
    """A project's own source with no ``loaded``, which cannot be hashed (it defines ``__eq__``)."""

    loaded = None

    def __eq__(self, other: object) -> bool:
        return other is self


def test_a_policy_source_that_cannot_be_hashed_serves_async_requests(settings: Any, limits: Any) -> None:
    settings.RATELIMITS = merged(limits, {"POLICIES": {"SOURCE": "tests.test_async.UnhashableSource"}})
    source = engine.get_policy_source()
    with pytest.raises(TypeError):
        hash(source)
    assert [r.status_code for r in burst("/t/async/plain", 3)] == [200, 200, 200]
    assert evaluation._async_state.get().loaded_source is source  # loaded once, off the loop
