"""Prometheus metrics: what the limiter decided, how the store and its breaker fared, what was shed.

``RATELIMITS["METRICS"]`` turns them on; docs/metrics.md describes each one. They need
``prometheus-client`` (the ``metrics`` extra).

The request path only counts into a dictionary under a lock (about a microsecond a decision): one
prometheus-client counter update costs about 2 µs in multiprocess mode and a histogram's 4 µs,
more than the whole budget. What was counted is added to prometheus-client's metrics every
``flush_interval`` by a daemon thread, and by a scrape of this process first, so a scrape sees
every other worker's figures within ``flush_interval``.

Under gunicorn (or any server with several processes), prometheus-client's multiprocess mode
keeps each process's values in files under ``PROMETHEUS_MULTIPROC_DIR``, and a scrape of any
worker sums them. Gauges the engine knows (the breaker's state, a worker's capacity) are sampled
at each flush by the functions registered with :func:`add_sampler`.

Labels are policy names, endpoint names, verdicts and other closed sets, never subjects; each
label keeps at most :data:`MAX_LABEL_VALUES` values, later ones are counted as ``"other"``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

from ._process import ProcessWide
from .conf import MetricsSettings, conf

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = [
    "DECISION_BUCKETS",
    "MAX_LABEL_VALUES",
    "Recorder",
    "add_sampler",
    "child_exit",
    "exposition",
    "get_recorder",
    "view",
]

#: Decision latency buckets (seconds): a decision answered from memory takes microseconds, one
#: from the store a round trip, one the breaker waited on up to the store's timeout.
DECISION_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
#: The most values one label takes (per metric); later ones are counted as :data:`OTHER`.
MAX_LABEL_VALUES = 500
OTHER = "other"

#: name -> (kind, help, label names, multiprocess mode of a gauge). Counter names drop ``_total``,
#: which prometheus-client adds.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "ratelimits_decisions": (
        "counter",
        "Decisions by endpoint, verdict (allow, limited, unavailable, shed) and path (store, memory, degraded, "
        "shedder, early).",
        ("endpoint", "verdict", "path"),
        "",
    ),
    "ratelimits_over_limit": (
        "counter",
        "Enforced policies a refused request was over, by endpoint and policy.",
        ("endpoint", "policy"),
        "",
    ),
    "ratelimits_shadow_over_limit": (
        "counter",
        "Shadow policies that would have refused a request, by endpoint and policy.",
        ("endpoint", "policy"),
        "",
    ),
    "ratelimits_shed": (
        "counter",
        "Requests shed (503) by priority class and by whom: the fleet's in-flight limit, the worker "
        "shedder, or the worker shedder before authentication (early).",
        ("priority", "by"),
        "",
    ),
    "ratelimits_degraded": (
        "counter",
        "Decisions made without the store, by the fail mode that decided them (open, local, closed).",
        ("fail_mode",),
        "",
    ),
    "ratelimits_store_errors": (
        "counter",
        "Store calls that failed, by kind (timeout, connection, policy, other).",
        ("kind",),
        "",
    ),
    "ratelimits_breaker_transitions": (
        "counter",
        "Circuit breaker transitions, by the state entered.",
        ("state",),
        "",
    ),
    "ratelimits_slots_held": ("counter", "Concurrency slots taken by admitted requests.", (), ""),
    "ratelimits_slots_released": ("counter", "Concurrency slots given back as requests finished.", (), ""),
    "ratelimits_local_events": (
        "counter",
        "The local fast path: denial and lease hits, leases taken, tokens leased, returned, dropped or not returned.",
        ("event",),
        "",
    ),
    "ratelimits_capacity_moves": (
        "counter",
        "Moves of a worker's adaptive capacity, by direction (cut, rise).",
        ("direction",),
        "",
    ),
    "ratelimits_breaker_state": (
        "gauge",
        "Each worker's circuit breaker: 0 closed, 1 half-open (a probe is allowed), 2 open.",
        (),
        "liveall",
    ),
    "ratelimits_worker_capacity": (
        "gauge",
        "Each worker's capacity (the worker shedder's, adaptive or fixed).",
        (),
        "liveall",
    ),
    "ratelimits_worker_in_flight": (
        "gauge",
        "Requests the worker shedders have admitted and not yet finished, summed over live workers.",
        (),
        "livesum",
    ),
    "ratelimits_usage_drain_lag_seconds": (
        "gauge",
        "At the last usage drain: seconds since the oldest minute it moved into the database ended "
        "(0 when none was due).",
        (),
        "mostrecent",
    ),
    "ratelimits_usage_drained_at_seconds": (
        "gauge",
        "When the usage drain last ran to its end (Unix time).",
        (),
        "mostrecent",
    ),
}
#: The decision latency histogram, by path.
HISTOGRAM = "ratelimits_decision_seconds"

_Key = tuple[str, tuple[str, ...]]

logger = logging.getLogger("ratelimits")


_built: tuple[CollectorRegistry, dict[str, Any], Any, dict[str, set[str]]] | None = None
_built_lock = threading.Lock()


def _metrics() -> tuple[CollectorRegistry, dict[str, Any], Any, dict[str, set[str]]]:
    """prometheus-client's metrics and each label's values so far, made once per process: a recorder
    rebuilt after the settings change must not make a second value of a metric (it would overwrite
    the first's file entry), nor start the label bound again."""
    global _built
    with _built_lock:
        if _built is None:
            import prometheus_client

            registry = prometheus_client.CollectorRegistry(auto_describe=True)
            families: dict[str, Any] = {}
            for name, (kind, text, labels, mode) in FAMILIES.items():
                if kind == "counter":
                    families[name] = prometheus_client.Counter(name, text, labels, registry=registry)
                else:
                    families[name] = prometheus_client.Gauge(
                        name, text, labels, registry=registry, multiprocess_mode=cast(Any, mode)
                    )
            histogram = prometheus_client.Histogram(
                HISTOGRAM,
                "How long a decision took, by path (store, memory, degraded, shedder, early).",
                ("path",),
                registry=registry,
                buckets=DECISION_BUCKETS,
            )
            _built = (registry, families, histogram, {})
            if (
                conf.metrics.settings is not None
                and conf.metrics.settings.multiprocess
                and not _writes_files(prometheus_client)
            ):
                logger.warning(
                    "ratelimits: PROMETHEUS_MULTIPROC_DIR was set after prometheus-client was imported: this "
                    "process keeps its metrics in memory and a scrape of another worker will not see them; set it "
                    "before the server starts"
                )
        return _built


class Recorder:
    """Counts made on the request path, added to prometheus-client's metrics at each :meth:`flush`."""

    def __init__(self, settings: MetricsSettings) -> None:
        self.settings = settings
        self.multiprocess = settings.multiprocess
        self.registry, self._families, self._histogram, self._seen = _metrics()
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._counts: dict[_Key, int] = {}
        #: (endpoint, verdict, path) -> the decisions counter's key, its endpoint bounded.
        self._decision_keys: dict[tuple[str, str, str], _Key] = {}
        #: path -> [count per bucket (the last is +Inf)..., then the sum of seconds]
        self._latency: dict[str, list[float]] = {}
        self._thread: threading.Thread | None = None
        self.failed = False

    # -- the request path -------------------------------------------------------------------

    def decision(self, endpoint: str, verdict: str, path: str, seconds: float, refused: Iterable[str] = ()) -> None:
        """One decision; ``refused``: the enforced policies it was over. Every request makes one, so
        it is written out: its counter's key resolved once per (endpoint, verdict, path)."""
        raw = (endpoint, verdict, path)
        with self._lock:
            key = self._decision_keys.get(raw)
            if key is None:
                key = self._decision_key(raw)
            counts = self._counts
            counts[key] = counts.get(key, 0) + 1
            for policy in refused:
                over = ("ratelimits_over_limit", (key[1][0], self._bounded("policy", policy)))
                counts[over] = counts.get(over, 0) + 1
            latency = self._latency.get(path)
            if latency is None:
                latency = self._latency[path] = [0.0] * (len(DECISION_BUCKETS) + 2)
            latency[bisect_left(DECISION_BUCKETS, seconds)] += 1
            latency[-1] += seconds
        if self._thread is None:
            self._start()

    def _decision_key(self, raw: tuple[str, str, str]) -> _Key:
        endpoint, verdict, path = raw
        key = ("ratelimits_decisions", (self._bounded("endpoint", endpoint), verdict, path))
        if len(self._decision_keys) < 20 * MAX_LABEL_VALUES:  # endpoints x 4 verdicts x 5 paths, at most
            self._decision_keys[raw] = key
        return key

    def count(self, name: str, *labels: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name`` (a :data:`FAMILIES` counter) under ``labels``."""
        with self._lock:
            self._add((name, labels), amount)
        self._started()

    def count_policies(self, name: str, endpoint: str, policies: Iterable[str]) -> None:
        """One for each of ``policies`` under (``endpoint``, policy): over-limit and shadow counts."""
        with self._lock:
            endpoint = self._bounded("endpoint", endpoint)
            for policy in policies:
                self._add((name, (endpoint, self._bounded("policy", policy))))
        self._started()

    def _add(self, key: _Key, amount: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + amount

    def _bounded(self, label: str, value: str) -> str:
        seen = self._seen.get(label)
        if seen is None:
            seen = self._seen[label] = set()
        if value in seen:
            return value
        if len(seen) < MAX_LABEL_VALUES:
            seen.add(value)
            return value
        return OTHER

    def _started(self) -> None:
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            me = weakref.ref(self)
            self._thread = threading.Thread(
                target=_flush_every, args=(me, self.settings.flush_interval), name="ratelimits-metrics", daemon=True
            )
            self._thread.start()

    # -- off the request path ---------------------------------------------------------------

    def set_gauge(self, name: str, value: float) -> None:
        """Set the gauge ``name`` (a :data:`FAMILIES` gauge) at once: gauges are sampled at flushes."""
        self._families[name].set(value)

    def flush(self) -> None:
        """Sample the gauges (and the counts kept elsewhere), then add what was counted since the last
        flush to prometheus-client's metrics. One flush at a time: the thread's and a scrape's."""
        with self._flushing:
            self._flush()

    def _flush(self) -> None:
        for sample in list(_samplers):
            sample(self)
        with self._lock:
            counts, self._counts = self._counts, {}
            latency, self._latency = self._latency, {}
        for (name, labels), amount in counts.items():
            family = self._families[name]
            (family.labels(*labels) if labels else family).inc(amount)
        for path, buckets in latency.items():
            child = self._histogram.labels(path)
            # prometheus-client has no call to add n observations; its per-bucket values take them.
            for index, value in enumerate(buckets[:-1]):
                if value:
                    child._buckets[index].inc(value)
            child._sum.inc(buckets[-1])

    def after_fork(self) -> None:
        """In a forked child: the parent's counts are the parent's to flush, and its thread is not ours."""
        self._lock, self._flushing = threading.Lock(), threading.Lock()
        self._counts, self._latency = {}, {}
        self._thread = None


def _flush_every(recorder: weakref.ref[Recorder], interval: float) -> None:
    """Flush ``recorder`` every ``interval`` seconds until it is gone (the settings changed)."""
    while True:
        time.sleep(interval)  # a timer: nothing waits on this thread
        alive = recorder()
        if alive is None:
            return
        try:
            alive.flush()
        except Exception:
            # A failing metric must not end the thread (the next flush tries again), nor flood the log.
            if not alive.failed:
                alive.failed = True
                logger.exception("ratelimits: metrics not flushed (said once per process)")
        del alive


#: Functions called at each flush to set the gauges they know (and counters kept elsewhere).
_samplers: list[Callable[[Recorder], None]] = []


def add_sampler(sample: Callable[[Recorder], None]) -> None:
    """Call ``sample(recorder)`` at every flush (once per function, whatever how often it is added)."""
    if sample not in _samplers:
        _samplers.append(sample)


def _writes_files(prometheus_client: Any) -> bool:
    """Whether prometheus-client's values go to the multiprocess directory's files (decided at its import)."""
    value_class = getattr(getattr(prometheus_client, "values", None), "ValueClass", None)
    return value_class is None or "Mutex" not in getattr(value_class, "__name__", "")


def _build() -> Recorder | None:
    settings = conf.metrics.settings
    return Recorder(settings) if settings is not None else None


_recorder: ProcessWide[Recorder | None] = ProcessWide(_build)


def get_recorder() -> Recorder | None:
    """This process's recorder, or ``None`` when ``METRICS`` is off."""
    return _recorder.get()


def exposition() -> tuple[bytes, str]:
    """The metrics in Prometheus's text format and its content type: every worker's in
    multiprocess mode, this process's otherwise (after flushing this process's counts)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

    recorder = get_recorder()
    if recorder is None:
        return b"", CONTENT_TYPE_LATEST
    recorder.flush()
    if recorder.multiprocess:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(recorder.registry), CONTENT_TYPE_LATEST


@require_safe
def view(request: HttpRequest) -> HttpResponse:
    """The metrics for Prometheus to scrape: ``path("metrics", ratelimits.metrics.view)`` in a URLconf.

    Not limited and not authenticated: route it where only the scraper reaches it (docs/metrics.md).
    A 404 while ``METRICS`` is off.
    """
    if get_recorder() is None:
        return HttpResponse("ratelimits: METRICS is off\n", status=404, content_type="text/plain")
    body, content_type = exposition()
    return HttpResponse(body, content_type=content_type)


def child_exit(server: Any, worker: Any) -> None:
    """gunicorn's ``child_exit`` hook: a dead worker's live gauges leave the sums (multiprocess mode).

    In ``gunicorn.conf.py``: ``from ratelimits.metrics import child_exit``.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def _at_exit() -> None:
    """The process is leaving: what it counted since the last flush is added, and in multiprocess
    mode its live gauges leave the sums (a worker recycled by ``max_requests``, a graceful restart)."""
    recorder = _recorder.current()
    if recorder is None:
        return
    try:
        recorder.flush()
    except Exception:
        logger.exception("ratelimits: metrics not flushed at exit")
    if recorder.multiprocess:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


def _after_fork_in_child() -> None:
    recorder = _recorder.current()
    if recorder is not None:
        recorder.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
