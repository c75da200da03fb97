"""``ratelimits.decorators``: django-ratelimit's ``@ratelimit``, ``is_ratelimited`` and ``get_usage``
on this engine, and ``throttle``.

Views are called with requests from ``RequestFactory`` (or Django's test client, through this
module's own URLconf, where a middleware or the handler must take part). The memory backend is
the default; the tests that touch what the store does run on the suite's real redis-server too.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import Client, RequestFactory
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory

from ratelimits.algorithms import token_bucket
from ratelimits.backends.memory import MemoryBackend
from ratelimits.backends.redis import DECIDE, RedisBackend
from ratelimits.conf import conf
from ratelimits.decisions import Decision
from ratelimits.decorators import (
    ALL,
    UNSAFE,
    aget_usage,
    ais_ratelimited,
    get_usage,
    is_ratelimited,
    ratelimit,
    throttle,
)
from ratelimits.middleware import ratelimit as old_ratelimit

from .support.aio import event_loop_thread
from .support.clock import FakeClock
from .support.redis_server import RedisServer, script_calls
from .support.settings import merged
from .test_concurrency import gcra_envelope_violations
from .test_round_trips import recorded_commands, top_level

rf = RequestFactory()
MINUTE = 60_000_000


class User:
    """What a key reads of ``request.user``: a pk, and whether it is authenticated."""

    def __init__(self, pk: int | None) -> None:
        self.pk = pk
        self.is_authenticated = pk is not None


def get(path: str = "/", *, ip: str = "192.0.2.1", user: int | None = None, **extra: Any) -> HttpRequest:
    request = rf.get(path, REMOTE_ADDR=ip, **extra)
    request.user = User(user)  # type: ignore[attr-defined]
    return request


def post(path: str = "/", data: dict[str, str] | None = None, *, ip: str = "192.0.2.1") -> HttpRequest:
    request = rf.post(path, data or {}, REMOTE_ADDR=ip)
    request.user = User(None)  # type: ignore[attr-defined]
    return request


def limited(view: Callable[[HttpRequest], HttpResponse], request: HttpRequest) -> bool:
    """Call ``view``; whether it saw ``request.limited`` (the view below returns it)."""
    response = view(request)
    assert response.status_code == 200, response.content
    return bool(json.loads(response.content)["limited"])


def says_limited(request: HttpRequest) -> HttpResponse:
    """A view that answers ``request.limited`` (``None`` if no ``@ratelimit`` set it)."""
    return HttpResponse(json.dumps({"limited": getattr(request, "limited", None)}), content_type="application/json")


def annotated(**kwargs: Any) -> Callable[[HttpRequest], HttpResponse]:
    """A view limited with ``block=False`` that answers whether it was limited."""
    return ratelimit(block=False, **kwargs)(says_limited)


def tenant_of(group: str, request: HttpRequest) -> str:
    """A key function named by its dotted path."""
    return request.headers.get("X-Tenant", "none")


def hourly_for_anonymous(group: str, request: HttpRequest) -> str | None:
    """A rate function named by its dotted path: authenticated callers are not limited."""
    return None if request.user.is_authenticated else "1/h"  # type: ignore[attr-defined]


# -- keys ----------------------------------------------------------------------------------------


def test_ip_key_counts_each_client_address() -> None:
    view = annotated(key="ip", rate="2/h")
    assert [limited(view, get(ip="192.0.2.1")) for _ in range(3)] == [False, False, True]
    assert limited(view, get(ip="192.0.2.2")) is False


def test_ip_key_is_the_client_ip_every_limit_sees(settings: Any) -> None:
    """Behind a trusted proxy, the forwarded address; IPv6 counted per /64 (IDENTITY's settings)."""
    settings.RATELIMITS = merged(settings.RATELIMITS, {"IDENTITY": {"TRUSTED_PROXIES": ["10.0.0.0/8"]}})
    view = annotated(key="ip", rate="1/h")
    assert limited(view, get(ip="10.0.0.5", HTTP_X_FORWARDED_FOR="198.51.100.7")) is False
    assert limited(view, get(ip="10.0.0.6", HTTP_X_FORWARDED_FOR="198.51.100.7")) is True  # another proxy hop
    assert limited(view, get(ip="10.0.0.5", HTTP_X_FORWARDED_FOR="198.51.100.8")) is False
    # Two addresses of one /64 are one client; another /64 is another.
    assert limited(view, get(ip="2001:db8:0:1::1")) is False
    assert limited(view, get(ip="2001:db8:0:1::2")) is True
    assert limited(view, get(ip="2001:db8:0:2::1")) is False


def test_user_key_counts_each_user_and_anonymous_callers_together() -> None:
    view = annotated(key="user", rate="1/h")
    assert [limited(view, get(user=1)), limited(view, get(user=1))] == [False, True]
    assert limited(view, get(user=2)) is False
    # As in django-ratelimit, anonymous callers share one bucket, whatever their address.
    assert [limited(view, get(ip="192.0.2.1")), limited(view, get(ip="192.0.2.2"))] == [False, True]


def test_user_or_ip_key() -> None:
    view = annotated(key="user_or_ip", rate="1/h")
    assert [limited(view, get(user=7, ip="192.0.2.1")), limited(view, get(user=7, ip="192.0.2.2"))] == [False, True]
    assert [limited(view, get(ip="192.0.2.1")), limited(view, get(ip="192.0.2.1"))] == [False, True]
    assert limited(view, get(ip="192.0.2.2")) is False  # anonymous: by address


def test_user_key_without_authentication_middleware_counts_as_anonymous() -> None:
    view = annotated(key="user_or_ip", rate="1/h")
    assert [limited(view, rf.get("/", REMOTE_ADDR="192.0.2.9")) for _ in range(2)] == [False, True]


def test_header_key() -> None:
    view = annotated(key="header:x-cluster-client-ip", rate="1/h")
    assert limited(view, get(HTTP_X_CLUSTER_CLIENT_IP="a")) is False
    assert limited(view, get(HTTP_X_CLUSTER_CLIENT_IP="a")) is True
    assert limited(view, get(HTTP_X_CLUSTER_CLIENT_IP="b")) is False


@pytest.mark.urls("tests.test_decorators")
def test_a_missing_header_counts_as_empty_and_never_fails() -> None:
    """Every request without the header shares the "" bucket (as in django-ratelimit), through the
    whole handler: no 500."""
    client = Client()
    assert client.get("/header", headers={"X-Api-Client": "one"}).status_code == 200
    assert client.get("/header").status_code == 200
    assert client.get("/header").status_code == 429  # the "" bucket is spent
    assert client.get("/header", headers={"X-Api-Client": "two"}).status_code == 200


@pytest.mark.urls("tests.test_decorators")
def test_a_form_body_django_cannot_parse_is_its_400_not_a_500() -> None:
    client = Client(raise_request_exception=False)
    assert client.post("/login", {"username": "ann"}).status_code == 200
    broken = client.post("/login", b"--x\r\nno headers", content_type="multipart/form-data; boundary=")
    assert broken.status_code == 400


def test_get_and_post_keys() -> None:
    search = annotated(key="get:q", rate="1/h")
    assert [limited(search, get("/?q=a")), limited(search, get("/?q=a"))] == [False, True]
    assert limited(search, get("/?q=b")) is False
    login = annotated(key="post:username", rate="1/h")
    assert [limited(login, post(data={"username": "ann"})) for _ in range(2)] == [False, True]
    assert limited(login, post(data={"username": "bob"})) is False
    assert [limited(login, post()), limited(login, post(data={"other": "x"}))] == [False, True]  # both ""


def test_callable_key_and_its_dotted_path() -> None:
    by_tenant = annotated(key=tenant_of, rate="1/h")
    assert [limited(by_tenant, get(HTTP_X_TENANT="acme")) for _ in range(2)] == [False, True]
    by_path = annotated(key="tests.test_decorators.tenant_of", rate="1/h", group="by-path")
    assert [limited(by_path, get(HTTP_X_TENANT="acme")) for _ in range(2)] == [False, True]
    assert limited(by_path, get(HTTP_X_TENANT="globex")) is False
    as_bytes = annotated(key=lambda group, request: b"\xff raw", rate="1/h")
    assert [limited(as_bytes, get()) for _ in range(2)] == [False, True]


def test_long_values_are_counted_by_their_hash() -> None:
    view = annotated(key="get:q", rate="1/h")
    long = "x" * 100_000
    assert [limited(view, get(f"/?q={long}")), limited(view, get(f"/?q={long}"))] == [False, True]
    assert limited(view, get(f"/?q={long}y")) is False


def test_a_key_function_that_returns_no_str_is_named_in_the_error() -> None:
    view = annotated(key=lambda group, request: 42, rate="1/h")
    with pytest.raises(ImproperlyConfigured, match="a key's value must be a str"):
        view(get())


# -- block, request.limited, stacking ------------------------------------------------------------


def test_block_answers_the_throttles_429() -> None:
    view = ratelimit(key="ip", rate="1/h")(says_limited)
    first, request = view(get()), get()
    denied = view(request)
    assert first.status_code == 200 and json.loads(first.content) == {"limited": False}
    assert denied.status_code == 429
    assert denied["Content-Type"] == "application/problem+json"
    assert denied["Retry-After"] == "3600"
    body = json.loads(denied.content)
    name = "group:tests.test_decorators.says_limited:1/h"
    assert body["violated-policies"] == [name]
    assert body["violations"][0] | {"retry_after_ms": 0} == {
        "policy": name,
        "subject": "ip",
        "limit": 1,
        "remaining": 0,
        "window_seconds": 3600,
        "retry_after_ms": 0,
    }
    assert denied["RateLimit"].startswith(f'"{name}";r=0;')
    assert request.limited is True  # type: ignore[attr-defined]  # set for middlewares and handlers too


def test_admitted_responses_carry_the_limits_headers() -> None:
    response = ratelimit(key="ip", rate="5/m")(says_limited)(get())
    assert response["RateLimit-Policy"] == '"group:tests.test_decorators.says_limited:5/m";q=5;w=60'
    assert response["RateLimit"] == '"group:tests.test_decorators.says_limited:5/m";r=4;t=12'
    assert response["X-RateLimit-Remaining"] == "4"


def passthrough(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Another decorator: a ``@ratelimit`` above it decides apart from one below it."""
    return lambda request: view(request)


@pytest.mark.parametrize("between", [None, passthrough])
def test_request_limited_is_false_when_admitted_and_stays_true_once_limited(between: Any) -> None:
    """Stacked directly (decided together) or with another decorator between (one after the other)."""
    tight = ratelimit(key=lambda g, r: "min", rate="1/h", block=False)
    roomy = ratelimit(key=lambda g, r: "day", rate="10/d", block=False)
    inner = roomy(says_limited)
    view = tight(inner if between is None else between(inner))
    assert limited(view, get()) is False
    assert limited(view, get()) is True  # the outer one is over, the inner one is not: still limited


def test_stacked_limits_are_all_or_nothing() -> None:
    """Decided together: a request the tight limit refuses spends nothing of the roomy one."""
    view = ratelimit(key="ip", rate="5/h", group="roomy")(ratelimit(key="ip", rate="1/h", group="tight")(says_limited))
    assert view(get()).status_code == 200
    assert [view(get()).status_code for _ in range(3)] == [429] * 3
    usage = get_usage(get(), group="roomy", key="ip", rate="5/h")
    assert usage is not None and usage["count"] == 1


def test_an_annotating_limit_over_its_rate_does_not_spare_a_blocking_one() -> None:
    """block=False over its limit runs the view: the blocking limit beside it is charged all the same."""
    view = ratelimit(key="ip", rate="3/h", group="blocking")(
        ratelimit(key="ip", rate="1/h", group="annotating", block=False)(says_limited)
    )
    assert [limited(view, get()) for _ in range(3)] == [False, True, True]
    assert view(get()).status_code == 429  # three admitted: the blocking limit's 3/h is spent


def test_method_decorator_on_a_class_based_view() -> None:
    class Login(View):
        @method_decorator(ratelimit(key="ip", rate="1/h"))
        def post(self, request: HttpRequest) -> HttpResponse:
            return HttpResponse("ok")

        def get(self, request: HttpRequest) -> HttpResponse:
            return HttpResponse("form")

    view = Login.as_view()
    assert view(post()).status_code == 200
    denied = view(post())
    assert denied.status_code == 429
    assert json.loads(denied.content)["violated-policies"][0].startswith(
        "group:tests.test_decorators.test_method_decorator_on_a_class_based_view._locals_.Login.post-"
    )
    assert view(get()).status_code == 200


def test_as_view_functions_of_two_classes_are_two_groups() -> None:
    class One(View):
        def get(self, request: HttpRequest) -> HttpResponse:
            return HttpResponse("one")

    class Two(One):
        pass

    one, two = (ratelimit(key="ip", rate="1/h")(cls.as_view()) for cls in (One, Two))
    assert [one(get()).status_code, two(get()).status_code] == [200, 200]


# -- django-ratelimit's own examples ---------------------------------------------------------------


def test_the_examples_of_django_ratelimits_usage_page_run_unchanged() -> None:
    """Its docs/usage.rst examples, decorators as written there (only the import differs)."""

    @ratelimit(key="ip", rate="5/m", block=False)
    def myview(request: HttpRequest) -> HttpResponse:
        was_limited = getattr(request, "limited", False)
        return HttpResponse(json.dumps({"limited": was_limited}))

    assert [limited(myview, get()) for _ in range(6)] == [False] * 5 + [True]

    @ratelimit(key="ip", rate="5/m", block=True)
    def blocked(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert [blocked(get()).status_code for _ in range(6)] == [200] * 5 + [429]

    @ratelimit(key="post:username", rate="5/m", method=["GET", "POST"], block=False)
    def login(request: HttpRequest) -> HttpResponse:
        return says_limited(request)

    assert [limited(login, post(data={"username": "ann"})) for _ in range(6)] == [False] * 5 + [True]

    @ratelimit(key="post:username", rate="5/m")
    @ratelimit(key="post:tenant", rate="5/m")
    def two_keys(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    sent = [two_keys(post(data={"username": "bob", "tenant": f"t{i}"})).status_code for i in range(6)]
    assert sent == [200] * 5 + [429]  # the username's 5/m, whatever the tenant

    @ratelimit(key="get:q", rate="5/m")
    @ratelimit(key="post:q", rate="5/m")
    def search(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert [search(get("/?q=cats")).status_code for _ in range(6)] == [200] * 5 + [429]

    @ratelimit(key="ip", rate="4/h")
    def slow(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert [slow(get()).status_code for _ in range(5)] == [200] * 4 + [429]

    get_rate = lambda g, r: None if r.user.is_authenticated else "100/h"  # noqa: E731

    @ratelimit(key="ip", rate=get_rate)
    def skipif1(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert [skipif1(get(user=1)).status_code for _ in range(150)] == [200] * 150

    @ratelimit(key="user_or_ip", rate="10/s")
    @ratelimit(key="user_or_ip", rate="100/m")
    def burst_limit(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert burst_limit(get()).status_code == 200  # (how many follow within the second depends on time)

    @ratelimit(group="expensive", key="user_or_ip", rate="10/h")
    def expensive_view_a(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    @ratelimit(group="expensive", key="user_or_ip", rate="10/h")
    def expensive_view_b(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    shared = [(expensive_view_a if i % 2 else expensive_view_b)(get()).status_code for i in range(11)]
    assert shared == [200] * 10 + [429]

    @ratelimit(key="header:x-cluster-client-ip")
    def post_view(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    assert post_view(get(HTTP_X_CLUSTER_CLIENT_IP="1.2.3.4")).status_code == 200  # no rate: no limit

    @ratelimit(key=lambda g, r: r.META.get("HTTP_X_CLUSTER_CLIENT_IP", r.META["REMOTE_ADDR"]), rate="1/m")
    def fallback(request: HttpRequest) -> HttpResponse:
        return HttpResponse()

    statuses = [fallback(get(HTTP_X_CLUSTER_CLIENT_IP="1.2.3.4")).status_code, fallback(get(ip="1.2.3.4")).status_code]
    assert statuses == [200, 429]  # the header's value, else the address: one value, one bucket

    class MyView(View):
        @method_decorator(ratelimit(key="ip", rate="1/m", method="GET"))
        def get(self, request: HttpRequest) -> HttpResponse:
            return HttpResponse()

    @method_decorator(ratelimit(key="ip", rate="1/m", method="GET"), name="get")
    class MyOtherView(View):
        def get(self, request: HttpRequest) -> HttpResponse:
            return HttpResponse()

    wrapped_later = ratelimit(key="ip", method="GET", rate="1/m")(MyOtherView.as_view())
    for n, view in enumerate((MyView.as_view(), MyOtherView.as_view(), wrapped_later)):
        ip = f"198.51.100.{n}"  # wrapped_later's view is MyOtherView's, limited by both decorators
        assert [view(get(ip=ip)).status_code, view(get(ip=ip)).status_code] == [200, 429]


# -- methods and groups --------------------------------------------------------------------------


def test_method_filtering() -> None:
    posts = annotated(key="ip", rate="1/h", method="POST")
    assert [limited(posts, get()) for _ in range(3)] == [False] * 3  # not counted at all
    assert [limited(posts, post()), limited(posts, post())] == [False, True]
    unsafe = annotated(key="ip", rate="0/m", method=UNSAFE, group="unsafe")
    assert [limited(unsafe, rf.generic(m, "/", REMOTE_ADDR="192.0.2.1")) for m in ("GET", "HEAD", "OPTIONS")] == [
        False
    ] * 3
    assert all(limited(unsafe, rf.generic(m, "/", REMOTE_ADDR="192.0.2.1")) for m in ("DELETE", "PATCH", "POST", "PUT"))
    both = annotated(key="ip", rate="1/h", method=["get", "post"], group="both")
    assert [limited(both, get()), limited(both, post())] == [False, True]
    everything = annotated(key="ip", rate="1/h", method=ALL, group="all")
    assert [limited(everything, get()), limited(everything, post())] == [False, True]


def test_stacked_limits_on_two_methods_count_apart() -> None:
    view = annotated(key="ip", rate="1/h", method="GET")
    view = ratelimit(key="ip", rate="1/h", method="POST", block=False)(view)
    assert [limited(view, get()), limited(view, post()), limited(view, get()), limited(view, post())] == [
        False,
        False,
        True,
        True,
    ]


def test_one_group_shared_by_two_views() -> None:
    a = annotated(group="expensive", key="user_or_ip", rate="2/h")
    b = annotated(group="expensive", key="user_or_ip", rate="2/h")
    assert [limited(a, get()), limited(b, get()), limited(a, get()), limited(b, get())] == [False, False, True, True]
    c = annotated(key="user_or_ip", rate="2/h")  # its own group: the view's name
    assert limited(c, get()) is False


# -- rates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "admitted"),
    [("3/h", 3), ("3/2h", 3), ("3/7200", 3), ((3, 7200), 3), ("0/m", 0), ((0, 60), 0), (None, 6)],
)
def test_rate_forms(rate: Any, admitted: int) -> None:
    view = annotated(key="ip", rate=rate)
    assert [limited(view, get()) for _ in range(6)] == [False] * admitted + [True] * (6 - admitted)


def test_callable_rate_and_none_for_no_limit() -> None:
    def by_caller(group: str, request: HttpRequest) -> Any:
        if request.GET.get("vip"):
            return None
        return (2, 3600) if request.user.is_authenticated else "1/h"  # type: ignore[attr-defined]

    view = annotated(key="user_or_ip", rate=by_caller)
    assert [limited(view, get("/?vip=1")) for _ in range(5)] == [False] * 5
    assert [limited(view, get()), limited(view, get())] == [False, True]
    assert [limited(view, get(user=1)) for _ in range(3)] == [False, False, True]
    by_path = annotated(key="ip", rate="tests.test_decorators.hourly_for_anonymous", group="by-path")
    assert [limited(by_path, get(user=3)) for _ in range(3)] == [False] * 3
    assert [limited(by_path, get()), limited(by_path, get())] == [False, True]


def test_a_zero_rate_refuses_without_asking_the_store() -> None:
    response = ratelimit(key="ip", rate=lambda g, r: "0/m")(says_limited)(get())
    assert response.status_code == 429
    assert response["Retry-After"] == "60"
    assert json.loads(response.content)["violations"] == []


def test_burst() -> None:
    view = annotated(key="ip", rate="1/h", burst=3)
    assert [limited(view, get()) for _ in range(4)] == [False, False, False, True]
    named = ratelimit(key="ip", rate="1/h", burst=3, method="POST")(says_limited)(post())
    assert named["RateLimit-Policy"] == '"group:tests.test_decorators.says_limited:1/h:burst3:POST";q=3;w=10800'


# -- is_ratelimited and get_usage ----------------------------------------------------------------


def test_is_ratelimited_without_increment_spends_nothing() -> None:
    ask = dict(group="login", key="post:username", rate="3/h")
    request = post(data={"username": "ann"})
    assert [is_ratelimited(request, **ask) for _ in range(50)] == [False] * 50
    assert get_usage(request, **ask) == {"count": 0, "limit": 3, "should_limit": False, "time_left": 0}
    assert [is_ratelimited(request, increment=True, **ask) for _ in range(4)] == [False, False, False, True]
    assert [is_ratelimited(request, **ask) for _ in range(5)] == [True] * 5  # and refusals spent nothing either
    usage = get_usage(request, **ask)
    assert usage is not None
    assert (usage["count"], usage["limit"], usage["should_limit"]) == (3, 3, True)
    assert 1190 <= usage["time_left"] <= 1200  # one token back in 20 minutes


def test_a_peek_between_counts_changes_nothing() -> None:
    """Counting, peeking 100 times, counting: exactly the burst is admitted, as without the peeks."""
    ask = dict(group="g", key="ip", rate="4/h")
    assert is_ratelimited(get(), increment=True, **ask) is False
    for _ in range(100):
        assert is_ratelimited(get(), **ask) is False
    assert [is_ratelimited(get(), increment=True, **ask) for _ in range(4)] == [False, False, False, True]


def test_get_usage_counts_with_increment() -> None:
    ask = dict(fn=says_limited, key="ip", rate="2/m")
    first = get_usage(get(), increment=True, **ask)
    assert first == {"count": 1, "limit": 2, "should_limit": False, "time_left": 30}
    assert get_usage(get(), increment=True, **ask) == {"count": 2, "limit": 2, "should_limit": False, "time_left": 60}
    third = get_usage(get(), increment=True, **ask)
    assert third is not None and third["should_limit"] and third["count"] == 2 and 29 <= third["time_left"] <= 30
    # fn= names the same group as the decorator on that view.
    assert ratelimit(key="ip", rate="2/m")(says_limited)(get()).status_code == 429
    assert get_usage(get(), method="POST", **ask) is None  # not this method: no limit applies
    assert get_usage(get(), fn=says_limited, key="ip", rate=None) is None


def test_is_ratelimited_needs_a_group_or_a_function() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"is_ratelimited\(\) needs group= or fn="):
        is_ratelimited(get(), key="ip", rate="1/m")
    assert is_ratelimited.ALL == ALL and is_ratelimited.UNSAFE == UNSAFE  # type: ignore[attr-defined]
    assert ratelimit.UNSAFE == UNSAFE  # type: ignore[attr-defined]


# -- policies ------------------------------------------------------------------------------------

TIERS = {"TIERS": {"anonymous": {"rate": "2/h"}, "authenticated": {"rate": "10/h"}}}


def test_the_callers_tier_is_not_charged_unless_asked(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS}
    own = ratelimit(key="ip", rate="100/h")(says_limited)
    assert [own(get()).status_code for _ in range(5)] == [200] * 5
    engine_view = throttle(endpoint="tiered")(says_limited)
    assert [engine_view(get()).status_code for _ in range(3)] == [200, 200, 429]  # the tier was untouched


def test_policies_adds_the_callers_tier_to_the_same_decision(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS}
    view = ratelimit(key="ip", rate="100/h", policies=True)(says_limited)
    request = get()
    assert view(request).status_code == 200
    decision = request.ratelimit  # type: ignore[attr-defined]
    assert isinstance(decision, Decision)
    assert [r.policy_name for r in decision.results] == [
        "group:tests.test_decorators.says_limited:100/h",
        "tier:anonymous",
    ]
    assert view(get()).status_code == 200
    denied = view(get())
    assert denied.status_code == 429
    assert json.loads(denied.content)["violated-policies"] == ["tier:anonymous"]


@pytest.mark.urls("tests.test_decorators")
def test_policies_under_the_middleware_charge_the_tier_once(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS}
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "ratelimits.middleware.RateLimitMiddleware"]
    client = Client()
    assert [client.get("/policies").status_code for _ in range(3)] == [200, 200, 429]


def test_under_a_drf_function_view_the_throttles_decision_is_not_made_again(settings: Any) -> None:
    """DRF's throttle decides the request's policies first; a @ratelimit(policies=True) below it
    adds only its own limit."""
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS}

    @api_view(["POST"])
    @ratelimit(group="login", key="post:username", rate="1/h", policies=True)
    def login(request: Request) -> Response:
        return Response({"limited": request.limited})  # type: ignore[attr-defined]

    factory = APIRequestFactory(REMOTE_ADDR="192.0.2.30")
    first = login(factory.post("/", {"username": "ann"}))
    assert first.status_code == 200 and first.data == {"limited": False}
    assert first["RateLimit-Policy"] == '"tier:anonymous";q=2;w=3600'  # DRF writes its throttle's over the view's
    denied = login(factory.post("/", {"username": "ann"}))
    assert denied.status_code == 429
    assert json.loads(denied.content)["violated-policies"] == ["group:login:1/h"]
    assert login(factory.post("/", {"username": "bob"})).status_code == 429  # the tier: 2/h, charged once each


def test_policies_around_a_drf_view_are_refused_when_decorated() -> None:
    """Its throttle runs after the decorator and would decide the same policies again."""

    @api_view(["GET"])
    def ping(request: Request) -> Response:
        return Response({})

    with pytest.raises(ImproperlyConfigured, match=r"ratelimit\(policies=True\) around a DRF view"):
        ratelimit(key="ip", rate="1/h", policies=True)(ping)
    with pytest.raises(ImproperlyConfigured, match=r"ratelimit\(policies=True\) around a DRF view"):
        ratelimit(key="ip", rate="1/h", policies=True)(ratelimit(key="user", rate="1/h")(ping))
    assert ratelimit(key="ip", rate="1/h")(ping)(APIRequestFactory().get("/")).status_code == 200


# -- the old decorator ---------------------------------------------------------------------------


def test_the_old_decorator_warns_and_keeps_working(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS}
    with pytest.warns(DeprecationWarning, match=r"use ratelimits\.decorators\.throttle\(endpoint=\.\.\.\)") as caught:
        old = old_ratelimit(scope="old")(says_limited)
    assert caught[0].filename == __file__  # it points at the decorated view, not at ratelimits
    with pytest.warns(DeprecationWarning, match=r"use ratelimits\.decorators\.throttle\(endpoint=\.\.\.\)"):
        new_module = ratelimit(scope="old")(says_limited)
    statuses = [old(get()).status_code, new_module(get()).status_code, old(get()).status_code]
    assert statuses == [200, 200, 429]  # one endpoint "old", the caller's anonymous tier of 2/h


def test_throttle_needs_no_warning_and_takes_both_spellings(settings: Any) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bare = throttle(says_limited)
        named = throttle(endpoint="named")(says_limited)
    assert bare(get()).has_header("RateLimit") and named(get()).has_header("RateLimit")
    with pytest.raises(ImproperlyConfigured, match=r"throttle\(endpoint='named'\)"):
        throttle("named")  # type: ignore[call-overload]


def test_the_old_spelling_cannot_be_mixed_with_the_new() -> None:
    with pytest.raises(ImproperlyConfigured, match="takes no group, key or rate"):
        ratelimit(scope="x", key="ip")


# -- ENABLED -------------------------------------------------------------------------------------


def test_disabled_admits_everything_and_asks_no_store(settings: Any, use_redis: RedisServer) -> None:
    settings.RATELIMITS = {**settings.RATELIMITS, "ENABLED": False}
    blocking = ratelimit(key="ip", rate="0/m")(says_limited)
    annotating = annotated(key="ip", rate="1/h", policies=True)
    before = script_calls(use_redis)
    assert [blocking(get()).status_code for _ in range(3)] == [200] * 3
    assert [limited(annotating, get()) for _ in range(3)] == [False] * 3
    assert is_ratelimited(get(), group="g", key="ip", rate="0/m", increment=True) is False
    assert get_usage(get(), group="g", key="ip", rate="1/h") is None
    assert not blocking(get()).has_header("RateLimit")
    assert script_calls(use_redis) == before


# -- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rate": "1/m"}, r"ratelimit\(key=\.\.\.\) is required"),
        ({"key": "ip "}, r"ratelimit\(key='ip '\) is not a key"),
        ({"key": "header:"}, r"ratelimit\(key='header:'\) is not a key"),
        ({"key": "cookie:session"}, r"ratelimit\(key='cookie:session'\) is not a key"),
        ({"key": 42}, r"ratelimit\(key=42\) is not a key"),
        ({"key": "no.such.module.key"}, r"ratelimit\(key='no.such.module.key'\): cannot import it"),
        ({"key": "tests.test_decorators.MINUTE"}, r"ratelimit\(key='tests.test_decorators.MINUTE'\) is not a callable"),
        ({"key": "ip", "rate": "5 per minute"}, r"ratelimit\(rate=\.\.\.\): '5 per minute' is not a rate"),
        ({"key": "ip", "rate": "5/fortnight"}, r"ratelimit\(rate=\.\.\.\): '5/fortnight' has an unknown unit"),
        ({"key": "ip", "rate": "0/fortnight"}, r"ratelimit\(rate=\.\.\.\): '0/fortnight' is not a rate"),
        ({"key": "ip", "rate": (5,)}, r"ratelimit\(rate=\.\.\.\): \(5,\) is not a rate"),
        ({"key": "ip", "rate": 5}, r"ratelimit\(rate=\.\.\.\): 5 is not a rate"),
        ({"key": "ip", "rate": "no.such.rate"}, r"ratelimit\(rate='no.such.rate'\): cannot import it"),
        ({"key": "ip", "rate": "1/m", "method": "G3T"}, r"ratelimit\(method='G3T'\) names no method"),
        ({"key": "ip", "rate": "1/m", "method": []}, r"ratelimit\(method=\[\]\) names no method"),
        ({"key": "ip", "rate": "1/m", "method": 5}, r"ratelimit\(method=5\) names no method"),
        ({"key": "ip", "rate": "1/m", "burst": 0}, r"ratelimit\(burst=\.\.\.\): 0 must be a positive integer"),
        ({"key": "ip", "rate": lambda g, r: "1/m", "burst": "x"}, r"ratelimit\(burst='x'\) must be a positive"),
        ({"key": "ip", "rate": "1/m", "block": "yes"}, r"ratelimit\(block='yes'\) must be True or False"),
        ({"key": "ip", "rate": "1/m", "group": ""}, r"ratelimit\(group=''\) must be a non-empty str"),
        ({"key": "ip", "rate": "1/m", "policies": "yes"}, r"ratelimit\(policies='yes'\) must be True or False"),
    ],
)
def test_bad_arguments_fail_at_decoration_naming_the_argument(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=needle):
        ratelimit(**kwargs)


def test_bare_decorator_is_refused_clearly() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"ratelimit\(group=<function says_limited"):
        ratelimit(says_limited)  # type: ignore[arg-type]


def test_a_bad_rate_returned_per_request_names_the_function() -> None:
    view = annotated(key="ip", rate=lambda g, r: "lots")
    with pytest.raises(ImproperlyConfigured, match=r"returned 'lots'.*is not a rate"):
        view(get())


# -- async views ---------------------------------------------------------------------------------


@ratelimit(key="user_or_ip", rate="1/h", block=False)
async def async_annotated(request: HttpRequest) -> HttpResponse:
    return says_limited(request)


@ratelimit(key="ip", rate="1/h")
async def async_blocking(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def async_get(user: int | None = None, ip: str = "192.0.2.1") -> HttpRequest:
    """A request whose user is read as an async view must: with ``auser()``, never ``request.user``."""
    request = rf.get("/", REMOTE_ADDR=ip)

    async def auser() -> User:
        return User(user)

    request.auser = auser  # type: ignore[attr-defined]
    return request


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":
        request.getfixturevalue("use_redis")
    yield request.param


def test_async_views(store: str) -> None:
    with event_loop_thread() as loop:  # one loop for every call, as an ASGI server's
        assert [json.loads(loop.run(async_annotated(async_get(user=5))).content)["limited"] for _ in range(2)] == [
            False,
            True,
        ]
        assert json.loads(loop.run(async_annotated(async_get(user=6))).content)["limited"] is False
        assert [loop.run(async_blocking(async_get())).status_code for _ in range(2)] == [200, 429]
        ask = dict(group="async", key="user", rate="1/h")
        assert loop.run(ais_ratelimited(async_get(user=5), **ask)) is False
        assert loop.run(aget_usage(async_get(user=5), increment=True, **ask)) == {
            "count": 1,
            "limit": 1,
            "should_limit": False,
            "time_left": 3600,
        }
        assert loop.run(ais_ratelimited(async_get(user=5), increment=True, **ask)) is True
    assert inspect.iscoroutinefunction(async_annotated)


# -- exactness: a token bucket where django-ratelimit counts fixed windows -----------------------

#: The decisions' clock in the exactness test: the store is asked the time the test sets.
CLOCK = FakeClock()


class ClockedMemory(MemoryBackend):
    @classmethod
    def from_settings(cls) -> ClockedMemory:
        return cls(prefix=conf.redis.key_prefix, clock=CLOCK)


class ClockedRedis(RedisBackend):
    @staticmethod
    def options_from_settings() -> dict[str, Any]:
        return {**RedisBackend.options_from_settings(), "clock": CLOCK}


def test_never_more_than_burst_plus_rate_times_elapsed_across_window_boundaries(
    settings: Any, store: str, request: pytest.FixtureRequest
) -> None:
    """5/m from one address: 5 requests a millisecond before a minute's boundary and 5 a
    millisecond after it, then one every 250 ms for two minutes. django-ratelimit's fixed window
    admits all ten around the boundary; the bucket admits 5 there, and over every span of the run
    at most 5 + 5/min x its length, exactly what the reference algorithm admits."""
    if store == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        settings.RATELIMITS = merged(
            settings.RATELIMITS,
            {
                "BACKEND": "tests.test_decorators.ClockedRedis",
                "REDIS": {"URL": server.url, "CLOCK": "app"},
                # A denial remembered, or a lease, runs on the real clock.
                "LOCAL_PATH": {"DENIALS": False, "LEASES": False},
            },
        )
    else:
        settings.RATELIMITS = {**settings.RATELIMITS, "BACKEND": "tests.test_decorators.ClockedMemory"}
    boundary = 28_333_334 * MINUTE  # a whole minute of the epoch, in microseconds
    arrivals = [boundary - 1_000] * 5 + [boundary + 1_000] * 5
    arrivals += [boundary + 1_000 + 250_000 * i for i in range(1, 481)]
    view = ratelimit(key="ip", rate="5/m")(says_limited)

    admitted = []
    for now in arrivals:
        CLOCK.now = now
        if view(get()).status_code == 200:
            admitted.append(now)

    around = [t for t in admitted if boundary - 1_000 <= t <= boundary + 1_000]
    assert len(around) == 5
    assert fixed_window_admits(arrivals[:10], 5, MINUTE) == 10  # what django-ratelimit would have let through
    assert gcra_envelope_violations([(t, 1) for t in admitted], 5, MINUTE, 5) == []
    assert admitted == reference_admits(arrivals, 5, MINUTE, 5)
    assert len(admitted) == 5 + 10  # the burst, then one every 12 s of the 120 s after it


def fixed_window_admits(arrivals: list[int], limit: int, period_us: int) -> int:
    """How many ``arrivals`` a counter per fixed window, as django-ratelimit keeps, admits."""
    counts: dict[int, int] = {}
    for now in arrivals:
        counts[now // period_us] = counts.get(now // period_us, 0) + 1
    return sum(min(n, limit) for n in counts.values())


def reference_admits(arrivals: list[int], limit: int, period_us: int, burst: int) -> list[int]:
    """The arrivals the pure GCRA reference (``ratelimits.algorithms``) admits."""
    state = None
    admitted = []
    for now in arrivals:
        outcome = token_bucket(state, now, limit, period_us, burst, 1)
        if outcome.allowed:
            state = outcome.new_state
            admitted.append(now)
    return admitted


# -- the store: one round trip, keys that carry no raw value -------------------------------------


@pytest.fixture
def four_limits(settings: Any, use_redis: RedisServer) -> Callable[[HttpRequest], HttpResponse]:
    settings.RATELIMITS = merged(settings.RATELIMITS, {**TIERS, "DIMENSIONS": {"ip": {"rate": "1000/s"}}})
    view = annotated(key="header:x-tenant", rate="100/h", policies=True)
    view = ratelimit(key="ip", rate="100/h")(view)
    return ratelimit(key="get:q", rate="100/h", group="search")(view)


def test_stacked_limits_and_policies_are_one_round_trip(
    four_limits: Callable[[HttpRequest], HttpResponse], use_redis: RedisServer
) -> None:
    four_limits(get("/?q=x", HTTP_X_TENANT="acme"))  # warm-up: connection opened, script loaded
    request = get("/?q=x", HTTP_X_TENANT="acme")
    with recorded_commands(use_redis) as commands:
        assert limited(four_limits, request) is False
    sent = top_level(commands)
    assert len(sent) == 1, sent
    name, function, numkeys, *_ = sent[0].split(" ")
    assert (name.upper(), function) == ("FCALL", DECIDE.function)
    # The version stamp, the three limits' and the two policies' state keys, this minute's usage.
    assert numkeys == "7"
    assert [r.policy_name for r in request.ratelimit.results] == [  # type: ignore[attr-defined]
        "group:search:100/h",
        "group:tests.test_decorators.says_limited:100/h",
        "group:tests.test_decorators.says_limited:100/h",
        "tier:anonymous",
        "ip",
    ]


def test_key_values_are_hashed_into_the_store(redis_client: redis.Redis, use_redis: RedisServer) -> None:
    view = annotated(key="header:x-tenant", rate="1/h")
    assert [limited(view, get(HTTP_X_TENANT="secret-tenant-42")) for _ in range(2)] == [False, True]
    keys = [key.decode() for key in redis_client.keys("*")]
    assert keys and not [key for key in keys if "secret" in key]


# -- this module's URLconf (for the tests that go through Django's handler) ----------------------


@ratelimit(key="header:x-api-client", rate="1/h")
def header_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@ratelimit(key="ip", rate="100/h", policies=True)
def policies_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@ratelimit(key="post:username", rate="5/h")
def login_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [
    path("header", header_view, name="decorated-header"),
    path("login", login_view, name="decorated-login"),
    path("policies", policies_view, name="decorated-policies"),
]
