"""The test kit (``ratelimits.testing``) and the switch (``RATELIMITS['ENABLED']``), as a project's suite uses them.

The switch is driven end to end through every entry point, with the store a real redis-server
whose command counts show it was never asked. The kit's limiter is checked for isolation (what is
spent inside stays inside, the process's limiter is the project's again after) and for its
clock; the assertions against real 429s of a DRF view and a plain view, and against responses
made wrong by hand, one way each; the pytest fixtures from inner suites of a project's own,
run by ``pytester`` in a process of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from asgiref.sync import async_to_sync
from django.http import HttpResponse
from django.test import AsyncClient, override_settings
from django.urls import include, path
from rest_framework.test import APIClient

from ratelimits import testing
from ratelimits.backends import _stand_ins, get_backend
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import RedisBackend
from ratelimits.conf import conf
from ratelimits.engine import get_worker_shedder
from ratelimits.engine.failed_auth import get_failed_authentication
from ratelimits.engine.limiter import current_limiter
from ratelimits.testing.schema import RATE_LIMIT_HEADERS

from .support.redis_server import RedisServer, free_port
from .support.settings import merged

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
#: The anonymous tier: two requests a minute, one more every 30 s.
ANON = {
    "TIERS": {"anon": {"rate": "2/m"}, "paid": {"rate": "2/m"}},
    "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "paid"}},
}
SCHEMA_CLASS = "ratelimits.openapi.RateLimitAutoSchema"


def rate_limit_headers(response: Any) -> dict[str, str]:
    return {name: value for name, value in response.headers.items() if RATE_LIMIT_HEADERS.fullmatch(name)}


def commands_run(client: redis.Redis) -> dict[str, int]:
    """The commands the server ran since its statistics were reset, but for those that read them."""
    stats = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}
    return {name: n for name, n in calls.items() if name not in ("info", "config|resetstat", "config")}


# -- RATELIMITS['ENABLED'] ------------------------------------------------------------------------


def every_entry_point() -> dict[str, list[Any]]:
    """Three requests through each entry point that decides, sync and async: their responses."""
    client = APIClient()
    guesser = APIClient()
    guesser.credentials(HTTP_AUTHORIZATION="Bearer sk_guessed")

    async def asynchronously(path: str) -> list[Any]:
        asgi = AsyncClient()
        return [await asgi.get(path) for _ in range(3)]

    responses = {
        address: [client.get(address) for _ in range(3)]
        for address in ("/t/ping", "/t/plain", "/t/unmarked", "/v1/rate_limit?endpoint=ping")
    }
    responses["failed authentication"] = [guesser.get("/v1/customers") for _ in range(3)]
    for address in ("/t/async/ping", "/t/async/plain", "/t/async/unmarked"):
        responses[address] = async_to_sync(asynchronously)(address)
    return responses


@pytest.fixture
def every_limit(settings: Any, use_redis: RedisServer) -> dict[str, Any]:
    """Every entry point installed, each with a limit the three requests go over, on the private Redis."""
    settings.MIDDLEWARE = [
        "ratelimits.middleware.FailedAuthenticationMiddleware",
        "ratelimits.middleware.EarlyRejectionMiddleware",
        *settings.MIDDLEWARE,
        "ratelimits.middleware.RateLimitMiddleware",
    ]
    settings.RATELIMITS = merged(
        merged(settings.RATELIMITS, ANON),
        {
            "ENDPOINTS": {"rate_limit": {"rate": "1/m"}},
            "IDENTITY": {"FAILED_AUTH": {"rate": "1/h", "burst": 1}},
            "SHEDDING": {"WORKER_CAPACITY": 100},
            "LOCAL_PATH": {"DENIALS": True},
        },
    )
    return settings.RATELIMITS  # type: ignore[no-any-return]


def test_with_the_switch_off_no_entry_point_asks_the_store_or_sends_a_header(
    settings: Any, every_limit: dict[str, Any], redis_client: redis.Redis
) -> None:
    settings.RATELIMITS = {**every_limit, "ENABLED": False}
    redis_client.config_resetstat()
    responses = every_entry_point()
    statuses = {name: [r.status_code for r in replies] for name, replies in responses.items()}
    assert statuses == {name: [401] * 3 if name == "failed authentication" else [200] * 3 for name in responses}
    assert [rate_limit_headers(r) for replies in responses.values() for r in replies] == [{}] * 24
    # The status endpoint says nothing limits the caller, and asked the store nothing to say so.
    assert json.loads(responses["/v1/rate_limit?endpoint=ping"][0].content)["resources"] == []
    assert commands_run(redis_client) == {}
    # Nothing of the limiter was even built: no limiter, no shedder, no failed-authentication limit.
    assert current_limiter() is None
    assert get_worker_shedder() is None and get_failed_authentication() is None

    # The same requests with the switch on (override_settings takes effect at once): each is limited.
    with override_settings(RATELIMITS={**every_limit, "ENABLED": True}):
        responses = every_entry_point()
    assert {name: replies[-1].status_code for name, replies in responses.items()} == dict.fromkeys(responses, 429)
    assert all(rate_limit_headers(replies[0]) for replies in responses.values())
    assert commands_run(redis_client).get("fcall", 0) > 0


# -- ratelimits.testing.limiter() -----------------------------------------------------------------


def test_a_limit_spent_inside_stays_inside_and_the_store_is_never_asked(
    settings: Any, use_redis: RedisServer, redis_client: redis.Redis
) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON}
    before = settings.RATELIMITS
    outside = get_backend()
    assert isinstance(outside, RedisBackend)
    redis_client.config_resetstat()
    client = APIClient()
    with testing.limiter() as limits:
        assert get_backend() is limits.backend and isinstance(limits.backend, MemoryBackend)
        assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 429]
        assert current_limiter() is not None and current_limiter().backend is limits.backend  # type: ignore[union-attr]
    assert commands_run(redis_client) == {}
    # Out of the block: the project's settings and a limiter built from them, with nothing spent.
    assert settings.RATELIMITS is before
    assert current_limiter() is None
    assert isinstance(get_backend(), RedisBackend) and get_backend() is not outside
    assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 429]


def test_the_clock_moves_only_when_told_and_tokens_come_back_as_the_policy_says(settings: Any) -> None:
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {"anon": {"rate": "3/m"}},
            "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "anon"}},
        },
    )
    client = APIClient()
    with testing.limiter() as limits:
        assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 200]
        # One token every 20 s: the wait is exactly that, however long the test itself took.
        body = testing.assert_rate_limited(client.get("/t/ping"), policy="tier:anon", retry_after=20)
        assert body["retry_after_ms"] == 20_000
        limits.advance(19.999)
        assert testing.assert_rate_limited(client.get("/t/ping"), retry_after=1)["retry_after_ms"] == 1
        limits.advance(0.001)
        testing.assert_not_rate_limited(client.get("/t/ping"))
        testing.assert_rate_limited(client.get("/t/ping"), retry_after=20)  # one token came back, not two
        limits.advance(60)
        assert [client.get("/t/ping").status_code for _ in range(4)] == [200, 200, 200, 429]
        limits.reset()
        assert [client.get("/t/ping").status_code for _ in range(4)] == [200, 200, 200, 429]
        with pytest.raises(ValueError, match="never goes back"):
            limits.advance(-1)


def test_the_clock_moves_the_failed_authentication_limit_too(settings: Any) -> None:
    settings.MIDDLEWARE = ["ratelimits.middleware.FailedAuthenticationMiddleware", *settings.MIDDLEWARE]
    settings.RATELIMITS = merged(
        settings.RATELIMITS, {**ANON, "IDENTITY": {"FAILED_AUTH": {"rate": "1/m", "burst": 1}}}
    )
    guesser = APIClient()
    guesser.credentials(HTTP_AUTHORIZATION="Bearer sk_guessed")
    with testing.limiter() as limits:
        assert [guesser.get("/v1/customers").status_code for _ in range(2)] == [401, 429]
        testing.assert_rate_limited(guesser.get("/v1/customers"), policy="failed-auth", retry_after=60)
        limits.advance(60)
        assert [guesser.get("/v1/customers").status_code for _ in range(2)] == [401, 429]


def test_it_turns_a_switched_off_limiter_on_inside_and_off_again_after(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON, "ENABLED": False}
    before = settings.RATELIMITS
    client = APIClient()
    with testing.limiter():
        assert conf.enabled
        assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 429]
    assert settings.RATELIMITS is before and not conf.enabled
    assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 200]


def test_as_a_decorator_each_call_has_a_fresh_limiter(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON}
    isolated = testing.limiter()
    client = APIClient()

    @isolated
    def exhaust() -> list[int]:
        assert get_backend() is isolated.backend
        return [client.get("/t/ping").status_code for _ in range(3)]

    @isolated
    async def inside() -> bool:
        return get_backend() is isolated.backend

    assert exhaust() == exhaust() == [200, 200, 429]
    assert async_to_sync(inside)()
    assert get_backend() is not isolated.backend
    with isolated, pytest.raises(RuntimeError, match="open already"), isolated:
        pass


# -- assert_rate_limited, assert_not_rate_limited -------------------------------------------------


#: The test views alone: the demo's are documented with the schema class they were imported under.
urlpatterns = [path("t/", include("tests.views"))]


@pytest.fixture
def documented(settings: Any) -> None:
    """The project's schema documents the 429 (docs/openapi.md)."""
    settings.ROOT_URLCONF = __name__
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_SCHEMA_CLASS": SCHEMA_CLASS}
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON}


