"""A Redis that evicts the limiter's keys turns limiting off quietly: it is detected, shown and said.

Every server here is a private redis-server started with the configuration under test (an evicting
``maxmemory-policy``, ``noeviction``, ``CONFIG`` renamed away) and filled for real until it evicts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends import HealthSupport, get_backend
from ratelimits.backends.layout import version_key
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.checks import I001, W004, check_store
from ratelimits.counters import usage_for
from ratelimits.engine import Limiter
from ratelimits.engine.breaker import BreakerState, CircuitBreaker
from ratelimits.exceptions import BackendUnavailable
from ratelimits.identity import Subject, SubjectKind
from ratelimits.models import PolicyVersion
from ratelimits.policies.values import Check, Policy, concurrency_policy
from ratelimits.rates import parse_rate
from ratelimits.store.database import DatabasePolicySource
from ratelimits.store.versioning import bump_policy_version

from .support.redis_server import RedisServer, free_port, script_calls
from .support.settings import merged

#: Small enough to fill in a moment, above what an empty redis-server uses on its own.
MAXMEMORY = "4mb"
EVICTING = ("--maxmemory", MAXMEMORY, "--maxmemory-policy", "allkeys-lru")
#: Managed Redis often refuses CONFIG: the server here has none at all.
NO_CONFIG = ("--rename-command", "CONFIG", "")
NO_INFO = ("--rename-command", "INFO", "")


@pytest.fixture
def start() -> Iterator[Any]:
    """Start private servers with extra configuration; each is stopped by PID afterwards."""
    servers: list[RedisServer] = []

    def run(*config: str) -> RedisServer:
        server = RedisServer(config=config)
        servers.append(server)
        server.start()
        return server

    yield run
    for server in servers:
        server.stop()


def limit_with(settings: Any, server: RedisServer, **extra: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": server.url}, **extra})


def fill_until_evicted(server: RedisServer, gone: str | None = None) -> int:
    """Write junk until the server has evicted keys (and ``gone``, if given, is among them): evicted_keys."""
    client = server.client()
    try:
        for batch in range(1000):  # at most ~200 MB written: bounded, and far past any MAXMEMORY here
            with client.pipeline(transaction=False) as pipe:
                for i in range(200):
                    pipe.set(f"junk:{batch}:{i}", "x" * 1000, ex=3600)
                pipe.execute()
            evicted = int(client.info("stats")["evicted_keys"])
            if evicted and (gone is None or not client.exists(gone)):
                return evicted
        raise AssertionError(f"the server never evicted {gone or 'anything'}")
    finally:
        client.close()


# -- the system check ----------------------------------------------------------------------------


def test_an_evicting_redis_is_warned_about(settings: Any, start: Any) -> None:
    limit_with(settings, start(*EVICTING))
    messages = check_store()
    assert [m.id for m in messages] == [W004]
    assert "'allkeys-lru'" in messages[0].msg
    assert "noeviction" in (messages[0].hint or "")


def test_volatile_policies_evict_the_limiters_keys_too(settings: Any, start: Any) -> None:
    """Every key the limiter writes has a TTL, so ``volatile-*`` policies may evict any of them."""
    limit_with(settings, start("--maxmemory-policy", "volatile-ttl"))
    assert [m.id for m in check_store()] == [W004]


def test_noeviction_is_clean(settings: Any, start: Any) -> None:
    limit_with(settings, start("--maxmemory", MAXMEMORY, "--maxmemory-policy", "noeviction"))
    assert check_store() == []


def test_without_config_the_policy_is_read_from_info(settings: Any, start: Any) -> None:
    server = start(*EVICTING, *NO_CONFIG)
    with pytest.raises(redis.ResponseError):
        server.client().config_get("maxmemory-policy")  # the server really refuses it
    limit_with(settings, server)
    assert [m.id for m in check_store()] == [W004]


def test_a_store_that_will_not_say_gets_a_note_not_an_error(settings: Any, start: Any) -> None:
    limit_with(settings, start(*EVICTING, *NO_CONFIG, *NO_INFO))
    messages = check_store()
    assert [(m.id, m.level) for m in messages] == [(I001, 20)]  # checks.INFO
    assert "maxmemory-policy" in messages[0].msg


def test_an_unreachable_redis_is_a_note_and_does_not_hang(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": f"redis://127.0.0.1:{free_port()}/0"}}
    )
    began = time.monotonic()
    messages = check_store()
    assert time.monotonic() - began < 2
    assert [m.id for m in messages] == ["ratelimits.I002"]  # a typo in the address shows at start, never an error
    assert "did not answer the checks" in messages[0].msg and "fail mode" in messages[0].msg


def test_a_stalled_redis_does_not_hang_the_check(settings: Any, own_redis: RedisServer) -> None:
    limit_with(settings, own_redis)
    own_redis.pause()  # accepts connections, never answers
    try:
        began = time.monotonic()
        assert [m.id for m in check_store()] == ["ratelimits.I002"]
        assert time.monotonic() - began < 2
    finally:
        own_redis.resume()


def test_only_the_redis_backend_is_asked(settings: Any) -> None:
    settings.RATELIMITS = {"BACKEND": "memory", "REDIS": {"URL": f"redis://127.0.0.1:{free_port()}/0"}}
    assert check_store() == []
    assert not isinstance(get_backend(), HealthSupport)  # nothing to evict: state lives in the process


# -- the figure to alert on ----------------------------------------------------------------------


def test_store_health_counts_real_evictions(settings: Any, start: Any) -> None:
    server = start(*EVICTING)
    limit_with(settings, server)
    before = get_backend().store_health()
    assert before is not None
    assert (before.maxmemory_policy, before.evicted_keys, before.evicts) == ("allkeys-lru", 0, True)
    assert before.maxmemory == 4 * 1024 * 1024
    evicted = fill_until_evicted(server)
    after = get_backend().store_health()
    assert after is not None and after.evicted_keys == evicted > 0


@pytest.mark.django_db
def test_the_fleet_page_shows_the_eviction_policy_and_evicted_keys(
    settings: Any, start: Any, admin_client: Client
) -> None:
    server = start(*EVICTING)
    limit_with(settings, server)
    evicted = fill_until_evicted(server)
    page = admin_client.get(reverse("admin:ratelimits_fleetsettings_changelist"))
    assert page.status_code == 200
    store = page.context["store"]
    # A full server goes on evicting a little (a new connection's buffers take memory too).
    assert store.maxmemory_policy == "allkeys-lru" and store.evicted_keys >= evicted > 0
    html = page.content.decode()
    assert "<td>allkeys-lru</td>" in html
    assert f"<td>{store.evicted_keys}</td>" in html
    assert "restarts full" in html  # says what it costs, not only the figure


@pytest.mark.django_db
def test_the_fleet_page_says_when_the_store_cannot_be_read(settings: Any, admin_client: Client) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {"BACKEND": "redis", "REDIS": {"URL": f"redis://127.0.0.1:{free_port()}/0"}}
    )
    page = admin_client.get(reverse("admin:ratelimits_fleetsettings_changelist"))
    assert page.status_code == 200
    assert "could not be read" in page.content.decode()


# -- what eviction costs -------------------------------------------------------------------------


def test_an_evicted_bucket_restarts_full(start: Any) -> None:
    """The cost of eviction: a state key gone before its TTL is a new subject with a full bucket."""
    server = start(*EVICTING)
    backend = RedisBackend(make_client(server.url, 2.0, 2.0))
    check = Check(Policy("tier:small", parse_rate("20/m"), 20), Subject(SubjectKind.API_KEY, "k"))
    assert [backend.decide([check]).allowed for _ in range(21)] == [True] * 20 + [False]
    fill_until_evicted(server, gone=check.key(backend.prefix))
    again = [backend.decide([check]) for _ in range(21)]
    assert [d.allowed for d in again] == [True] * 20 + [False]  # twenty more within the same minute


@pytest.mark.django_db
def test_a_full_noeviction_store_degrades_loudly(settings: Any, start: Any) -> None:
    """What the recommended set-up does when memory runs out, for a request that holds no slot (no
    concurrency limit, no fleet shedder): its script's first write fails, the decision degrades, visibly."""
    server = start("--maxmemory", MAXMEMORY, "--maxmemory-policy", "noeviction")
    limit_with(settings, server)
    client = server.client()
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # bounded: at most ~200 MB written
        for batch in range(1000):
            with client.pipeline(transaction=False) as pipe:
                for i in range(200):
                    pipe.set(f"junk:{batch}:{i}", "x" * 1000)
                pipe.execute()
    client.close()
    response = APIClient(REMOTE_ADDR="198.51.100.11").get("/t/ping")
    assert response.status_code == 200  # fail mode open: admitted, and said so
    assert response["X-RateLimit-Degraded"] == "1"


