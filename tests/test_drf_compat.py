"""A DRF project that swaps its throttle classes for RateLimitThrottle keeps every rate it had.

DRF's ``DEFAULT_THROTTLE_RATES`` (``anon``, ``user``, each scope), a view's ``throttle_scope``,
DRF 3.18's ``@throttle_scope`` on a function view, and ``scope``/``rate`` on throttle subclasses:
each enforced here over HTTP, on the memory backend and the suite's Redis, and decided in one
round trip however many throttle classes a view has.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.urls import path
from rest_framework.decorators import api_view, throttle_scope
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle
from rest_framework.views import APIView

from ratelimits import engine
from ratelimits.checks import check_endpoints, check_settings, check_throttle_settings
from ratelimits.exceptions import ConfigurationError
from ratelimits.policies.throttle_rates import drf_rate, throttle_rates
from ratelimits.rates import Rate
from ratelimits.throttles import RateLimitThrottle, class_policies, throttles_of

from .support.redis_server import RedisServer, script_calls
from .support.settings import merged

pytestmark = pytest.mark.django_db


class Uploads(APIView):
    throttle_scope = "uploads"

    def post(self, request: Request) -> Response:
        return Response({"ok": True})


class Reports(APIView):
    throttle_scope = "reports"

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


@api_view(["GET"])
@throttle_scope("search")
def search(request: Request) -> Response:
    return Response({"ok": True})


class BurstThrottle(RateLimitThrottle):
    """DRF's documented pattern: a burst rate and a sustained one, each a class."""

    scope = "burst"


class SustainedThrottle(RateLimitThrottle):
    rate = "5/day"


class Burst(APIView):
    throttle_classes = [BurstThrottle, SustainedThrottle]

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class NoRate(RateLimitThrottle):
    scope = "nowhere"


class Unlimited(APIView):
    throttle_classes = [NoRate]

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


urlpatterns = [
    path("uploads", Uploads.as_view(), name="uploads"),
    path("reports", Reports.as_view(), name="reports"),
    path("search", search, name="search"),
    path("burst", Burst.as_view(), name="burst"),
    path("unlimited", Unlimited.as_view(), name="unlimited"),
]

RATES = {"anon": "2/min", "user": "100/day", "uploads": "1/min", "search": "3/hour", "burst": "2/min"}


@pytest.fixture(params=["memory", "redis"])
def drf_project(request: pytest.FixtureRequest, settings: Any) -> RedisServer | None:
    """This module's routes, DRF's rates, RateLimitThrottle in place of DRF's classes, no RATELIMITS
    of note; on the memory backend, or the suite's Redis (which is returned)."""
    settings.ROOT_URLCONF = __name__
    drf_rates(settings, RATES)
    server: RedisServer | None = None
    if request.param == "redis":
        server = request.getfixturevalue("use_redis")
    else:
        settings.RATELIMITS = {"BACKEND": "memory"}
    engine.reset()
    return server


def drf_rates(settings: Any, rates: dict[str, Any]) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
        "DEFAULT_THROTTLE_CLASSES": ["ratelimits.throttles.RateLimitThrottle"],
        "DEFAULT_THROTTLE_RATES": rates,
    }
    engine.reset()


def statuses(method: str, url: str, count: int, address: str = "198.51.100.7") -> list[int]:
    client = APIClient(REMOTE_ADDR=address)
    return [getattr(client, method)(url).status_code for _ in range(count)]


def test_anon_is_the_anonymous_callers_rate_and_every_scope_its_endpoints(drf_project: Any) -> None:
    # anon 2/min: two requests, then 429, per client address, on an endpoint with no rate of its own.
    assert statuses("get", "/reports", 3) == [200, 200, 429]
    assert statuses("get", "/reports", 1, address="198.51.100.8") == [200]
    # uploads 1/min: the scope's own rate, stricter than anon's.
    assert statuses("post", "/uploads", 2, address="198.51.100.9") == [200, 429]