def denied(path: str = "/t/ping") -> Any:
    """The third request to ``path`` (its 429), and the first (a 200), from a fresh limiter."""
    client = APIClient()
    with testing.limiter():
        first = client.get(path)
        client.get(path)
        return client.get(path), first


@pytest.mark.parametrize("style", ["ietf", "github", "both", "none"])
def test_a_real_429_of_a_drf_view_passes_against_the_contract_and_the_schema(
    settings: Any, documented: None, style: str
) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, "HEADERS": style}
    refused, admitted = denied()
    body = testing.assert_rate_limited(refused, policy="tier:anon", retry_after=30, openapi=True)
    assert body["violated-policies"] == ["tier:anon"]
    testing.assert_not_rate_limited(admitted, openapi=True)


def test_a_real_429_of_a_plain_view_passes_and_the_schema_is_left_out(documented: None) -> None:
    refused, admitted = denied("/t/plain")
    testing.assert_rate_limited(refused, policy="tier:anon")
    testing.assert_not_rate_limited(admitted)
    with pytest.raises(AssertionError, match=r"OpenAPI: not checked: the project's schema has no operation GET /t/pl"):
        testing.assert_rate_limited(refused, openapi=True)


def test_a_429_of_the_async_client_passes(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON}

    async def three() -> list[Any]:
        client = AsyncClient()
        return [await client.get("/t/async/plain") for _ in range(3)]

    with testing.limiter():
        admitted, _, refused = async_to_sync(three)()
    testing.assert_not_rate_limited(admitted)
    testing.assert_rate_limited(refused, policy="tier:anon", retry_after=30)
    with pytest.raises(AssertionError, match=r"^GET /t/async/plain: expected 429"):
        testing.assert_rate_limited(admitted)