# -- a full noeviction store: what fails, and what does not ---------------------------------------
#
# Redis refuses a Redis Function that may write (the decide script, where the store runs
# Functions) while it is over maxmemory, before it runs. A script sent by EVALSHA (before Redis
# 7, an ACL without Functions, a cluster's slot groups) is refused only at a write that may grow
# memory (SET, HINCRBY, ZADD), and only while it has written nothing yet: it cannot stop a script
# halfway. A slot check's first write purges expired slots (ZREMRANGEBYSCORE), which is never
# refused, so the rest of a decision that holds a slot is written too, past maxmemory
# (docs/failure-modes.md).

BUCKET = Policy("tier:small", parse_rate("5/m"), 5)
SLOTS = concurrency_policy("tier:small:concurrency", 1_000, fail_mode="open")


#: How far over its maxmemory a full store here is: far more than a client's buffers, which come and
#: go with each connection and would otherwise take it back under the limit and over again.
OVER_BY = 256 * 1024


def over_maxmemory(server: RedisServer) -> redis.Redis:
    """Fill a ``noeviction`` server: 1 MB of junk without a TTL, then a maxmemory below what it
    uses, as a store that grew past its limit has (Redis takes the setting and evicts nothing).
    Returns a client of the server, for the caller to close."""
    client = server.client()
    with client.pipeline(transaction=False) as pipe:
        for i in range(10_000):
            pipe.set(f"junk:{i}", "x" * 100)
        pipe.execute()
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - OVER_BY)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("junk:probe", "x")
    return client