def test_a_function_views_throttle_scope_decorator_is_its_endpoint(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min", "search": "3/hour"})
    assert statuses("get", "/search", 4, address="198.51.100.10") == [200, 200, 200, 429]


def test_the_429_names_the_drf_rate_it_came_from(drf_project: Any) -> None:
    client = APIClient(REMOTE_ADDR="198.51.100.11")
    client.post("/uploads")
    response = client.post("/uploads")
    assert response.status_code == 429
    assert response.json()["violated-policies"] == ["endpoint:uploads"]
    assert 1 <= int(response["Retry-After"]) <= 60


def test_user_is_the_authenticated_callers_rate_and_the_anonymous_ones_without_anon(
    drf_project: Any, settings: Any
) -> None:
    drf_rates(settings, {"user": "2/min"})
    user = get_user_model().objects.create_user("ada")
    client = APIClient(REMOTE_ADDR="198.51.100.12")
    client.force_authenticate(user)
    assert [client.get("/reports").status_code for _ in range(3)] == [200, 200, 429]
    # DRF's UserRateThrottle holds anonymous callers to the user rate too, by address.
    assert statuses("get", "/reports", 3, address="198.51.100.13") == [200, 200, 429]


def test_every_throttle_class_of_a_view_is_decided_in_one_round_trip(drf_project: Any, settings: Any) -> None:
    # burst: DRF's 2/min for the class's scope; sustained: the class's own 5/day; anon: 100/min.
    drf_rates(settings, {"anon": "100/min", "burst": "2/min"})
    before = script_calls(drf_project) if drf_project is not None else 0
    assert statuses("get", "/burst", 3, address="198.51.100.14") == [200, 200, 429]
    if drf_project is not None:
        assert script_calls(drf_project) - before == 3  # one per request, whatever the classes


def test_a_view_listing_only_classes_of_its_own_is_not_charged_the_tier_as_under_drf(
    drf_project: Any, settings: Any
) -> None:
    # DRF: a view's throttle_classes replace the default ones, so anon's 2/min does not apply there.
    drf_rates(settings, {"anon": "2/min", "burst": "4/min"})
    client = APIClient(REMOTE_ADDR="198.51.100.23")
    assert [client.get("/burst").status_code for _ in range(5)] == [200, 200, 200, 200, 429]
    assert [client.get("/reports").status_code for _ in range(3)] == [200, 200, 429]  # anon, untouched


def test_a_throttle_classs_own_rate_holds_across_requests(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min", "burst": "100/min"})
    assert statuses("get", "/burst", 6, address="198.51.100.15") == [200] * 5 + [429]


def test_the_projects_own_endpoint_rate_wins_and_the_check_names_the_drf_rate(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min", "uploads": "1/min"})
    settings.RATELIMITS = merged(settings.RATELIMITS, {"ENDPOINTS": {"uploads": {"rate": "3/min"}}})
    engine.reset()
    assert statuses("post", "/uploads", 4, address="198.51.100.16") == [200, 200, 200, 429]
    assert [m.msg for m in check_throttle_settings() if m.id == "ratelimits.W010"] == [
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['uploads'] ('1/min') is replaced by "
        "RATELIMITS['ENDPOINTS']['uploads'], per caller (3 / minute, burst 3)."
    ]


def test_the_projects_own_tiers_win_and_the_check_names_anon_and_user(drf_project: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"TIERS": {"anonymous": "5/s", "authenticated": "9/s"}})
    engine.reset()
    assert statuses("get", "/reports", 6, address="198.51.100.17") == [200] * 5 + [429]
    assert [m.msg for m in check_throttle_settings() if m.id == "ratelimits.W010"] == [
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['anon'] ('2/min') is replaced by the tier 'anonymous', "
        "anonymous callers' default (5 / second, burst 5).",
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['user'] ('100/day') is replaced by the tier 'authenticated', "
        "authenticated callers' default (9 / second, burst 9).",
    ]


def test_a_scope_set_to_none_is_no_limit(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min", "uploads": None})
    assert statuses("post", "/uploads", 5, address="198.51.100.18") == [200] * 5


def test_a_throttle_class_whose_scope_has_no_rate_fails_the_checks_and_never_a_request(
    drf_project: Any, caplog: pytest.LogCaptureFixture
) -> None:
    messages = [m for m in check_endpoints() if m.id == "ratelimits.E007"]
    assert len(messages) == 1 and "NoRate.scope: 'nowhere' names no per-caller rate" in messages[0].msg
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        # DRF refuses such a class on every request; here the checks refuse it at start, and a
        # server started regardless decides without it (nothing else is listed), saying so once.
        assert statuses("get", "/unlimited", 3, address="198.51.100.19") == [200, 200, 200]
    assert [r.getMessage() for r in caplog.records if "NoRate" in r.getMessage()] == [
        f"ratelimits: {messages[0].msg}; the views it throttles are decided without it"
    ]


class Picky(APIView):
    """A view that picks its throttles per request, as DRF's docs show (``get_throttles``)."""

    throttle_classes = [RateLimitThrottle]

    def get_throttles(self) -> list[Any]:
        return [RateLimitThrottle(), SustainedThrottle()]

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class Health(APIView):
    throttle_classes = [SustainedThrottle]

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


urlpatterns += [path("picky", Picky.as_view(), name="picky"), path("health", Health.as_view(), name="health")]


def test_the_throttles_a_view_picks_are_decided_once_with_every_rate(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min"})
    before = script_calls(drf_project) if drf_project is not None else 0
    # SustainedThrottle's 5/day, which throttle_classes does not name, applies: and one decision a request.
    assert statuses("get", "/picky", 6, address="198.51.100.20") == [200] * 5 + [429]
    if drf_project is not None:
        assert script_calls(drf_project) - before == 6


def test_an_exempt_endpoint_is_never_limited_whatever_its_throttle_classes(drf_project: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"EXEMPT_ENDPOINTS": ["health"]}})
    engine.reset()
    assert statuses("get", "/health", 8, address="198.51.100.21") == [200] * 8


def test_with_the_switch_off_a_broken_throttle_class_costs_nothing(drf_project: Any, settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"ENABLED": False})
    engine.reset()
    assert statuses("get", "/unlimited", 5, address="198.51.100.22") == [200] * 5


@pytest.mark.parametrize(
    ("written", "rate"),
    [
        ("2/min", Rate(2, 60_000_000)),
        ("100/day", Rate(100, 86_400_000_000)),
        ("5/s", Rate(5, 1_000_000)),
        ("10/hours", Rate(10, 3_600_000_000)),
        (" 7 / minute ", Rate(7, 60_000_000)),
        (None, None),
    ],
)
def test_a_rate_is_read_as_drf_reads_it(written: Any, rate: Rate | None) -> None:
    assert drf_rate(written, "field") == rate


def test_a_rate_drf_could_not_read_fails_the_checks_naming_it(settings: Any) -> None:
    for bad in ("2/fortnight", "two/min", 5, "5"):
        drf_rates(settings, {"anon": bad})
        messages = check_settings()
        assert [m.id for m in messages] == ["ratelimits.E006"], bad
        assert messages[0].msg.startswith(f"REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['anon']: {bad!r} is not a rate")
    drf_rates(settings, {"anon": "0/min"})  # DRF reads it, as "refuse everything"
    messages = check_settings()
    assert [m.id for m in messages] == ["ratelimits.E006"]
    assert "'0/min' admits nothing: DRF refuses every request under it" in messages[0].msg
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": ["anon"]}
    with pytest.raises(ConfigurationError, match="expected a dict of scope to rate"):
        throttle_rates()


def test_drfs_own_rate_throttles_beside_ours_and_num_proxies_are_named(settings: Any) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_CLASSES": [
            "ratelimits.throttles.RateLimitThrottle",
            "rest_framework.throttling.UserRateThrottle",
        ],
        "NUM_PROXIES": 1,
    }
    messages = check_throttle_settings()
    assert [m.id for m in messages] == ["ratelimits.W011", "ratelimits.W012"]
    assert "'rest_framework.throttling.UserRateThrottle' beside RateLimitThrottle" in messages[0].msg
    assert "REST_FRAMEWORK['NUM_PROXIES'] is set, but ratelimits does not read it" in messages[1].msg
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.UserRateThrottle"],
    }
    assert check_throttle_settings() == []  # a project that does not use ratelimits' throttle


