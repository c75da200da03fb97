"""Charges that follow the response, end to end: an endpoint that counts by outcome gives back what
it does not count, and a view trues a request's cost up or down, on memory, Redis and the cluster,
for DRF, plain and async views; and the true-up's excess over the limit stays within its bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

from ratelimits import engine
from ratelimits.engine import settling
from ratelimits.engine.limiter import get_limiter
from ratelimits.usage.records import usage_rows

from .support.clients import client_for
from .support.gate import Gate
from .support.redis_cluster import Cluster
from .support.settings import merged

#: The caller: an anonymous client at this address, of the tier ``free`` (no database is read per
#: request, so threads may call at once on any database).
ADDRESS = "198.51.100.7"


def limits(tier_rate: str, endpoint: dict[str, Any], name: str = "charged") -> dict[str, Any]:
    return {
        "TIERS": {"free": {"rate": tier_rate}},
        "POLICIES": {"DEFAULT_TIERS": {"anonymous": "free", "authenticated": "free"}},
        "ENDPOINTS": {name: endpoint},
    }


@pytest.fixture(params=["memory", "redis", "cluster"])
def store(request: pytest.FixtureRequest, settings: Any) -> Iterator[str]:
    """Each store the settlement is made in: the engine's own, as the settings build it."""
    if request.param == "redis":
        request.getfixturevalue("use_redis")
    elif request.param == "cluster":
        cluster: Cluster = request.getfixturevalue("redis_cluster")
        request.getfixturevalue("cluster_client")  # flushed
        redis = {"URL": cluster.url, "CLUSTER": True, "SOCKET_TIMEOUT": "2s", "CONNECT_TIMEOUT": "2s"}
        settings.RATELIMITS = merged(settings.RATELIMITS, {"BACKEND": "redis", "REDIS": redis})
    yield request.param
    engine.reset()


@pytest.fixture(autouse=True)
def _told_afresh() -> None:
    """What settling logs once per process, logged again in each test."""
    settling._told.clear()


def configure(settings: Any, tier_rate: str, endpoint: dict[str, Any], name: str = "charged") -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, limits(tier_rate, endpoint, name))


def statuses(path: str, n: int, **query: Any) -> list[int]:
    client = client_for(None, ADDRESS)
    return [client.get(path, query).status_code for _ in range(n)]


# -- by outcome ------------------------------------------------------------------------------------

#: For each ``counts``: statuses it gives back (free), and one it charges.
OUTCOMES = {
    "successes": ([404, 500, 503], 200),
    "client_errors": ([200, 201, 500], 404),
    "no_server_errors": ([500, 502, 503], 200),
}


@pytest.mark.parametrize("counts", sorted(OUTCOMES))
def test_responses_the_endpoint_does_not_count_cost_nothing(store: str, settings: Any, counts: str) -> None:
    """5 a minute: 30 responses the endpoint does not count are all answered (none refused), and
    the caller still has its whole 5 for the ones it does; the 6th of those is refused."""
    configure(settings, "5/m", {"counts": counts})
    free, charged = OUTCOMES[counts]
    for status in free:
        assert statuses("/t/charged", 10, status=status) == [status] * 10
    assert statuses("/t/charged", 6, status=charged) == [charged] * 5 + [429]


@pytest.mark.parametrize("path", ["/t/charged", "/t/plain-charged"], ids=["drf", "plain"])
def test_a_view_that_raises_is_a_server_error_and_costs_nothing(store: str, settings: Any, path: str) -> None:
    """No middleware of this app in MIDDLEWARE: the decorator (a plain view) and the DRF view itself
    still tell a raised exception (Django's 500) from a response."""
    endpoint = path.rsplit("/", 1)[1]
    configure(settings, "3/m", {"counts": "no_server_errors"}, endpoint)
    client = client_for(None, ADDRESS)
    client.raise_request_exception = False
    assert [client.get(path, {"raise": 1}).status_code for _ in range(6)] == [500] * 6
    assert statuses(path, 4) == [200] * 3 + [429]