NOEVICTION = ("--maxmemory-policy", "noeviction")


def subject(name: str) -> Subject:
    return Subject(SubjectKind.API_KEY, name)


def scripts_only(server: RedisServer) -> RedisBackend:
    """A backend on ``server`` that sends the decide script by EVALSHA, as to a store without Functions."""
    backend = RedisBackend(make_client(server.url, 2.0, 2.0))
    backend.functions.enabled = False
    return backend


def test_a_full_noeviction_store_refuses_every_decision_up_front(start: Any) -> None:
    """As a Redis Function, the decide script is refused before it runs: whatever the decision, a
    refusal or one that holds a slot too, and nothing is written past maxmemory."""
    server = start(*NOEVICTION)
    backend = RedisBackend(make_client(server.url, 2.0, 2.0))
    spent = Check(BUCKET, subject("spent"))
    assert [backend.decide([spent]).allowed for _ in range(6)] == [True] * 5 + [False]
    client = over_maxmemory(server)
    used = int(client.info("memory")["used_memory"])
    for checks in (
        [Check(BUCKET, subject("new"))],
        [spent],  # a refusal would write nothing, but the store cannot know that before it runs
        [Check(BUCKET, subject("held")), Check(SLOTS, subject("held"))],
    ):
        with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
            backend.decide(checks)
    assert backend.functions.enabled  # an OOM is the store's state, not a refusal of Functions
    assert (
        client.exists(
            *(check.key(backend.prefix) for check in (Check(BUCKET, subject("new")), Check(SLOTS, subject("held"))))
        )
        == 0
    )
    assert int(client.info("memory")["used_memory"]) < used + 64 * 1024  # no more than a connection's buffers
    client.close()


def test_a_full_noeviction_store_refuses_scripts_that_write_first(start: Any) -> None:
    """By EVALSHA, a decision that holds no slot: an admission writes its state first, and is refused with OOM."""
    server = start(*NOEVICTION)
    backend = scripts_only(server)
    spent = Check(BUCKET, subject("spent"))
    assert [backend.decide([spent]).allowed for _ in range(6)] == [True] * 5 + [False]
    over_maxmemory(server).close()
    with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
        backend.decide([Check(BUCKET, subject("new"))])  # admitted: its state is written first
    with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
        backend.decide([Check(Policy("daily", parse_rate("100/d"), 100, Algorithm.FIXED_WINDOW), subject("new"))])
    assert backend.decide([spent]).allowed is False  # refused: it writes nothing, so it is decided
    usage = usage_for(subject("spent"), None, "small", "ping", 1)
    with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
        backend.decide([spent], usage=usage)  # unless usage counting writes the refusal's count


def test_a_full_noeviction_store_decides_a_script_that_holds_a_slot_and_grows_past_maxmemory(
    settings: Any, start: Any
) -> None:
    """By EVALSHA, a decision that holds a slot purges its slot set first, so its writes all go through:
    the limit holds exactly, and the store grows past maxmemory with nothing evicted and no check to say so."""
    server = start(*NOEVICTION)
    limit_with(settings, server)
    backend = scripts_only(server)
    client = over_maxmemory(server)
    usage = usage_for(subject("held"), None, "small", "ping", 1)
    held = [Check(BUCKET, subject("held")), Check(SLOTS, subject("held"))]
    decisions = [backend.decide(held, usage=usage) for _ in range(6)]
    for decision in decisions:
        if decision.slot is not None:
            backend.release(decision.slot, decision.slot_keys)
    assert [d.allowed for d in decisions] == [True] * 5 + [False]  # exactly the limit, nothing failed
    before = backend.store_health()
    for i in range(2_000):  # new callers: each one's bucket, slot set and usage row are new keys
        caller = subject(f"caller-{i}")
        decision = backend.decide([Check(BUCKET, caller), Check(SLOTS, caller)], usage=usage._replace(field=f"r{i}:"))
        assert decision.allowed and decision.slot is not None
        backend.release(decision.slot, decision.slot_keys)
    after = backend.store_health()
    assert before is not None and after is not None and after.maxmemory == before.maxmemory
    assert before.used_memory is not None and after.used_memory is not None and after.maxmemory is not None
    # Written past the limit, and nothing evicted, nothing said.
    assert after.used_memory > after.maxmemory and after.used_memory - before.used_memory > 100_000
    assert after.evicted_keys == 0 and after.maxmemory_policy == "noeviction"
    assert check_store() == []
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("another:client", "x")  # everyone else's writes are still refused
    client.close()


