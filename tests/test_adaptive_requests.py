"""The adaptive capacity learns from requests through the real stack: latency and 5xx of the views it
admitted, never this app's own 429 and 503; and every worker's capacity reaches the admin's fleet page.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from ratelimits import engine
from ratelimits.backends.base import Backend
from ratelimits.engine.shedding import get_worker_shedder

from .support.settings import merged

EARLY = "ratelimits.middleware.EarlyRejectionMiddleware"


@pytest.fixture
def adaptive(settings: Any) -> Any:
    settings.MIDDLEWARE = [EARLY, *settings.MIDDLEWARE]
    settings.RATELIMITS = merged(
        settings.RATELIMITS,
        {
            "TIERS": {
                "anonymous": {"rate": "1000/s", "burst": 1000},
                "authenticated": {"rate": "1000/s", "burst": 1000},
            },
            "SHEDDING": {
                "WORKER_CAPACITY": 4,
                # Floor and ceiling alike: a failing window cannot cut, so two of them are taken as usual,
                # which the shedder's state says. Every response is judged, in a window of its own.
                "ADAPTIVE": {"FLOOR": 4, "WINDOW": "1ms", "MIN_SAMPLES": 1},
            },
        },
    )
    engine.reset()
    return settings


def state() -> dict[str, Any]:
    shedder = get_worker_shedder()
    assert shedder is not None and shedder.controller is not None
    return shedder.state()


def test_the_views_latency_and_5xx_teach_it(adaptive: Any) -> None:
    client = Client(REMOTE_ADDR="192.0.2.70")
    for _ in range(3):
        assert client.get("/t/ping").status_code == 200
        time.sleep(0.002)  # each response in a window of its own (1 ms): not a synchronisation
    assert state()["responses"] == 3
    assert "ping" in state()["baselines_ms"]
    for _ in range(3):
        assert client.get("/t/status/500").status_code == 500
        time.sleep(0.002)
    assert state()["responses"] == 6
    # At the floor (it cannot cut), every response failing is taken as the usual share of errors.
    shedder = get_worker_shedder()
    assert shedder is not None and shedder.controller is not None
    assert shedder.controller.usual_errors == 1.0
    assert state()["reason"].endswith("at the floor: taken as the new usual")


def test_a_views_own_503_is_an_error_but_this_apps_429_and_503_teach_nothing(adaptive: Any, settings: Any) -> None:
    client = Client(REMOTE_ADDR="192.0.2.71")
    for _ in range(3):
        assert client.get("/t/status/503").status_code == 503  # the view's own: a 5xx like any other
        time.sleep(0.002)
    shedder = get_worker_shedder()
    assert shedder is not None and shedder.controller is not None
    assert shedder.controller.usual_errors == 1.0
    # Now this app refuses with 429s (the caller is over its limit): not the view's answers, and
    # never counted (the shedder admitted them, the limiter refused them: nothing is held).
    settings.RATELIMITS = {
        **settings.RATELIMITS,
        "TIERS": {"anonymous": {"rate": "1/m", "burst": 1}, "authenticated": {"rate": "1/m", "burst": 1}},
    }
    engine.reset()
    first = client.get("/t/status/200")
    assert first.status_code == 200
    refused = [client.get("/t/status/200").status_code for _ in range(5)]
    assert refused == [429] * 5
    assert state()["responses"] == 1


@pytest.mark.django_db
def test_the_fleet_page_shows_each_workers_capacity_and_why_it_moved(adaptive: Any, admin_client: Client) -> None:
    page = admin_client.get("/admin/ratelimits/fleetsettings/").content.decode()
    assert "No worker has published its capacity yet" in page
    client = Client(REMOTE_ADDR="192.0.2.72")
    for _ in range(3):
        client.get("/t/status/500")
        time.sleep(0.002)
    engine.get_limiter()._published_at = -1e9  # publish now: a worker publishes once a second at most
    client.get("/t/ping")
    page = admin_client.get("/admin/ratelimits/fleetsettings/").content.decode()
    assert state()["worker"] in page
    assert "taken as the new usual" in page
    assert "<td>4</td><td>4</td>" in page  # floor and ceiling


def test_the_fleet_page_says_when_the_capacity_is_fixed(settings: Any, admin_client: Client, db: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"SHEDDING": {"WORKER_CAPACITY": 6}})
    page = admin_client.get("/admin/ratelimits/fleetsettings/").content.decode()
    assert "Each worker serves up to 6 requests at once" in page


def test_worker_states_are_shared_through_the_store_and_expire(backend: Backend) -> None:
    backend.publish_worker("host-a:1", {"worker": "host-a:1", "capacity": 5}, 30.0)
    backend.publish_worker("host-b:2", {"worker": "host-b:2", "capacity": 7}, 30.0)
    backend.publish_worker("host-c:3", {"worker": "host-c:3", "capacity": 1}, 0.001)
    time.sleep(0.01)  # past the last one's ttl: it must be gone
    found = backend.workers()
    assert [(w["worker"], w["capacity"]) for w in found] == [("host-a:1", 5), ("host-b:2", 7)]
    backend.publish_worker("host-a:1", {"worker": "host-a:1", "capacity": 6}, 30.0)
    assert [w["capacity"] for w in backend.workers()] == [6, 7]