def test_without_drf_spectacular_as_the_schema_class_the_schema_is_left_out(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON}
    refused, _ = denied()
    testing.assert_rate_limited(refused)
    with pytest.raises(AssertionError, match=r"DEFAULT_SCHEMA_CLASS'\] is not drf-spectacular's AutoSchema"):
        testing.assert_rate_limited(refused, openapi=True)


def test_a_schema_that_documents_no_429_for_the_operation_fails(settings: Any, documented: None) -> None:
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
    refused, admitted = denied()
    with pytest.raises(AssertionError) as failure:
        testing.assert_rate_limited(refused)
    assert str(failure.value).splitlines()[1:] == [
        "- OpenAPI: the project's schema documents no 429 for GET /t/ping: set REST_FRAMEWORK['DEFAULT_SCHEMA_CLASS']"
        " to 'ratelimits.openapi.RateLimitAutoSchema' (docs/openapi.md)"
    ]
    testing.assert_rate_limited(refused, openapi=False)
    # Its 200 is documented, without the headers it carries.
    with pytest.raises(AssertionError) as failure:
        testing.assert_not_rate_limited(admitted)
    assert str(failure.value).splitlines()[1:] == [
        "- OpenAPI: RateLimit-Policy, RateLimit, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset, "
        "X-RateLimit-Used, X-RateLimit-Resource sent, but not documented in the schema's 200 of GET /t/ping "
        "(ratelimits.openapi.RateLimitAutoSchema documents them: docs/openapi.md)"
    ]
    testing.assert_not_rate_limited(admitted, openapi=False)