def test_a_full_noeviction_store_opens_the_breaker_and_then_degrades_every_decision(
    start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed decisions degrade, each logged, until the breaker opens; then every decision degrades,
    one that holds a slot too (the store is not asked), and nothing more is logged."""
    server = start(*NOEVICTION)
    # A cooldown longer than the test: no probe reaches the store while it runs.
    limiter = Limiter(
        RedisBackend(make_client(server.url, 2.0, 2.0)),
        CircuitBreaker(window=20, min_calls=5, failure_rate=0.5, cooldown=60),
        local=MemoryBackend(),
        local_share=1.0,
    )
    over_maxmemory(server).close()
    logger = logging.getLogger("ratelimits")
    logger.addHandler(caplog.handler)  # the test settings keep ratelimits' logs from propagating
    try:
        without_slots = [limiter.decide([Check(BUCKET, subject(f"a{i}"))]) for i in range(5)]
        assert limiter.breaker.state is BreakerState.OPEN  # 5 of 5 failed: at least half of 5 calls
        with_slot = limiter.decide([Check(BUCKET, subject("b")), Check(SLOTS, subject("b"))])
    finally:
        logger.removeHandler(caplog.handler)
    assert all(d.allowed and d.degraded for d in without_slots)  # fail mode open: admitted, and said so
    assert with_slot.allowed and with_slot.degraded  # the breaker is open: not asked, though it would have answered
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5  # one a failed call; none once the breaker is open
    assert all(w.startswith("ratelimits: backend unavailable, degrading: OutOfMemoryError") for w in warnings)


# -- the policy version stamp, evicted -----------------------------------------------------------


@pytest.mark.django_db
def test_an_evicted_stamp_is_republished_at_most_once_per_interval(settings: Any, start: Any) -> None:
    """A stamp that keeps vanishing must not cost every decision a second script call (and a warning)."""
    server = start(*EVICTING)
    # Every request to the store, its 429s too (a denial remembered, or a lease, would spare it the call).
    limit_with(
        settings,
        server,
        POLICIES={"SOURCE": "database", "POLL_INTERVAL": "60s"},
        LOCAL_PATH={"DENIALS": False, "LEASES": False},
    )
    PolicyVersion.advance()  # a policy change committed...
    bump_policy_version()  # ...and published: its version in the database and the store
    source = engine.get_policy_source()
    assert isinstance(source, DatabasePolicySource)
    client = APIClient(REMOTE_ADDR="198.51.100.9")
    for _ in range(2):  # the first loads the snapshot and learns the stamp; the second runs on it
        assert client.get("/t/ping").status_code == 200
    assert source.snapshot().version >= 1
    store = server.client()
    store.config_resetstat()
    requests = 20
    for _ in range(requests):
        store.delete(version_key("rl"))  # evicted between two decisions, as a full allkeys-lru store does
        assert client.get("/t/ping").status_code in (200, 429)  # decided either way
    # One decide per request, and one republication in the interval (not one per request).
    assert script_calls(server) == requests + 1
    assert int(store.get(version_key("rl")) or 0) == 0  # deleted once more after it was published
    store.close()


@pytest.mark.django_db
def test_a_lagging_stamp_is_republished_again_after_the_interval(settings: Any, start: Any) -> None:
    server = start()
    limit_with(settings, server, POLICIES={"SOURCE": "database", "POLL_INTERVAL": "60s"})
    PolicyVersion.advance()
    bump_policy_version()
    source = engine.get_policy_source()
    assert isinstance(source, DatabasePolicySource)
    client = APIClient(REMOTE_ADDR="198.51.100.10")
    for _ in range(2):
        client.get("/t/ping")
    version = source.snapshot().version
    assert version >= 1
    store = server.client()
    store.delete(version_key("rl"))
    client.get("/t/ping")
    assert int(store.get(version_key("rl")) or 0) == version  # published again at once
    store.delete(version_key("rl"))
    client.get("/t/ping")
    assert store.get(version_key("rl")) is None  # within the interval: not again
    source._republished_at -= 61  # the interval has passed
    client.get("/t/ping")
    assert int(store.get(version_key("rl")) or 0) == version
    store.close()
