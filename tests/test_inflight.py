"""Concurrent-request limits: slots per subject, held while a request is in flight.

Through the real stack (DRF throttle, Django's request_finished) with real threads blocked in a
view until the test opens a gate; at the backend level on both stores with the same fake clock;
and a worker process killed with SIGKILL while holding slots on a real redis-server.
Every wait is bounded in time; no sleep is used to synchronise (polling for expiry waits for
time itself to pass, which is the behaviour under test).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest
from rest_framework.test import APIClient

from ratelimits import engine
from ratelimits.algorithms import Algorithm
from ratelimits.backends.redis import RedisBackend, make_client
from ratelimits.decisions import Verdict
from ratelimits.identity import Subject
from ratelimits.policies import Check, Policy, concurrency_policy
from ratelimits.rates import Rate, parse_rate

from .factories import ApiKeyFactory
from .support.bursts import Burst, in_flight
from .support.clients import client_for
from .support.clock import FakeClock
from .support.gate import Gate
from .support.redis_server import RedisServer
from .support.settings import merged
from .support.storm import hold_slots

SECOND = 1_000_000
ALICE = Subject("api_key", "inflight-alice")
BOB = Subject("api_key", "inflight-bob")


def slots_policy(limit: int, ttl_us: int = 60 * SECOND, name: str = "conc", shadow: bool = False) -> Policy:
    return Policy(name, Rate(limit, ttl_us), limit, Algorithm.CONCURRENCY, shadow=shadow)


def rate_policy(rate: str, burst: int | None = None, name: str = "rate") -> Policy:
    parsed = parse_rate(rate)
    return Policy(name, parsed, burst or parsed.limit)


# -- a. through the real stack --------------------------------------------------------------------

N, REQUESTS = 3, 10


@pytest.fixture(params=["redis", "memory"])
def stack(request: pytest.FixtureRequest, settings: Any) -> str:
    """RATELIMITS for the concurrency tier, on each backend (Redis: the session's private server)."""
    if request.param == "redis":
        request.getfixturevalue("use_redis")
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "BACKEND": request.param,
            "TIERS": {
                "free": {"rate": "1000/s", "burst": 1000, "concurrency": N},
                "anon": {"rate": "1000/s", "burst": 1000},
            },
            "POLICIES": {
                "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
                "TIER_FUNC": "project.payments.auth.tier_of",
            },
        },
    )
    engine.reset()
    return str(request.param)


def concurrency_check(api_key_pk: int) -> Check:
    """The tier's concurrency check of one API key, as the policy source builds it."""
    source = engine.get_policy_source()
    policy = next(p for p in source.snapshot().tiers["free"] if p.algorithm is Algorithm.CONCURRENCY)
    assert policy.name == "tier:free:concurrency"
    return Check(policy, Subject("api_key", f"ApiKey:{api_key_pk}"))


@pytest.mark.django_db(transaction=True)  # the request threads read the API keys on their own connections
def test_exactly_n_requests_in_flight_the_rest_429(stack: str, gate: Gate) -> None:
    key = ApiKeyFactory(raw="sk_inflight_conc", tier="free")
    ApiKeyFactory(raw="sk_inflight_other", tier="free")
    check = concurrency_check(key.pk)
    backend = engine.get_limiter().backend

    for burst_round in range(2):  # the second burst shows the first one's slots all came back
        gate.reset()
        burst = Burst()
        for i in range(REQUESTS):
            burst.start(f"r{i}", lambda: client_for("sk_inflight_conc").get("/t/gated"))
        # Every request decided: N held inside the view, all the others answered.
        settled = gate.wait_for(lambda g: g.inside == N, 10) and burst.wait_answered(REQUESTS - N, 10)
        assert settled, f"round {burst_round}: {gate.inside} inside, {burst.statuses()} answered, {burst.errors}"
        assert not burst.errors, burst.errors
        assert gate.inside == N and gate.entered == N, "more than N requests got into the view"
        assert burst.statuses() == [429] * (REQUESTS - N)
        assert in_flight(backend, check) == N
        # Another caller is not affected by this one's slots.
        assert client_for("sk_inflight_other").get("/v1/customers").status_code == 200

        for answer in burst.answers:
            response = answer.response
            assert response["Content-Type"] == "application/problem+json"
            body = answer.json()
            assert body["status"] == 429
            assert body["type"].endswith("#quota-exceeded")
            assert [v["policy"] for v in body["violations"]] == ["tier:free:concurrency"]
            assert body["violations"][0]["limit"] == N
            assert body["violations"][0]["remaining"] == 0
            assert 0 < body["retry_after_ms"] <= 1000
            listed = response["RateLimit-Policy"].split(", ")
            assert f'"tier:free:concurrency";q={N};qu="concurrent-requests"' in listed
            assert response["RateLimit"] == '"tier:free:concurrency";r=0'
            assert response["Retry-After"] == "1"
            assert response["X-RateLimit-Resource"] == "tier:free:concurrency"

        gate.open()
        burst.join()
        assert burst.statuses() == [200] * N + [429] * (REQUESTS - N)
        # Each response was closed (request_finished) before its thread returned: all released.
        assert in_flight(backend, check) == 0

    # Sequential requests never hold more than one slot at a time.
    gate.open()
    client = client_for("sk_inflight_conc")
    assert [client.get("/t/gated").status_code for _ in range(2 * N)] == [200] * (2 * N)
    assert in_flight(backend, check) == 0