def test_a_200_is_not_a_429(documented: None) -> None:
    _, admitted = denied()
    with pytest.raises(AssertionError) as failure:
        testing.assert_rate_limited(admitted)
    assert str(failure.value) == 'GET /t/ping: expected 429 Too Many Requests, got 200 OK; body: {"ok":true}'


def test_a_429_is_not_admitted(documented: None) -> None:
    refused, _ = denied()
    with pytest.raises(AssertionError, match=r"^GET /t/ping: expected a response the limiter admitted, got 429 Too"):
        testing.assert_not_rate_limited(refused)


def test_an_admitted_response_without_its_headers_fails_unless_none_are_expected(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **ANON, "ENABLED": False}
    response = APIClient().get("/t/ping")
    with pytest.raises(AssertionError) as failure:
        testing.assert_not_rate_limited(response)
    assert str(failure.value).splitlines()[1:] == [
        "- RateLimit-Policy: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
        "- RateLimit: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
        "- X-RateLimit-Limit: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
        "- X-RateLimit-Remaining: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
        "- X-RateLimit-Used: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
        "- X-RateLimit-Reset: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
        "- X-RateLimit-Resource: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')",
    ]
    testing.assert_not_rate_limited(response, headers=False)


def remade(response: Any, change: Callable[[dict[str, Any], dict[str, str]], Any]) -> HttpResponse:
    """A copy of ``response`` with its body and headers changed by ``change(body, headers)``, for its request."""
    body = json.loads(response.content)
    headers = dict(response.headers)
    change(body, headers)
    content = headers.pop("Content-Type", None)
    copy = HttpResponse(json.dumps(body), status=response.status_code, content_type=content)
    for name, value in headers.items():
        copy[name] = value
    copy.wsgi_request = response.wsgi_request  # type: ignore[attr-defined]
    return copy


def pop(name: str) -> Callable[[dict[str, Any], dict[str, str]], Any]:
    return lambda body, headers: headers.pop(name)