def test_the_storm_free_responses_never_spend_the_limit(store: str, settings: Any) -> None:
    """8 threads, 240 requests failing with a 500 on an endpoint that does not count server errors,
    against a limit of 10 a minute: none is refused (at most 8 are in flight, each charged until
    its response is closed), and the caller has its 10 whole afterwards."""
    configure(settings, "10/m", {"counts": "no_server_errors"})

    def burst(_: int) -> list[int]:
        return statuses("/t/charged", 30, status=500)

    with ThreadPoolExecutor(8) as pool:
        answered = [status for batch in pool.map(burst, range(8)) for status in batch]
    assert answered == [500] * 240
    assert statuses("/t/charged", 11) == [200] * 10 + [429]


def test_a_plain_and_an_async_view_are_settled_too(store: str, settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            **limits("3/m", {"counts": "successes"}, "plain-charged"),
            "ENDPOINTS": {"plain-charged": {"counts": "successes"}, "async-charged": {"counts": "successes"}},
        },
    )
    assert statuses("/t/plain-charged", 8, status=500) == [500] * 8
    client = AsyncClient(REMOTE_ADDR=ADDRESS)

    async def five() -> list[int]:
        return [(await client.get("/t/async/charged", {"status": 404})).status_code for _ in range(5)]

    assert async_to_sync(five)() == [404] * 5
    assert statuses("/t/plain-charged", 4) == [200, 200, 200, 429]


@pytest.mark.django_db
def test_the_usage_row_counts_the_request_but_not_its_tokens(store: str, settings: Any) -> None:
    """Served requests are counted as served; the tokens they cost are what they were charged."""
    configure(settings, "50/m", {"cost": 2, "counts": "successes"})
    assert statuses("/t/charged", 3, status=500) == [500] * 3
    assert statuses("/t/charged", 2) == [200] * 2
    assert _usage("charged") == {"allowed": 5, "tokens": 4}


# -- true-ups ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_view_trues_its_cost_up_and_down(store: str, settings: Any) -> None:
    """Admitted at the cost (1), charged what the view said: 10 a minute, 4 + 0 + 3 spent, so 3 left."""
    configure(settings, "10/m", {"max_cost": 5})
    assert statuses("/t/charged", 1, cost=4) == [200]
    assert statuses("/t/charged", 1, cost=0) == [200]
    assert statuses("/t/charged", 3) == [200] * 3
    assert statuses("/t/charged", 4) == [200] * 3 + [429]
    assert _usage("charged") == {"allowed": 8, "throttled": 1, "tokens": 10}


def test_a_true_up_past_the_limit_is_a_debt(store: str, settings: Any) -> None:
    """4 a minute, one request trued up to 9: 5 beyond the limit, which the caller waits for:
    refused, with a Retry-After of the 6 tokens it needs (its own and the debt), 90 s."""
    configure(settings, "4/m", {"max_cost": 9})
    assert statuses("/t/charged", 1, cost=9) == [200]
    refused = client_for(None, ADDRESS).get("/t/charged")
    assert refused.status_code == 429
    assert 89 <= int(refused["Retry-After"]) <= 90


