"""One Redis round trip per decision, counted on the wire with MONITOR through the real DRF stack.

A request subject to four checks (tier, client IP, organisation, per-endpoint limit) goes
through APIClient -> authentication -> RateLimitThrottle -> RedisBackend. MONITOR on the
private redis-server logs every command any client sends, and the commands a script runs
as "[0 lua]" lines. A sentinel ECHO from another connection marks the end of the request's
traffic, so everything between starting MONITOR and the sentinel is the request's own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from rest_framework.test import APIClient

from ratelimits.backends.redis import DECIDE, RedisBackend, make_client
from ratelimits.counters import usage_for
from ratelimits.decisions import Decision
from ratelimits.identity import Subject, SubjectKind
from ratelimits.policies import Check, Policy
from ratelimits.rates import parse_rate

from .factories import ApiKeyFactory
from .support.redis_server import RedisServer

pytestmark = pytest.mark.django_db

FOUR_CHECKS = {
    "TIERS": {"anon": {"rate": "2/m"}, "free": {"rate": "3/s"}, "pro": {"rate": "1000/h"}},
    "POLICIES": {
        "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
    "IDENTITY": {"ORGANIZATION_FUNC": "project.payments.auth.organization_of"},
    "DIMENSIONS": {"ip": {"rate": "1000/s"}, "org": {"rate": "1000/s"}},
    "ENDPOINTS": {"customers": {"rate": "50/s"}},
}
EXPECTED_POLICIES = ["tier:pro", "ip", "org", "endpoint:customers"]
#: How many monitor lines we are prepared to read before the sentinel (bounds the loop).
MAX_LINES = 1_000


@pytest.fixture
def caller(settings: Any, use_redis: Any) -> APIClient:
    settings.RATELIMITS = {**settings.RATELIMITS, **FOUR_CHECKS}
    ApiKeyFactory(raw="sk_rtt_1", tier="pro", organization="acme")
    client = APIClient(REMOTE_ADDR="198.51.100.20")
    client.credentials(HTTP_AUTHORIZATION="Bearer sk_rtt_1")
    return client


def get_customers(client: APIClient) -> Decision:
    response = client.get("/v1/customers")
    assert response.status_code == 200, response.content
    decision = response.wsgi_request.ratelimit
    assert isinstance(decision, Decision)
    assert [r.policy_name for r in decision.results] == EXPECTED_POLICIES
    assert decision.allowed
    return decision


@contextmanager
def recorded_commands(redis_server: RedisServer) -> Iterator[list[dict[str, Any]]]:
    """Every command the server receives inside the block, scripts' own included.

    MONITOR's OK arrives before the block runs, so nothing the block sends can be missed;
    on exit a sentinel ECHO is sent from another, already connected client and lines are
    read (bounded by count and the 5 s socket timeout) until it shows up. Nothing is
    filtered by client: any stray command from anyone would be counted.
    """
    commands: list[dict[str, Any]] = []
    sentinel = f"sentinel-{uuid.uuid4()}"
    watcher = redis_server.client()
    marker = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5, single_connection_client=True)
    marker.ping()  # its connection handshake happens now, before MONITOR starts
    try:
        with watcher.monitor() as monitor:
            yield commands
            assert marker.echo(sentinel) == sentinel.encode()
            for _ in range(MAX_LINES):
                command = monitor.next_command()
                if command["client_type"] != "lua" and command["command"] == f"ECHO {sentinel}":
                    break
                commands.append(command)
            else:
                pytest.fail(f"no sentinel within {MAX_LINES} monitor lines: {commands[:20]}")
    finally:
        marker.close()
        watcher.close()


#: What the worker's invalidation listener sends, off the decision path (ratelimits.backends.invalidation).
LISTENER = ("SUBSCRIBE rl#invalidate", "PING")


def top_level(commands: list[dict[str, Any]]) -> list[str]:
    """Commands sent by clients (round trips), without the ones scripts ran inside Redis or the listener's."""
    return [c["command"] for c in commands if c["client_type"] != "lua" and c["command"] not in LISTENER]


