"""Prometheus metrics: what the engine decided, counted exactly, on a real Redis and across gunicorn workers.

The in-process tests read the exposition (``/metrics``) before and after, and compare the change
with the responses the requests got. The fleet test runs the demo under ``gunicorn --workers 2``
in prometheus-client's multiprocess mode and checks that a scrape of either worker sums both.
"""

from __future__ import annotations

import collections
import json
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from ratelimits import metrics, usage
from ratelimits.checks import W007, check_deployment, check_settings
from ratelimits.engine import get_limiter
from ratelimits.metrics import MAX_LABEL_VALUES, OTHER, Recorder, get_recorder

from .factories import ApiKeyFactory
from .support.clients import client_for
from .support.demo import Demo, demo_server
from .support.http import fetch
from .support.redis_server import RedisServer
from .support.settings import merged

TIERS = {
    "TIERS": {"free": {"rate": "3/s"}, "anon": {"rate": "2/m"}},
    "POLICIES": {
        "DEFAULT_TIERS": {"anonymous": "anon", "authenticated": "free"},
        "TIER_FUNC": "project.payments.auth.tier_of",
    },
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(value for (found, have), value in samples.items() if found == name and wanted <= have)


def read(client: Client | None = None) -> Samples:
    response = (client or Client()).get("/metrics", HTTP_HOST="testserver")
    assert response.status_code == 200, response.content
    return scrape(response.content.decode())


@pytest.fixture
def metered(settings: Any, use_redis: RedisServer) -> Iterator[None]:
    settings.ROOT_URLCONF = "project.urls"
    settings.RATELIMITS = {**settings.RATELIMITS, **TIERS, "METRICS": {"multiprocess": False}}
    yield


@pytest.mark.django_db
def test_decisions_are_counted_by_endpoint_verdict_and_path_with_the_policies_refused(metered: None) -> None:
    ApiKeyFactory(raw="sk_free_metrics", tier="free")
    caller = client_for("sk_free_metrics")
    before = read()
    statuses = collections.Counter(caller.get("/v1/customers").status_code for _ in range(8))
    after = read()
    assert statuses[200] >= 3 and statuses[429] >= 1 and statuses[200] + statuses[429] == 8

    def change(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    endpoint = "customers"
    assert change("ratelimits_decisions_total", endpoint=endpoint, verdict="allow") == statuses[200]
    assert change("ratelimits_decisions_total", endpoint=endpoint, verdict="limited") == statuses[429]
    # Every one of them decided by the store, or by this worker's memory of its denial.
    paths = {path: change("ratelimits_decisions_total", endpoint=endpoint, path=path) for path in ("store", "memory")}
    assert sum(paths.values()) == 8
    assert change("ratelimits_over_limit_total", endpoint=endpoint, policy="tier:free") == statuses[429]
    assert change("ratelimits_decision_seconds_count") == 8
    assert change("ratelimits_decision_seconds_bucket", le="+Inf") == 8
    assert 0 < change("ratelimits_decision_seconds_sum") < 8  # seconds, not microseconds
    assert total(after, "ratelimits_breaker_state") == 0


@pytest.mark.django_db
def test_a_dead_store_shows_as_errors_degraded_decisions_and_an_open_breaker(
    settings: Any, own_redis: RedisServer
) -> None:
    settings.ROOT_URLCONF = "project.urls"
    settings.RATELIMITS = merged(
        merged(settings.RATELIMITS, TIERS),
        {
            "BACKEND": "redis",
            "REDIS": {"URL": own_redis.url},
            "METRICS": {"MULTIPROCESS": False},
            "FAILURE": {"BREAKER_MIN_CALLS": 3, "BREAKER_COOLDOWN": "60s"},
        },
    )
    ApiKeyFactory(raw="sk_free_dead", tier="free")
    caller = client_for("sk_free_dead")
    assert caller.get("/v1/customers").status_code == 200
    before = read()
    own_redis.stop()
    statuses = [caller.get("/v1/customers").status_code for _ in range(6)]
    after = read()
    assert statuses == [200] * 6  # the tier fails open

    def change(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # One success and two failures in the window reach FAILURE['BREAKER_MIN_CALLS'] at half failed:
    # it opens, and no more calls reach the store.
    assert change("ratelimits_store_errors_total") == 2
    assert change("ratelimits_store_errors_total", kind="connection") == 2
    assert change("ratelimits_degraded_total", fail_mode="open") == 6
    assert change("ratelimits_decisions_total", verdict="allow", path="degraded") == 6
    assert change("ratelimits_breaker_transitions_total", state="open") == 1
    assert total(after, "ratelimits_breaker_state") == 2
    assert get_limiter().breaker.transitions["open"] == 1


@pytest.mark.django_db
def test_the_usage_drain_reports_how_far_behind_it_was(metered: None) -> None:
    ApiKeyFactory(raw="sk_free_drained", tier="free")
    client_for("sk_free_drained").get("/v1/customers")
    minute = int(time.time() // 60)
    later = (minute + 3) * 60 + 10.0  # three minutes after the request's minute closed, and a bit
    before = time.time()
    assert usage.drain(now=later) >= 1
    samples = read()
    assert total(samples, "ratelimits_usage_drain_lag_seconds") == pytest.approx(later - (minute + 1) * 60)
    assert before <= total(samples, "ratelimits_usage_drained_at_seconds") <= time.time()
    assert usage.drain(now=later) == 0  # nothing left: nothing behind
    assert total(read(), "ratelimits_usage_drain_lag_seconds") == 0


@pytest.mark.django_db
def test_the_view_is_a_404_while_metrics_are_off_and_takes_only_safe_methods(settings: Any) -> None:
    settings.ROOT_URLCONF = "project.urls"
    settings.RATELIMITS = {**settings.RATELIMITS, "METRICS": False}
    assert Client().get("/metrics").status_code == 404
    settings.RATELIMITS = merged(settings.RATELIMITS, {"METRICS": {"MULTIPROCESS": False}})
    assert Client().get("/metrics").status_code == 200
    assert Client().post("/metrics").status_code == 405


def test_labels_keep_a_bounded_number_of_values(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"METRICS": {"MULTIPROCESS": False}})
    recorder = get_recorder()
    assert isinstance(recorder, Recorder)
    before = scrape(metrics.exposition()[0].decode())
    for number in range(MAX_LABEL_VALUES + 50):
        recorder.decision(f"GET /bounded/{number}", "allow", "store", 0.0001)
    after = scrape(metrics.exposition()[0].decode())
    named = {dict(labels)["endpoint"] for name, labels in after if name == "ratelimits_decisions_total"}
    assert len(named) <= MAX_LABEL_VALUES + 1 and OTHER in named
    others = total(after, "ratelimits_decisions_total", endpoint=OTHER) - total(
        before, "ratelimits_decisions_total", endpoint=OTHER
    )
    assert others >= 50


def test_counts_reach_prometheus_client_within_the_flush_interval_without_a_scrape(settings: Any) -> None:
    settings.RATELIMITS = merged(settings.RATELIMITS, {"METRICS": {"MULTIPROCESS": False, "FLUSH_INTERVAL": "50ms"}})
    recorder = get_recorder()
    assert recorder is not None
    held = recorder._families["ratelimits_slots_held"]
    before = held._value.get()
    recorder.count("ratelimits_slots_held")
    deadline = time.monotonic() + 5
    while held._value.get() == before and time.monotonic() < deadline:
        time.sleep(0.01)  # polls the flushing thread's work, bounded by the deadline
    assert held._value.get() == before + 1


def test_w007_without_multiprocess_mode_outside_debug(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    settings.DEBUG = False
    settings.RATELIMITS = {**settings.RATELIMITS, "BACKEND": "redis", "METRICS": True}
    assert W007 in {message.id for message in check_deployment()}
    settings.RATELIMITS = merged(settings.RATELIMITS, {"METRICS": {"MULTIPROCESS": False}})
    assert W007 not in {message.id for message in check_deployment()}
    with tempfile.TemporaryDirectory() as directory:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", directory)
        settings.RATELIMITS = {**settings.RATELIMITS, "METRICS": True}
        assert W007 not in {message.id for message in check_deployment()}


def test_multiprocess_mode_asked_for_needs_its_directory(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    settings.RATELIMITS = merged(settings.RATELIMITS, {"METRICS": {"MULTIPROCESS": True}})
    found = [message for message in check_settings() if message.id == "ratelimits.E176"]
    assert found and "PROMETHEUS_MULTIPROC_DIR is not set" in found[0].msg
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent/ratelimits-metrics")
    settings.RATELIMITS = {**settings.RATELIMITS, "METRICS": True}
    found = [message for message in check_settings() if message.id == "ratelimits.E150"]
    assert found and "is not a directory" in found[0].msg


def test_the_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads(
        (Path(__file__).resolve().parent.parent / "docs/grafana/ratelimits-dashboard.json").read_text()
    )
    exported = {f"{name}_total" if kind == "counter" else name for name, (kind, *_) in metrics.FAMILIES.items()}
    exported |= {f"{metrics.HISTOGRAM}_{part}" for part in ("bucket", "count", "sum")}
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"\bratelimits_[a-z_]+", target["expr"]))
    assert queried <= exported, queried - exported
    # Every metric has a panel (a histogram's by its buckets).
    assert {name.removesuffix("_total") for name in queried} >= set(metrics.FAMILIES)
    assert f"{metrics.HISTOGRAM}_bucket" in queried


# -- the fleet: two gunicorn workers, one exposition ---------------------------------------------

ACME_KEY = "sk_free_demo_acme_0000000000"


@pytest.fixture
def fleet() -> Iterator[Demo]:
    with (
        tempfile.TemporaryDirectory(prefix="ratelimits-metrics-") as directory,
        demo_server("metrics", workers=2, threads=4, env={"PROMETHEUS_MULTIPROC_DIR": directory}) as server,
    ):
        yield server


@pytest.mark.slow
def test_a_throttled_burst_shows_in_metrics_summed_over_two_gunicorn_workers(fleet: Demo) -> None:
    replies: list[int] = []
    lock = threading.Lock()

    def burst() -> None:
        for _ in range(30):
            reply = fetch(fleet.port, "GET", "/v1/customers", headers={"Authorization": f"Bearer {ACME_KEY}"})
            with lock:
                replies.append(reply.status)

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    statuses = collections.Counter(replies)
    assert sum(statuses.values()) == 120 and statuses[429] > 0 and set(statuses) <= {200, 429}

    endpoint = "customers"
    expected = {"allow": statuses[200], "limited": statuses[429]}
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 10
    pids: set[str] = set()
    while time.monotonic() < deadline:
        samples = scrape(fetch(fleet.port, "GET", "/metrics").text)
        seen = {
            verdict: total(samples, "ratelimits_decisions_total", endpoint=endpoint, verdict=verdict)
            for verdict in expected
        }
        pids = {dict(labels).get("pid", "") for name, labels in samples if name == "ratelimits_breaker_state"}
        if seen == expected and len(pids) == 2:
            break
        time.sleep(0.2)  # polls: each worker flushes its counts within a second
    assert seen == expected, f"metrics {seen}, responses {expected}"
    # Both workers decided some of the burst, and both report: one scrape sums the two.
    assert len(pids) == 2, pids
    # Each 429 is over one policy at least: the override, and with four threads at once sometimes
    # the tier's concurrency limit too (a 429 over two policies counts twice, as docs/metrics.md says).
    over = total(samples, "ratelimits_over_limit_total", endpoint=endpoint)
    assert statuses[429] <= over <= 2 * statuses[429], (over, statuses)