# -- a/d. all or nothing, on both backends -------------------------------------------------------


def test_denied_rate_check_leaves_no_slot_behind(backend: Any) -> None:
    conc = Check(slots_policy(3), ALICE)
    rate = Check(rate_policy("2/m"), ALICE)
    first, second = backend.decide([rate, conc]), backend.decide([rate, conc])
    assert first.allowed and second.allowed
    assert first.slot and second.slot and first.slot != second.slot
    assert first.slot_keys == (conc.key(backend.prefix),)
    assert in_flight(backend, conc) == 2

    denied = backend.decide([rate, conc])  # the rate check is spent, the slot check would allow
    assert denied.verdict is Verdict.LIMITED
    assert [r.allowed for r in denied.results] == [False, True]
    assert denied.slot is None and denied.slot_keys == ()
    assert in_flight(backend, conc) == 2  # no slot taken by the denied request

    backend.release(first.slot, first.slot_keys)
    backend.release(second.slot, second.slot_keys)
    assert in_flight(backend, conc) == 0


def test_denied_slot_spends_no_tokens(backend: Any) -> None:
    conc = Check(slots_policy(1), ALICE)
    rate = Check(rate_policy("10/m"), ALICE)
    holder = backend.decide([conc])
    assert holder.allowed
    tokens = backend.decide([rate], consume=False).results[0].remaining
    assert tokens == 9  # what one more request would leave: nothing spent yet

    for _ in range(5):
        denied = backend.decide([rate, conc])
        assert denied.verdict is Verdict.LIMITED
        assert [r.allowed for r in denied.results] == [True, False]
        assert denied.violated[0].policy_name == "conc"
        assert denied.slot is None
    assert backend.decide([rate], consume=False).results[0].remaining == tokens

    assert backend.release(holder.slot, holder.slot_keys) == 1
    admitted = backend.decide([rate, conc])
    assert admitted.allowed
    assert backend.decide([rate], consume=False).results[0].remaining == tokens - 1


def test_one_slot_id_serves_every_slot_check_of_a_request(backend: Any) -> None:
    per_caller = Check(slots_policy(2, name="caller"), ALICE)
    fleet = Check(Policy("fleet", Rate(3, 60 * SECOND), 3, Algorithm.FLEET), Subject("fleet", "in-flight"))
    admitted = [backend.decide([per_caller, fleet]) for _ in range(2)]
    assert all(d.allowed for d in admitted)
    assert admitted[0].slot_keys == (per_caller.key(backend.prefix), fleet.key(backend.prefix))
    assert (in_flight(backend, per_caller), in_flight(backend, fleet)) == (2, 2)
    # The caller is full: denied, and the fleet slot it would have taken is not taken either.
    assert not backend.decide([per_caller, fleet]).allowed
    assert in_flight(backend, fleet) == 2
    assert backend.release(admitted[0].slot, admitted[0].slot_keys) == 2
    assert (in_flight(backend, per_caller), in_flight(backend, fleet)) == (1, 1)


def test_a_peek_takes_no_slot(backend: Any) -> None:
    conc = Check(slots_policy(1), ALICE)
    for _ in range(3):
        peek = backend.decide([conc], consume=False)
        assert peek.allowed and peek.slot is None and peek.slot_keys == ()
    assert backend.decide([conc]).allowed
    assert not backend.decide([conc], consume=False).allowed


def test_shadow_slot_check_never_denies_and_takes_no_slot_it_was_denied(backend: Any) -> None:
    """A shadow concurrency limit reports, but only the slots it allowed are held (both stores)."""
    conc = Check(slots_policy(2, shadow=True), ALICE)
    decisions = [backend.decide([conc]) for _ in range(3)]
    assert [d.allowed for d in decisions] == [True, True, True]
    assert [bool(d.shadow_violated) for d in decisions] == [False, False, True]
    assert in_flight(backend, conc) == 2
    backend.release(decisions[0].slot, decisions[0].slot_keys)
    assert in_flight(backend, conc) == 1
    # The third request was over the shadow limit: releasing it frees nothing more.
    assert backend.release(decisions[2].slot, decisions[2].slot_keys) == 0
    assert in_flight(backend, conc) == 1