#: One thing wrong with a real 429 each, and the line the assertion must say it with.
BREAKAGES: list[tuple[str, Callable[[dict[str, Any], dict[str, str]], Any], str]] = [
    ("no Retry-After", pop("Retry-After"), "- Retry-After: missing"),
    ("Retry-After in ms", lambda b, h: h.update({"Retry-After": "30000"}), "makes it 30"),
    ("Retry-After of 0", lambda b, h: h.update({"Retry-After": "0"}), "not a whole number of seconds of at least 1"),
    (
        "DRF's own body",
        lambda b, h: h.update({"Content-Type": "application/json"}),
        "set REST_FRAMEWORK['EXCEPTION_HANDLER'] to 'ratelimits.drf.exception_handler'",
    ),
    ("no violations", lambda b, h: b.pop("violations"), "- body: violations is None, expected a non-empty list"),
    ("a status of 400", lambda b, h: b.update({"status": 400}), "- body: status is 400, expected 429"),
    (
        "a wait shorter than a violation's",
        lambda b, h: b.update({"retry_after_ms": 5}),
        "but the longest violation's is 30000",
    ),
    ("no RateLimit", pop("RateLimit"), "- RateLimit: missing (RATELIMITS['HEADERS']['STYLE'] is 'both')"),
    (
        "a RateLimit-Policy without a window",
        lambda b, h: h.update({"RateLimit-Policy": '"tier:anon";q=2'}),
        "neither a window w >= 1",
    ),
    (
        "headers about another policy",
        lambda b, h: h.update({"X-RateLimit-Resource": "tier:paid"}),
        "- X-RateLimit-Resource: describes 'tier:paid', which is not among the violated policies ['tier:anon']",
    ),
    (
        "a subject the schema does not know",
        lambda b, h: b["violations"][0].update({"subject": "planet"}),
        "- OpenAPI: body: ['violations'][0]['subject'] 'planet' is not one of",
    ),
    (
        "an undocumented header",
        lambda b, h: h.update({"X-RateLimit-Bucket": "7"}),
        "- OpenAPI: X-RateLimit-Bucket sent, but not documented in the schema's 429 of GET /t/ping",
    ),
]


@pytest.mark.parametrize(("change", "expected"), [b[1:] for b in BREAKAGES], ids=[b[0] for b in BREAKAGES])
def test_a_429_made_wrong_fails_saying_what_differs(
    documented: None, change: Callable[[dict[str, Any], dict[str, str]], Any], expected: str
) -> None:
    refused, _ = denied()
    testing.assert_rate_limited(remade(refused, lambda body, headers: None), openapi=True)  # the copy is faithful
    with pytest.raises(AssertionError) as failure:
        testing.assert_rate_limited(remade(refused, change), openapi=True)
    message = str(failure.value)
    assert message.startswith("GET /t/ping: the 429 is not as expected:\n- ")
    assert expected in message


def test_what_the_test_expects_is_checked_too(documented: None) -> None:
    refused, _ = denied()
    with pytest.raises(AssertionError) as failure:
        testing.assert_rate_limited(refused, policy="tier:paid", retry_after=29)
    assert str(failure.value).splitlines()[1:] == [
        "- violated-policies: ['tier:anon'] does not name 'tier:paid'",
        "- Retry-After: 30, expected 29",
    ]


# -- the pytest fixtures, from a project's own suite ---------------------------------------------


INNER_CONFTEST_WITH_PYTEST_DJANGO = """
pytest_plugins = ["ratelimits.testing.pytest"]
"""

#: A project that turns the limiter off for its suite, and names a Redis nobody runs.
SWITCHED_OFF_SETTINGS = """
from tests.settings import *  # noqa: F403

RATELIMITS = {{
    "ENABLED": False,
    "BACKEND": "redis",
    "REDIS": {{"URL": "redis://127.0.0.1:{port}/0"}},
    "TIERS": {{"anon": {{"rate": "2/m"}}, "paid": {{"rate": "2/m"}}}},
    "POLICIES": {{"DEFAULT_TIERS": {{"anonymous": "anon", "authenticated": "paid"}}}},
}}
"""

