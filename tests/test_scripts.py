"""The Lua scripts and the Python they mirror agree on their numbers, and say what they take."""

from __future__ import annotations

import re
import struct
from importlib import resources

import pytest
import redis

from ratelimits.algorithms import RATE_ALGORITHMS, SLOT_RETRY_US, Algorithm
from ratelimits.backends import codec, layout
from ratelimits.backends.redis import DECIDE, RedisBackend, Script, make_client, read_state
from ratelimits.counters import usage_for
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies import Check, Policy
from ratelimits.policies.values import KeptChecks, Scope, check_for
from ratelimits.rates import parse_rate

from .support.clock import FakeClock
from .support.redis_server import RedisServer

SCRIPTS = sorted(p.name for p in resources.files("ratelimits").joinpath("lua").iterdir() if p.name.endswith(".lua"))


def lua_constants(script: Script) -> dict[str, int]:
    """``local A, B = 1, 2`` lines of a script, as ``{"A": 1, "B": 2}``."""
    found = {}
    for names, values in re.findall(r"^local ([A-Z_, ]+) = ([0-9, ]+)$", script.text, re.M):
        found.update(zip((n.strip() for n in names.split(",")), (int(v) for v in values.split(",")), strict=True))
    return found


def test_decide_names_the_algorithm_codes_python_sends() -> None:
    constants = lua_constants(DECIDE)
    assert {name: constants[name.upper()] for name in (a.name.lower() for a in Algorithm)} == {
        a.name.lower(): a.code for a in Algorithm
    }
    assert constants["SLOT_RETRY_US"] == SLOT_RETRY_US


def lua_formats(script: Script) -> dict[str, str]:
    """``local A, B = '<d', '<dd'`` lines of a script (struct formats), as ``{"A": "<d", "B": "<dd"}``."""
    found = {}
    for names, values in re.findall(r"^local ([A-Z_, ]+) = ('[^']*'(?:, '[^']*')*)$", script.text, re.M):
        formats = re.findall(r"'([^']*)'", values)
        found.update(zip((n.strip() for n in names.split(",")), formats, strict=True))
    return found


def test_decide_unpacks_what_python_packs() -> None:
    """The codec's layouts are the script's, byte for byte: the request header, each check's record
    (a global policy's with its fallback share), the reports, and every state the script writes."""
    formats = lua_formats(DECIDE)
    assert formats["REQUEST"] == codec.REQUEST.format
    check = Check(Policy("p", parse_rate("7/s"), 9, shadow=True), Subject(SubjectKind.IP, "198.51.100.1"), 3)
    ttl = float(check.policy.state_ttl_ms)
    assert struct.unpack(formats["CHECK"], codec.check_record(check)) == (
        Algorithm.TOKEN_BUCKET.code,
        1,
        7.0,
        1e6,
        9.0,
        3.0,
        ttl,
    )
    assert codec.check_record(check) is codec.check_record(check)  # packed once per check
    shared = Check(Policy("g", parse_rate("8/s"), 8, scope=Scope.GLOBAL), Subject(SubjectKind.IP, "198.51.100.1"))
    record = codec.check_record(shared)
    layout_size = struct.calcsize(formats["CHECK"])
    assert struct.unpack(formats["CHECK"], record[:layout_size])[1] == 2  # the global flag
    assert struct.unpack(formats["FALLBACK"], record[layout_size:]) == (shared.policy.even_share,)
    assert (formats["REFUNDABLE"], formats["LEASE"]) == (codec.REFUNDABLE.format, codec.LEASE.format)
    states = {
        Algorithm.TOKEN_BUCKET: formats["GCRA_STATE"],
        Algorithm.SLIDING_WINDOW: formats["SLIDING_STATE"],
        Algorithm.FIXED_WINDOW: formats["FIXED_STATE"],
    }
    assert states == {algorithm: layout.format for algorithm, layout in codec.STATE_FORMATS.items()}
    assert (formats["TIMED_STATE"], formats["REFUNDED_STATE"]) == (
        codec.TIMED_STATE.format,
        codec.REFUNDED_STATE.format,
    )
    assert formats["TIMED_STATE"].startswith(formats["GCRA_STATE"])  # what a previous release reads
    old = {Algorithm.SLIDING_WINDOW: formats["OLD_SLIDING"], Algorithm.FIXED_WINDOW: formats["OLD_FIXED"]}
    assert old == {algorithm: layout.format for algorithm, layout in codec.OLD_WINDOW_FORMATS.items()}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_opens_with_its_contract(name: str) -> None:
    header = Script.load(name).text.split("\n\n", 1)[0]
    assert header.startswith(f"-- {name}: ")
    assert "KEYS[1" in header and "ARGV[1]" in header
    assert "Returns" in header or "returns" in header.lower()