# -- c/d. release is idempotent, on both backends ------------------------------------------------


def test_double_and_foreign_release_are_no_ops(backend: Any) -> None:
    conc = Check(slots_policy(2), ALICE)
    mine, theirs = backend.decide([conc]), backend.decide([conc])
    assert mine.allowed and theirs.allowed
    assert backend.release(mine.slot, mine.slot_keys) == 1
    assert backend.release(mine.slot, mine.slot_keys) == 0  # twice
    assert backend.release("not-a-slot-of-anyone", mine.slot_keys) == 0  # foreign id
    assert backend.release(theirs.slot, (Check(slots_policy(2), BOB).key(backend.prefix),)) == 0  # wrong key
    assert in_flight(backend, conc) == 1  # "theirs" is untouched
    # Released slots come back exactly: one more fits, then the limit holds.
    assert backend.decide([conc]).allowed
    assert not backend.decide([conc]).allowed


def test_release_after_expiry_frees_nobody_elses_slot(backend: Any, clock: FakeClock) -> None:
    conc = Check(slots_policy(2, ttl_us=2 * SECOND), ALICE)
    stale = backend.decide([conc])
    clock.advance(1 * SECOND)
    older = backend.decide([conc])
    assert not backend.decide([conc]).allowed
    clock.advance(1 * SECOND)  # "stale" expires exactly now (its worker died, or it ran too long)
    assert in_flight(backend, conc) == 1
    fresh = backend.decide([conc])
    assert fresh.allowed
    # The stale request finally finishes: its release must not free "older" or "fresh".
    assert backend.release(stale.slot, stale.slot_keys) == 0
    assert in_flight(backend, conc) == 2
    assert not backend.decide([conc]).allowed
    clock.advance(1 * SECOND)  # "older" expires too: releasing it late changes nothing
    assert in_flight(backend, conc) == 1
    assert backend.release(older.slot, older.slot_keys) == 0
    assert in_flight(backend, conc) == 1
    assert backend.release(fresh.slot, fresh.slot_keys) == 1
    assert in_flight(backend, conc) == 0


def test_expired_slots_are_free_again(backend: Any, clock: FakeClock) -> None:
    conc = Check(slots_policy(3, ttl_us=2 * SECOND), ALICE)
    assert all(backend.decide([conc]).allowed for _ in range(3))
    denied = backend.decide([conc])
    assert not denied.allowed and denied.retry_after_us == SECOND  # slots come back on release: retry soon
    clock.advance(2 * SECOND - 1)
    assert not backend.decide([conc]).allowed
    clock.advance(1)
    assert [backend.decide([conc]).allowed for _ in range(4)] == [True, True, True, False]


def test_hammered_release_counts_every_slot_once(backend: Any) -> None:
    """Eight threads release the same slots (and foreign ids) over and over: each slot frees once."""
    limit, threads_n, rounds = 5, 8, 25
    conc = Check(slots_policy(limit), ALICE)
    held = [backend.decide([conc]) for _ in range(limit)]
    assert all(d.allowed for d in held)
    bystander = Check(slots_policy(limit), BOB)
    assert backend.decide([bystander]).allowed
    barrier = threading.Barrier(threads_n)
    released = [0] * threads_n
    errors: list[BaseException] = []

    def hammer(i: int) -> None:
        try:
            barrier.wait(10)
            for _ in range(rounds):
                for decision in held:
                    released[i] += backend.release(decision.slot, decision.slot_keys)
                    released[i] += backend.release(f"foreign-{i}", decision.slot_keys)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(threads_n)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(20)
    assert not any(w.is_alive() for w in workers)
    assert not errors, errors
    assert sum(released) == limit  # 8 x 25 x 10 release calls freed exactly the 5 slots held
    assert in_flight(backend, conc) == 0
    assert in_flight(backend, bystander) == 1
    # Had the count gone below zero, more than the limit would now be admitted.
    assert [backend.decide([conc]).allowed for _ in range(limit + 2)] == [True] * limit + [False, False]


# -- b. a worker killed while holding slots ------------------------------------------------------

TTL_S = 2
HELD = 3