SWITCHED_OFF_SUITE = """
from rest_framework.test import APIClient

from ratelimits.conf import conf
from ratelimits.testing import assert_not_rate_limited, assert_rate_limited, limiter


def get(path="/t/ping"):
    return APIClient().get(path)


def switched_off():
    responses = [get() for _ in range(5)]
    assert [r.status_code for r in responses] == [200] * 5
    assert [name for r in responses for name in r.headers if "ratelimit" in name.lower()] == []
    assert not conf.enabled and conf.backend == "redis"


def test_off_for_the_suite():
    switched_off()


def test_a_limiter_of_its_own(ratelimits_limiter):
    assert [get().status_code for _ in range(2)] == [200, 200]
    assert_rate_limited(get(), policy="tier:anon", retry_after=30)
    ratelimits_limiter.advance(30)
    assert_not_rate_limited(get())
    assert_rate_limited(get())


def test_a_limiter_of_its_own_again_with_nothing_spent(ratelimits_limiter):
    assert [get("/t/plain").status_code for _ in range(2)] == [200, 200]
    assert_rate_limited(get("/t/plain"))


def test_settings_changed_inside(settings, ratelimits_limiter):
    # pytest-django's settings fixture set up first: undone after the limiter's block closes.
    settings.RATELIMITS = {**settings.RATELIMITS, "TIERS": {"anon": {"rate": "1/m"}, "paid": {"rate": "1/m"}}}
    assert get().status_code == 200
    assert_rate_limited(get(), retry_after=60)


isolated = limiter()


@isolated
def test_a_decorated_test_with_a_fixture(client):
    assert [client.get("/t/ping").status_code for _ in range(2)] == [200, 200]
    assert_rate_limited(client.get("/t/ping"))
    isolated.advance(30)
    assert_not_rate_limited(client.get("/t/ping"))


def test_off_again_after_them():
    switched_off()
"""

#: A project that has the limiter on, and runs pytest without pytest-django.
INNER_CONFTEST_WITHOUT_PYTEST_DJANGO = """
import django

pytest_plugins = ["ratelimits.testing.pytest"]

django.setup()
"""

SWITCHED_ON_SUITE = """
from django.test import Client

from ratelimits.testing import assert_rate_limited


def test_switched_off_for_one_test(ratelimits_disabled):
    assert [Client().get("/t/ping").status_code for _ in range(5)] == [200] * 5
    assert "RateLimit" not in Client().get("/t/ping")


def test_on_for_the_next(ratelimits_limiter):
    client = Client()
    assert [client.get("/t/ping").status_code for _ in range(3)] == [200, 200, 200]
    assert_rate_limited(client.get("/t/ping"), policy="tier:anon")
"""

SWITCHED_ON_SETTINGS = """
from tests.settings import *  # noqa: F403

RATELIMITS = {
    "BACKEND": "memory",
    "TIERS": {"anon": {"rate": "3/m"}, "paid": {"rate": "3/m"}},
    "POLICIES": {"DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "paid"}},
}
"""


@pytest.fixture
def inner_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project directory whose Python path reaches this repository (its settings, views and ratelimits)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path), str(ROOT)]))
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "inner_settings")
    monkeypatch.delenv("DATABASE_URL", raising=False)  # SQLite in memory, whatever the outer suite uses
    return pytester


def test_the_fixtures_in_a_suite_that_switches_the_limiter_off(inner_project: pytest.Pytester) -> None:
    inner_project.makepyfile(
        inner_settings=SWITCHED_OFF_SETTINGS.format(port=free_port()),
        conftest=INNER_CONFTEST_WITH_PYTEST_DJANGO,
        test_inner=SWITCHED_OFF_SUITE,
    )
    result = inner_project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)


def test_the_fixtures_without_pytest_django(inner_project: pytest.Pytester) -> None:
    inner_project.makepyfile(
        inner_settings=SWITCHED_ON_SETTINGS,
        conftest=INNER_CONFTEST_WITHOUT_PYTEST_DJANGO,
        test_inner=SWITCHED_ON_SUITE,
    )
    result = inner_project.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:django")
    result.assert_outcomes(passed=2)


def test_importing_the_kit_imports_no_pytest() -> None:
    code = "import django; django.setup(); import ratelimits.testing, sys; print('pytest' in sys.modules)"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False"


@pytest.fixture(autouse=True)
def _no_limiter_left_open() -> Iterator[None]:
    yield
    assert _stand_ins == []