def test_an_undrained_usage_hash_lives_as_long_as_the_layout_says(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    check = Check(Policy("p", parse_rate("5/s"), 5), Subject(SubjectKind.IP, "198.51.100.1"))
    usage = usage_for(Subject(SubjectKind.IP, "198.51.100.1"), None, "", "ping", 1)
    assert backend.decide([check], usage=usage).allowed
    ttl = redis_client.ttl(layout.usage_key(backend.prefix, usage.minute))
    assert layout.USAGE_TTL_S - 5 <= ttl <= layout.USAGE_TTL_S


def test_the_codes_are_ordered_as_the_script_indexes_them() -> None:
    """The script looks rate algorithms up by code in a plain array, and takes codes from CONCURRENCY on as slots."""
    rates = [Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW]
    assert [a.code for a in rates] == [1, 2, 3]
    assert all(a.holds_slots == (a.code >= lua_constants(DECIDE)["CONCURRENCY"]) for a in Algorithm)


def test_a_token_bucket_of_a_previous_release_is_never_read(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Buckets record their capacity under keys of a new name: a previous release's worker, mid-deploy,
    never meets a value it cannot read, and this one never reads theirs (a bucket starts afresh once)."""
    clock = FakeClock()
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock)
    check = Check(Policy("p", parse_rate("10/s"), 10), Subject(SubjectKind.IP, "198.51.100.2"))
    key = check.key(backend.prefix)
    assert key.endswith(":p:1c")
    spent = repr(float(clock.now + 10 * check.policy.rate.interval_us))  # a full bucket, as 0.1 wrote it
    redis_client.set(key.removesuffix("c"), spent, px=5000)
    assert backend.decide([check]).results[0].remaining == 9  # the old key is not read
    assert redis_client.get(key.removesuffix("c")) == spent.encode()  # nor written


@pytest.mark.parametrize(
    ("algorithm", "old_value", "remaining"),
    [
        (Algorithm.SLIDING_WINDOW, struct.pack("<ddd", 1_700_000_000, 3, 0), 6),
        (Algorithm.FIXED_WINDOW, struct.pack("<dd", 1_700_000_000, 3), 6),
    ],
)
def test_every_window_the_previous_layouts_stored_carries_over(
    redis_server: RedisServer, redis_client: redis.Redis, algorithm: Algorithm, old_value: bytes, remaining: int
) -> None:
    """A window written before states recorded their terms is read in the current policy's terms."""
    clock = FakeClock()
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock)
    check = Check(Policy("p", parse_rate("10/s"), 10, algorithm), Subject(SubjectKind.IP, "198.51.100.9"))
    assert clock.now == 1_700_000_000_000_000  # the window index and arrival times above are this second's
    redis_client.set(check.key(backend.prefix), old_value, px=5000)
    decision = backend.decide([check])
    assert decision.allowed and decision.results[0].remaining == remaining
    stored = redis_client.get(check.key(backend.prefix))
    # Written anew with its terms: the window's limit and period.
    assert stored is not None and read_state(algorithm, stored)[-2:] == (10.0, 1e6)


def test_state_lives_under_keys_named_for_its_layout_so_no_old_value_is_misread() -> None:
    """Windows' values went packed (b) after 0.1; token buckets' took their capacity (c)."""
    subject = Subject(SubjectKind.IP, "198.51.100.3")
    names = {
        algorithm: Check(Policy("p", parse_rate("10/s"), 10, algorithm), subject).key("rl")
        for algorithm in RATE_ALGORITHMS
    }
    assert names[Algorithm.TOKEN_BUCKET].endswith(":p:1c")
    assert names[Algorithm.SLIDING_WINDOW].endswith(":p:2b") and names[Algorithm.FIXED_WINDOW].endswith(":p:3b")


@pytest.mark.parametrize("rate", ["10/s", "3/s"])
def test_a_token_bucket_is_stored_exactly_with_the_capacity_it_was_written_under(
    redis_server: RedisServer, redis_client: redis.Redis, rate: str
) -> None:
    """The arrival time round-trips to the bit (whole microseconds or not), beside the bucket's capacity."""
    clock = FakeClock()
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock)
    check = Check(Policy("p", parse_rate(rate), 3), Subject(SubjectKind.IP, "198.51.100.4"))
    for _ in range(2):
        assert backend.decide([check]).allowed
    key = check.key(backend.prefix)
    stored = redis_client.get(key)
    assert stored is not None and len(stored) == 24
    interval = check.policy.rate.interval_us
    assert read_state(Algorithm.TOKEN_BUCKET, stored) == (clock.now + interval + interval, 3 * interval)
    assert struct.unpack("<ddd", stored)[2] == 0  # on the app's clock, when the key expires is not known
    assert backend.decide([check], consume=False).results[0].remaining == 0  # the third of 3 still fits