def test_a_rate_drf_cannot_read_is_refused_at_start_and_left_out_on_a_request(
    drf_project: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With the admin's tables as the source, policies load on the first request: never a 500 there."""
    drf_rates(settings, {"anon": "2/min", "legacy": "100/fortnight"})
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": "database"}})
    engine.reset()
    assert [m.id for m in check_settings()] == ["ratelimits.E006"]
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        assert statuses("post", "/uploads", 2, address="198.51.100.24") == [200, 200]
        engine.get_policy_source().invalidate()  # as a policy change in the admin does
        assert statuses("post", "/uploads", 1, address="198.51.100.24") == [200]
    said = [r for r in caplog.records if "'100/fortnight' is not a rate" in r.getMessage()]
    assert len(said) == 1  # once, not at every reload


class LegacyBurst(UserRateThrottle):
    scope = "burst"


class StillDrf(APIView):
    throttle_classes = [LegacyBurst]
    throttle_scope = "serach"

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class Health(APIView):
    throttle_scope = "health"

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


def test_drfs_throttles_left_on_a_view_and_a_scope_nothing_rates_are_named(drf_project: Any, settings: Any) -> None:
    """Named: StillDrf's. Not named: an exempt scope, nor this app's own views' scopes (``usage``,
    ``rate_limit``), which a project routes as the docs say."""
    settings.ROOT_URLCONF = "tests.drf_legacy_urls"
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"EXEMPT_ENDPOINTS": ["health"]}})
    messages = check_endpoints()
    assert [m.id for m in messages] == ["ratelimits.W016", "ratelimits.W017"]
    assert "The view StillDrf's throttle_classes names DRF's throttle 'tests.test_drf_compat.LegacyBurst'" in (
        messages[0].msg
    )
    assert messages[1].msg.startswith("The view StillDrf's throttle_scope 'serach' has no rate")
    assert (messages[1].hint or "").startswith("Did you mean 'search'?")