def redis_now_us(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * SECOND + int(micros)


def test_slots_of_a_killed_worker_are_free_within_ttl(
    settings: Any, redis_server: RedisServer, redis_client: Any
) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"SHEDDING": {"SLOT_TTL": f"{TTL_S}s"}})
    policy = concurrency_policy("inflight:killed", HELD, fail_mode="open")
    assert policy.rate.period_us == TTL_S * SECOND  # SHEDDING['SLOT_TTL'] is what a slot lives
    check = Check(policy, Subject("api_key", "killed-worker"))
    key = check.key("rl")  # the digest travels with the pickled subject: the child needs no settings
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=None)

    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    child = ctx.Process(target=hold_slots, args=(redis_server.url, [check], HELD, reports), daemon=True)
    child.start()
    try:
        pid, taken = reports.get(timeout=30)
        assert pid == child.pid
        assert [allowed for allowed, *_ in taken] == [True] * HELD
        assert len({slot for _, slot, _, _ in taken}) == HELD
        assert all(keys == (key,) for _, _, keys, _ in taken)
        acquired_first = min(now for *_, now in taken)
        acquired_last = max(now for *_, now in taken)
        assert not backend.decide([check]).allowed  # the child holds every slot

        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        killed_us = redis_now_us(redis_client)

        right_after = backend.decide([check], consume=False)
        assert not right_after.allowed  # nobody released them: still held...
        assert redis_client.zcard(key) == HELD
        assert right_after.now_us < acquired_first + TTL_S * SECOND, "the test was too slow to see them held"

        # ...until they expire: bounded polling, the time passing is the behaviour under test.
        deadline = time.monotonic() + TTL_S + 1
        seen_free = None
        polls = 0
        while time.monotonic() < deadline:
            polls += 1
            peek = backend.decide([check], consume=False)
            if peek.allowed and peek.results[0].remaining == HELD - 1:  # all of them free
                seen_free = peek.now_us
                break
            # Never early: none is free before its TTL has passed.
            if peek.allowed:
                assert peek.now_us >= acquired_first + TTL_S * SECOND
            else:
                assert redis_client.zcard(key) == HELD
            time.sleep(0.02)
        assert seen_free is not None, f"slots still held {TTL_S + 1} s after the kill"
        assert seen_free >= acquired_last + TTL_S * SECOND
        assert seen_free - killed_us <= (TTL_S + 1) * SECOND
        assert redis_client.zcard(key) == 0
        # Free for real: exactly HELD new requests get in.
        again = [backend.decide([check]) for _ in range(HELD + 1)]
        assert [d.allowed for d in again] == [True] * HELD + [False]
        print(
            f"\nkilled worker: {HELD} slots free {(seen_free - killed_us) / SECOND:.3f} s after SIGKILL, "
            f"{(seen_free - acquired_last) / SECOND:.3f} s after the last was taken (TTL {TTL_S} s, {polls} polls)"
        )
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        reports.close()


# -- degraded: the in-process fallback holds and releases slots too ------------------------------


def test_local_fail_mode_releases_its_slots(settings: Any, own_redis: RedisServer, gate: Gate) -> None:
    """With Redis gone, a concurrency limit that fails "local" is held in process, and released."""
    settings.RATELIMITS = {
        "BACKEND": "redis",
        "REDIS": {"URL": own_redis.url, "SOCKET_TIMEOUT": "100ms", "CONNECT_TIMEOUT": "100ms"},
        "TIERS": {"anon": {"rate": "1000/s", "burst": 1000, "concurrency": 2, "fail_mode": "local"}},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}},
    }
    engine.reset()
    own_redis.kill()

    def call() -> Any:
        return APIClient(REMOTE_ADDR="198.51.100.61").get("/t/gated")

    burst = Burst()
    for i in range(5):
        burst.start(f"r{i}", call)
    settled = gate.wait_for(lambda g: g.inside == 2, 10) and burst.wait_answered(3, 10)
    assert settled, (gate.inside, burst.statuses(), burst.errors)
    assert not burst.errors, burst.errors
    assert gate.entered == 2
    assert burst.statuses() == [429] * 3
    assert all(a.response["X-RateLimit-Degraded"] == "1" for a in burst.answers)
    gate.open()
    burst.join()
    assert burst.statuses() == [200] * 2 + [429] * 3
    # Each finished request gave its local slot back: one after another, all are admitted.
    statuses = [call().status_code for _ in range(6)]
    assert statuses == [200] * 6
    assert engine.get_limiter().degraded_count >= 11


def test_slots_are_released_under_asgi(use_redis: Any, settings: Any) -> None:
    """Through Django's ASGI handler the view runs in a worker thread; the response's close still
    reaches the request's slot (kept on the request), so it is released."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    settings.RATELIMITS = {
        **settings.RATELIMITS,
        "TIERS": {"anonymous": {"rate": "100/s", "concurrency": 1}, "authenticated": {"rate": "100/s"}},
    }
    client = AsyncClient(REMOTE_ADDR="198.51.100.90")

    async def three_in_a_row() -> list[int]:
        return [(await client.get("/t/ping")).status_code for _ in range(3)]

    assert async_to_sync(three_in_a_row)() == [200, 200, 200]