def test_four_dimension_request_costs_exactly_one_round_trip(caller: APIClient, use_redis: RedisServer) -> None:
    get_customers(caller)  # warm-up: connection opened, script cached, settings parsed
    with recorded_commands(use_redis) as commands:
        get_customers(caller)
    sent = top_level(commands)
    assert len(sent) == 1, sent
    name, function, numkeys, *_ = sent[0].split(" ")
    assert (name.upper(), function) == ("FCALL", DECIDE.function)
    assert numkeys == "6"  # the policy-version stamp, the four checks' state keys, this minute's usage
    # The four checks were decided inside that one call: TIME, one MGET (version + states), 4 SETs.
    inside = [c["command"].split(" ")[0].upper() for c in commands if c["client_type"] == "lua"]
    # ...and the usage counter: one HINCRBY (cost 1); if this request opened a new minute (the
    # warm-up request usually did), also the new row's marker and count, and the hash's expiry.
    expected = sorted(["TIME", "MGET"] + ["SET"] * 4 + ["HINCRBY"])
    assert sorted(inside) in (expected, sorted([*expected, "HSETNX", "HINCRBY", "EXPIRE"]))


def test_a_lost_function_costs_one_extra_round_trip_once(
    caller: APIClient, use_redis: RedisServer, redis_client: redis.Redis
) -> None:
    warm = get_customers(caller)
    redis_client.function_flush()  # as a restart without persistence, or a new master, leaves it
    with recorded_commands(use_redis) as commands:
        first = get_customers(caller)
    assert [c.split(" ")[:2] for c in top_level(commands)] == [
        ["FCALL", DECIDE.function],
        ["FUNCTION", "LOAD"],
        ["FCALL", DECIDE.function],
    ]
    with recorded_commands(use_redis) as commands:
        second = get_customers(caller)
    assert [c.split(" ")[0].upper() for c in top_level(commands)] == ["FCALL"]
    # The failed FCALL charged nothing and the second charged once: the tier budget (1000/h,
    # a token back every 3.6 s) dropped by exactly one per request.
    assert [d.results[0].remaining for d in (warm, first, second)] == [999, 998, 997]


@pytest.mark.parametrize(
    "refusal",
    [
        pytest.param(("--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""), id="no-functions"),
        pytest.param((), id="acl-without-functions"),
    ],
)
def test_a_store_that_refuses_functions_is_sent_the_script(
    refusal: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """Before Redis 7 there is no FCALL (a server with the commands renamed away says the same),
    and an ACL may allow EVALSHA but not FCALL: the decision is the same, by EVALSHA."""
    with RedisServer(config=refusal) as server:
        url = server.url
        if not refusal:
            server.client().acl_setuser(
                "scripts",
                enabled=True,
                nopass=True,
                keys=["*"],
                channels=["*"],
                commands=["+@all", "-fcall", "-function"],
            )
            url = f"redis://scripts@127.0.0.1:{server.port}/0"
        backend = RedisBackend(make_client(url, 2.0, 2.0))
        check = Check(Policy("fallback", parse_rate("3/m"), 3), Subject(SubjectKind.USER, "u1"))
        with caplog.at_level("INFO", logger="ratelimits"):
            remaining = [backend.decide([check]).results[0].remaining for _ in range(4)]
        assert remaining == [2, 1, 0, 0]
        assert backend.functions.enabled is False
        assert server.client().script_exists(DECIDE.sha) == [True]
        refusals = [r for r in caplog.records if "refuses Redis Functions" in r.getMessage()]
        assert len(refusals) == 1, caplog.text  # told once, not per decision


def test_usage_costs_one_call_for_a_row_counted_already_and_more_only_for_a_new_one(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The usage commands one decision runs inside its script, as the cap of 1 row a minute fills."""
    backend = RedisBackend(make_client(redis_server.url, 2.0, 2.0), usage_cap=1)
    first, second = (Subject(SubjectKind.IP, ip) for ip in ("198.51.100.80", "198.51.100.81"))

    def usage_commands(subject: Subject) -> list[str]:
        usage = usage_for(subject, None, "", "ping", 1)
        with recorded_commands(redis_server) as commands:
            assert backend.decide([Check(Policy("p", parse_rate("100/s"), 100), subject)], usage=usage).allowed
        inside = [c["command"].split(" ") for c in commands if c["client_type"] == "lua"]
        # Those on the usage hash (TIME has no key).
        return [words[0].upper() for words in inside if words[1:2] and words[1].startswith("rl:usage:")]

    new_row = ["HINCRBY", "HSETNX", "HINCRBY"]  # the metric, the row's marker, the minute's rows
    assert usage_commands(first) == [*new_row, "EXPIRE"]  # the minute's first row: the hash is new
    assert usage_commands(first) == ["HINCRBY"]  # the steady state: one call
    # Beyond the cap, every request of the row is taken out again and counted in the overflow row.
    assert usage_commands(second) == [*new_row, "HDEL", "HINCRBY"]
    assert usage_commands(first) == ["HINCRBY"]