def test_what_a_view_asks_beyond_its_bounds_is_not_charged(
    store: str, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Above max_cost: max_cost. Not a whole number of tokens, or negative: the cost it was admitted
    at, and the request answered all the same. Each logged once."""
    configure(settings, "20/m", {"max_cost": 5})
    with caplog.at_level(logging.WARNING, logger="ratelimits"):
        assert statuses("/t/charged", 2, cost=50) == [200, 200]  # 5 each
        assert statuses("/t/charged", 2, cost="lots") == [200, 200]  # 1 each
        assert statuses("/t/charged", 2, cost=-3) == [200, 200]  # 1 each
    assert statuses("/t/charged", 9) == [200] * 6 + [429] * 3
    told = [r.getMessage() for r in caplog.records if "settling a request" in r.getMessage()]
    assert len(told) == 3, told


def test_without_max_cost_the_cost_is_fixed(store: str, settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    configure(settings, "5/m", {"cost": 1, "counts": "successes"})
    with caplog.at_level(logging.WARNING, logger="ratelimits"):
        assert statuses("/t/charged", 2, cost=3) == [200, 200]
    assert statuses("/t/charged", 4) == [200] * 3 + [429]
    assert any("has no max_cost" in r.getMessage() for r in caplog.records)


def test_the_excess_of_true_ups_in_flight_reaches_its_bound_and_no_further(
    store: str, settings: Any, gate: Gate
) -> None:
    """The worst case, built on purpose: 10 an hour, 10 requests admitted at the cost (1) while
    none has finished, then each trued up to max_cost (4). 40 charged against a limit of 10: an
    excess of exactly requests in flight x (max_cost - cost) = 30, the documented bound. The
    debt is paid before anything more is admitted: the next request waits for 31 tokens."""
    configure(settings, "10/h", {"max_cost": 4})
    client = client_for(None, ADDRESS)
    with ThreadPoolExecutor(10) as pool:
        held = [pool.submit(client_for(None, ADDRESS).get, "/t/charged", {"gate": 1, "cost": 4}) for _ in range(10)]
        assert gate.wait_inside(10)
        assert client.get("/t/charged").status_code == 429  # the limit is spent, at the cost
        gate.open()
        assert [f.result().status_code for f in held] == [200] * 10
    refused = client.get("/t/charged")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 31 * 360 - 1  # the debt's 30 and its own token, at 6 minutes each


def _usage(endpoint: str) -> dict[str, int]:
    """The live usage of ``endpoint`` as the drain would write it (``usage_rows``, which reads the
    subjects' labels: a test of it needs the database), summed over its rows and the test's minutes."""
    limiter = get_limiter()
    limiter.flush_usage(now=True)
    peek = limiter.usage_store.peek_usage(_minutes(), 10_000)  # type: ignore[union-attr]
    totals: dict[str, int] = {}
    for counts in peek.counts.values():
        rows, _ = usage_rows(counts)
        for (_, _, row_endpoint), values in rows.items():
            if row_endpoint == endpoint:
                for metric in ("allowed", "throttled", "tokens"):
                    if values.get(metric):
                        totals[metric] = totals.get(metric, 0) + values[metric]
    return totals


def _minutes() -> list[int]:
    now = int(time.time() // 60)
    return [now - 1, now]


# -- docs/charging.md's GraphQL endpoint -------------------------------------------------------------


@pytest.mark.django_db
def test_the_documented_graphql_endpoint_charges_by_what_a_query_returned(store: str, settings: Any) -> None:
    """The page's view and settings, 30 a minute: a query for a thousand customers costs 11, one for
    ten costs 1, one that fails validation costs 1 (a client's error, counted)."""
    from .support.documented_graphql import SETTINGS

    settings.RATELIMITS = merged(settings.RATELIMITS, {**limits("30/m", {}), **SETTINGS})
    client = client_for(None, ADDRESS)

    def query(text: str) -> Any:
        return client.post("/t/graphql", {"query": text}, format="json")

    thousand = query("{ customers(first: 1000) { id name } }")
    assert thousand.status_code == 200 and len(thousand.json()["data"]["customers"]) == 1000
    assert query("{ customers(first: 1000) { id } }").status_code == 200  # 22 spent
    assert query("{ nothing }").status_code == 400  # 23
    assert [query("{ customers { id } }").status_code for _ in range(8)] == [200] * 7 + [429]
    assert _usage("graphql") == {"allowed": 10, "throttled": 1, "tokens": 30}


@pytest.mark.django_db
def test_usage_counted_by_the_worker_is_corrected_before_and_after_it_is_added(
    store: str, settings: Any, gate: Gate
) -> None:
    """USAGE['FLUSH_EVERY']: the worker counts usage itself. A settlement corrects its own count,
    or, added to the store's meanwhile, the store's: a 500 costs no tokens either way."""
    if store == "memory":
        pytest.skip("the memory backend's usage is this worker's own")
    if store == "cluster":
        pytest.skip("a cluster's worker-counted usage goes to any slot's hash: a later correction is lost there")
    configure(settings, "50/m", {"cost": 3, "counts": "no_server_errors"})
    settings.RATELIMITS = merged(settings.RATELIMITS, {"USAGE": {"FLUSH_EVERY": "60s"}})
    assert statuses("/t/charged", 2, status=500) == [500, 500]  # corrected in the worker's count
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(client_for(None, ADDRESS).get, "/t/charged", {"gate": 1, "status": 500})
        assert gate.wait_inside(1)
        get_limiter().flush_usage(now=True)  # its count is the store's now
        gate.open()
        assert held.result().status_code == 500
    assert statuses("/t/charged", 1) == [200]
    assert _usage("charged") == {"allowed": 4, "tokens": 3}