def test_a_decide_call_packs_its_header_and_tail_where_the_script_reads_them() -> None:
    """The header's fields in the script's order (the deadline last, which a call's send rewrites),
    then the checks' records, the overflow row (as long as the header says) and the slot id."""
    clock = FakeClock()
    backend = RedisBackend(make_client("redis://127.0.0.1:1/0", 0.1, 0.1), clock=clock, usage_cap=7)
    check = Check(Policy("p", parse_rate("5/s"), 5), Subject(SubjectKind.IP, "198.51.100.8"), 2)
    usage = usage_for(Subject(SubjectKind.IP, "198.51.100.8"), None, "", "ping", 2)
    _, args = backend.decide_call([check], consume=True, usage=usage, slot="slot-id", deadline=123)
    packed = args[0]
    header = codec.REQUEST.unpack_from(packed)
    overflow = usage.overflow.encode()
    assert header == (clock.now, 1, 2, layout.USAGE_TTL_S, 7, 0, len(overflow), 123)
    record = codec.check_record(check)
    assert packed[codec.REQUEST.size :] == record + overflow + b"slot-id"
    assert args[1:] == [usage.field]
    stamped = backend._call_for([check], consume=True, usage=usage, wants=None).stamped(args)[0]
    assert codec.REQUEST.unpack_from(stamped)[:-1] == header[:-1]  # only the deadline is new
    assert stamped[codec.REQUEST.size :] == packed[codec.REQUEST.size :]


def test_a_list_of_checks_is_compiled_once_and_each_list_for_itself() -> None:
    """A decide call's keys and records are made once per list of checks (by their ids): two lists
    sharing a check are each their own, a list seen again is what a fresh backend makes of it, and a
    list with a sharded budget's check (its shard picked per request) is never kept."""
    backend = RedisBackend(make_client("redis://127.0.0.1:1/0", 0.1, 0.1), clock=FakeClock())
    caller, org = Subject(SubjectKind.API_KEY, "k1"), Subject(SubjectKind.ORG, "acme")
    rate = Check(Policy("p", parse_rate("5/s"), 5), caller)
    shared = Check(Policy("org", parse_rate("50/s"), 50), org)
    both, alone = [rate, shared], [shared]

    def call(on: RedisBackend, checks: list[Check]) -> tuple[list[str], list[object]]:
        return on.decide_call(checks, consume=True, usage=None, slot=None)

    first = call(backend, both)
    assert call(backend, alone)[0] == [backend.version_key, shared.key("rl")]
    assert call(backend, both) == first == call(RedisBackend(backend.client, clock=backend.clock), both)
    assert first[0] == [backend.version_key, rate.key("rl"), shared.key("rl")]
    assert first[1][0][codec.REQUEST.size :] == codec.check_record(rate) + codec.check_record(shared)
    kept = len(backend._compiled)
    resolved = KeptChecks(both)  # a snapshot's kept resolution: known by its own id
    assert call(backend, resolved) == first == call(backend, resolved)
    assert len(backend._compiled) == kept + 1
    kept += 1
    sharded = Policy("all", parse_rate("1000/s"), 1000, shards=4)
    call(backend, [rate, check_for(sharded, Subject(SubjectKind.ENDPOINT, "charges"), 1)])
    assert len(backend._compiled) == kept


def test_an_admission_at_the_edge_of_a_bucket_leaves_zero_never_minus_one(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """In doubles, now + capacity - the new arrival time can round a hair below zero on an admission
    the script makes (now >= allow_at): the remaining count is clamped to 0, as algorithms.py does."""
    clock = FakeClock(1_780_000_595_824_040)
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), clock=clock)
    check = Check(Policy("edge", parse_rate("1024/s"), 18), Subject(SubjectKind.IP, "198.51.100.9"), 12)
    capacity = 18 * check.policy.rate.interval_us
    redis_client.set(check.key(backend.prefix), struct.pack("<dd", 1_780_000_595_829_899.5, capacity), px=60_000)
    result = backend.decide([check]).results[0]
    assert result.allowed and result.remaining == 0


def test_a_bucket_keeps_its_keys_expiry_while_it_covers_the_state_and_renews_it_after(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """On Redis TIME, an admission whose state the key's expiry still covers (by the TTL's second of
    slack) keeps it (SET ... KEEPTTL); one it no longer covers renews it (PX). The expiry the state
    records is never later than the key's own, nor earlier than its arrival time plus the slack less
    the two milliseconds' margin a PX write records under the key's own (decide.lua, TIMED_STATE)."""
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0))
    check = Check(Policy("p", parse_rate("10/s"), 10), Subject(SubjectKind.IP, "198.51.100.5"))  # TTL 2 s
    key = check.key(backend.prefix)
    recorded = []
    for _ in range(10):  # drained at once: each admission moves the arrival time 0.1 s on
        assert backend.decide([check]).allowed
        tat, _, expires = struct.unpack("<ddd", redis_client.get(key) or b"")
        expires_at_us = redis_client.pexpiretime(key) * 1000
        # A PX write records now + capacity + slack - margin; a bucket drained within that margin
        # (ten fast calls) has its arrival time up to the margin past now + capacity.
        assert tat + 1_000_000 - 2_000 <= expires <= expires_at_us
        recorded.append(expires)
    # The first admission set the expiry; the next eight kept it (their arrival time plus the slack
    # within it); the tenth's (a second past the first) did not fit, and was written with PX.
    assert len(set(recorded[:9])) == 1 and recorded[9] > recorded[0]