def test_jwt_authentication_counted_per_token_is_named(settings: Any) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_CLASSES": ["ratelimits.throttles.RateLimitThrottle"],
        "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework_simplejwt.authentication.JWTAuthentication"],
    }
    assert [m.id for m in check_throttle_settings()] == ["ratelimits.W018"]
    # DRF takes the classes themselves as well as their dotted paths.
    jwt = type("JWTAuthentication", (), {"__module__": "rest_framework_simplejwt.authentication"})
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_AUTHENTICATION_CLASSES": [jwt]}
    assert [m.id for m in check_throttle_settings()] == ["ratelimits.W018"]
    settings.RATELIMITS = {"IDENTITY": {"API_KEY_FUNC": "ratelimits.identity.no_api_key"}}
    assert check_throttle_settings() == []


class BurstAgain(RateLimitThrottle):
    scope = "burst"


class Twins(APIView):
    throttle_classes = [BurstThrottle, BurstAgain]

    def get(self, request: Request) -> Response:
        return Response({"ok": True})


class CountedPicks(Picky):
    picked = 0

    def get_throttles(self) -> list[Any]:
        CountedPicks.picked += 1
        return super().get_throttles()


urlpatterns += [path("twins", Twins.as_view(), name="twins"), path("counted", CountedPicks.as_view(), name="counted")]


class CountedThrottle(RateLimitThrottle):
    """``RateLimitThrottle``, counting how many are made."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        CountedThrottle.made += 1


class Plain(APIView):
    throttle_classes = [CountedThrottle, UserRateThrottle, SustainedThrottle]


def test_a_view_that_picks_nothing_is_read_from_its_classes_without_making_throttles() -> None:
    """A view that does not override ``get_throttles`` has DRF's: the classes are its
    ``throttle_classes`` (ours among them, in order), read without a second set of throttles made
    per request. One that overrides it is asked (``test_a_views_throttles_are_picked_once...``)."""
    CountedThrottle.made = 0
    assert throttles_of(Plain()) == (CountedThrottle, SustainedThrottle)
    assert CountedThrottle.made == 0
    picked = CountedPicks.picked
    assert throttles_of(CountedPicks()) == (RateLimitThrottle, SustainedThrottle)
    assert CountedPicks.picked == picked + 1


def test_two_classes_of_one_scope_spend_its_one_bucket_once(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min", "burst": "2/min"})
    assert statuses("get", "/twins", 3, address="198.51.100.25") == [200, 200, 429]


@pytest.mark.parametrize(
    ("ratelimits", "admitted"),
    [
        ({"ENDPOINTS": {"health": {"rate": "3/min"}}}, 3),
        ({"DIMENSIONS": {"ip": {"rate": "4/min"}}}, 4),
    ],
)
def test_a_view_of_classes_of_its_own_keeps_the_projects_endpoint_rules_and_dimensions(
    drf_project: Any, settings: Any, ratelimits: dict[str, Any], admitted: int
) -> None:
    # Health lists SustainedThrottle (5/day) only: DRF's anon (2/min) is not its limit, but what
    # RATELIMITS adds for every request is.
    drf_rates(settings, {"anon": "2/min"})
    settings.RATELIMITS = merged(settings.RATELIMITS, ratelimits)
    engine.reset()
    assert statuses("get", "/health", admitted + 1, address="198.51.100.26") == [200] * admitted + [429]


def test_a_views_throttles_are_picked_once_a_request_whatever_their_number(drf_project: Any, settings: Any) -> None:
    drf_rates(settings, {"anon": "100/min"})
    CountedPicks.picked = 0
    assert statuses("get", "/counted", 3, address="198.51.100.27") == [200] * 3
    assert CountedPicks.picked == 3 * 2  # DRF's own call, and the first RateLimitThrottle's


def test_a_class_whose_scope_is_exempt_limits_nothing_and_is_no_error(
    drf_project: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"EXEMPT_ENDPOINTS": ["nowhere"]}})
    engine.reset()
    assert [m.id for m in check_endpoints() if m.id == "ratelimits.E007"] == []
    with caplog.at_level(logging.ERROR, logger="ratelimits"):
        assert statuses("get", "/unlimited", 4, address="198.51.100.28") == [200] * 4
    assert not [r for r in caplog.records if "NoRate" in r.getMessage()]


def test_drfs_throttles_a_view_inherits_are_named_once_not_per_view(
    drf_project: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A project whose DEFAULT_THROTTLE_CLASSES kept DRF's AnonRateThrottle beside ours: every view
    # that names no classes of its own inherits the list DRF read at import.
    monkeypatch.setattr(APIView, "throttle_classes", [RateLimitThrottle, AnonRateThrottle])
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_CLASSES": [
            "ratelimits.throttles.RateLimitThrottle",
            "rest_framework.throttling.AnonRateThrottle",
        ],
    }
    assert [m.id for m in check_throttle_settings() if m.id in ("ratelimits.W011", "ratelimits.W016")] == [
        "ratelimits.W011"
    ]
    assert [m for m in check_endpoints() if m.id == "ratelimits.W016"] == []


def test_drfs_throttles_left_on_a_view_are_named_where_only_views_list_ours(drf_project: Any, settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.drf_legacy_urls"
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_CLASSES": []}
    assert "ratelimits.W016" in [m.id for m in check_endpoints()]


def test_classes_with_a_rate_and_no_scope_are_named_apart_by_their_path(drf_project: Any) -> None:
    class SustainedThrottle(RateLimitThrottle):  # the module's class's name, on purpose
        rate = "7/day"

    source = engine.get_policy_source()
    (here,) = class_policies(SustainedThrottle, source)
    (module,) = class_policies(globals()["SustainedThrottle"], source)
    assert module.name == "throttle:tests.test_drf_compat.SustainedThrottle"
    assert here.name != module.name and re.fullmatch(r"throttle:[A-Za-z0-9_.]+", here.name)
    assert (here.rate, module.rate) == (Rate(7, 86_400_000_000), Rate(5, 86_400_000_000))
