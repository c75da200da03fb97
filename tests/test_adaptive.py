"""The adaptive capacity's arithmetic on scripted latency series (``ratelimits.adaptive``).

The clock is the test's: each window is fed a handful of responses whose latency comes either
from a constant or from a model of a downstream with a knee (latency grows with concurrency past
it), so every figure is exact and every run the same.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import pytest

from ratelimits.adaptive import STALE_WINDOWS, CapacityController, Move
from ratelimits.choices import Priority
from ratelimits.conf import AdaptiveSettings
from ratelimits.engine.shedding import WorkerShedder

WINDOW = 0.5
SETTINGS = AdaptiveSettings(floor=2, tolerance=1.5, window=WINDOW, min_samples=5, probe_interval=60.0)
CEILING = 32
THRESHOLDS = {Priority.LOW: 60, Priority.NORMAL: 75, Priority.HIGH: 90}


class Run:
    """A controller driven window by window: ``step`` feeds one window of responses and closes it."""

    def __init__(self, ceiling: int = CEILING, settings: AdaptiveSettings = SETTINGS) -> None:
        self.now = 0.0
        self.controller = CapacityController(ceiling, settings, now=self.now)
        self.limits: list[float] = []
        self.moves: list[Move] = []

    def step(
        self, latency: float | Callable[[int], float], *, shed: bool = True, errors: int = 0, samples: int = 10
    ) -> None:
        controller = self.controller
        if shed:
            controller.shed()
        start = self.now
        for i in range(samples):
            value = latency(controller.capacity) if callable(latency) else latency
            # The last response closes the window, exactly: a multiple of 0.5 s is exact in binary.
            self.now = start + WINDOW if i == samples - 1 else start + WINDOW * (i + 1) / samples
            move = controller.record("export", value, error=i < errors, now=self.now)
            if move is not None:
                self.moves.append(move)
        self.limits.append(controller.limit)

    def warm(self, latency: float = 0.05) -> None:
        """Learn the usual latency, then grow (healthy, shedding) from the floor to the ceiling."""
        self.step(latency, shed=False)
        while self.controller.limit < self.controller.ceiling:
            self.step(latency)


class Mixed:
    """A controller fed windows of two endpoints: 10 charges a window, and up to 10 exports."""

    def __init__(self) -> None:
        self.controller = CapacityController(CEILING, SETTINGS, now=0.0)
        self.now = 0.0

    def window(self, charge: float, export: float, exports: int = 10) -> None:
        self.controller.shed()
        for i in range(10):
            self.now += WINDOW / 10
            if i < exports:
                self.controller.record("export", export, error=False, now=self.now - 1e-6)
            self.controller.record("charge", charge, error=False, now=self.now)


def knee_model(knee: int, service: float = 0.05) -> Callable[[int], float]:
    """A downstream that serves ``knee`` requests at once: past that, each waits its turn."""
    return lambda concurrency: service * max(1.0, concurrency / knee)


def test_it_converges_on_the_knee_of_a_saturated_downstream() -> None:
    run = Run()
    run.step(0.05, shed=False)  # its first window learns the usual latency, at light load
    for _ in range(400):
        run.step(knee_model(10))
    settled = run.limits[-200:]
    assert min(settled) >= 8
    # At most tolerance x the knee (past 15 at once, latency is over 1.5 x its usual), but for the
    # one window a probe_interval in which it tries one step higher.
    over = [limit for limit in settled if int(limit) > 15]
    assert len(over) <= len(settled) * WINDOW / SETTINGS.probe_interval + 1, over
    assert max(settled) < 15 + 3


def test_it_starts_at_its_floor_and_respects_its_ceiling_and_floor() -> None:
    run = Run()
    assert run.controller.limit == SETTINGS.floor
    run.warm(0.01)
    for _ in range(50):
        run.step(1.0)  # 100x slower than usual: every cut is the deepest allowed, halving
    assert min(run.limits) == SETTINGS.floor
    assert all(SETTINGS.floor <= limit <= CEILING for limit in run.limits)
    fresh = Run()
    fresh.step(0.01, shed=False)
    for _ in range(200):
        fresh.step(0.01)  # healthy and turning requests away: it grows, to the ceiling and no further
    assert fresh.limits[-1] == CEILING
    assert max(fresh.limits) == CEILING


def test_at_a_constant_latency_with_nothing_shed_it_never_moves() -> None:
    """The capacity turned nothing away: more of it would change nothing (Gradient2 grew here, #137)."""
    for latency in (0.005, 0.05, 2.0):
        run = Run()
        run.warm(latency)
        run.moves.clear()
        for _ in range(2000):
            run.step(latency, shed=False)
        assert run.controller.limit == CEILING
        assert run.moves == []
        cold = Run()
        for _ in range(2000):
            cold.step(latency, shed=False)
        assert set(cold.limits) == {float(SETTINGS.floor)}


def test_it_does_not_drift_upward_under_a_modest_steady_overload() -> None:
    """Netflix concurrency-limits #134: with the queue added on every update, Gradient2's limit
    creeps up under a steady modest overload. Here a saturated downstream keeps the latency
    around its knee for 10,000 windows, and the capacity is no higher at the end than early on."""
    run = Run()
    run.step(0.05, shed=False)
    for _ in range(10_000):
        run.step(knee_model(12))
    early, late = run.limits[1000:2000], run.limits[-1000:]
    assert max(late) <= max(early)
    assert statistics.mean(late) <= statistics.mean(early) + 0.5
    # Past 18 at once (tolerance x the knee) only while probing, one window a probe_interval.
    over = sum(int(limit) > 12 * SETTINGS.tolerance for limit in late)
    assert over <= len(late) * WINDOW / SETTINGS.probe_interval + 1


def test_an_overload_is_never_taken_as_the_new_usual_while_cutting_helps() -> None:
    """A steady latency 2x the usual, whatever the capacity: the capacity only falls, to the floor.
    There, still slow with the least load, the latency is not this worker's doing: it becomes the
    new usual, the knee those cuts set is forgotten, and the capacity grows back."""
    run = Run()
    run.warm()
    falling = []
    while run.controller.limit > SETTINGS.floor:
        run.step(0.1)
        falling.append(run.controller.limit)
    assert falling == sorted(falling, reverse=True)
    run.step(0.1)  # judged slow once more, at the floor
    assert run.moves[-1].reason.endswith("taken as the new usual")
    assert run.controller.baselines["export"] == pytest.approx(0.1)
    assert run.controller.knee is None
    for _ in range(100):
        run.step(0.1)
    assert run.controller.limit == CEILING


def test_after_a_false_alarm_it_keeps_the_knee_it_knew_before() -> None:
    """Cut at 16 by its load, then cut to the floor by a slowness that was not its load: once that
    is taken as the new usual, it grows back to one below 16, not past it, for probe_interval."""
    run = Run()
    run.step(0.05, shed=False)
    for _ in range(40):
        run.step(knee_model(10))
    knee = run.controller.knee
    assert knee is not None and 15 <= knee < 18
    while run.controller.limit > SETTINGS.floor:
        run.step(lambda c: knee_model(10)(c) * 5)  # the downstream is 5x slower, at any load
    run.step(lambda c: knee_model(10)(c) * 5)
    assert run.controller.knee == knee
    for _ in range(60):
        run.step(lambda c: knee_model(10)(c) * 5)
    assert SETTINGS.floor < run.controller.limit <= int(knee) - 1


def test_after_the_downstream_slows_down_fivefold_it_returns_to_the_knee() -> None:
    """The service time steps up 5x: the capacity is cut, finds the slowness at the floor, takes it
    as the new usual, and grows back toward the knee within a few seconds."""
    run = Run(settings=SETTINGS._replace(probe_interval=5.0))
    run.step(0.05, shed=False)
    for _ in range(200):
        run.step(knee_model(10, 0.05))
    before = statistics.mean(run.limits[-50:])
    for _ in range(200):
        run.step(knee_model(10, 0.25))
    after = run.limits[-100:]
    assert run.controller.baselines["export"] == pytest.approx(0.25, rel=0.1)
    assert statistics.mean(after) >= 0.8 * before
    assert min(run.limits[200:]) >= SETTINGS.floor


def test_errors_lower_the_capacity_and_a_steady_share_at_the_floor_is_the_new_usual() -> None:
    run = Run()
    run.warm()
    run.step(0.05, errors=3)  # 30 % of responses failed: cut by 30 %
    assert run.controller.limit == pytest.approx(CEILING * 0.7)
    assert "30% of responses failed" in run.moves[-1].reason
    while run.controller.limit > SETTINGS.floor:
        run.step(0.05, errors=3)
    run.step(0.05, errors=3)
    assert run.controller.usual_errors == pytest.approx(0.3)
    run.step(0.05, errors=3)
    assert run.controller.limit > SETTINGS.floor  # 30 % is usual now: healthy, it grows again
    run.step(0.05, errors=0)
    assert run.controller.usual_errors == 0.0  # and the usual share follows the errors down


def test_one_error_below_the_rate_moves_nothing() -> None:
    run = Run()
    run.warm()
    run.step(0.05, shed=False, errors=0, samples=40)
    run.step(0.05, shed=False, errors=1, samples=40)  # 2.5 %, below the 5 % error rate
    assert run.controller.limit == CEILING


def test_a_timeout_counts_as_an_error() -> None:
    run = Run(settings=SETTINGS._replace(timeout=1.0))
    run.warm()
    run.step(lambda _: 5.0, shed=False, samples=10)
    assert run.controller.limit < CEILING
    assert "failed" in run.moves[-1].reason


def test_one_stalled_response_is_not_an_overload() -> None:
    """A single response 100x slower (a garbage collection, a lock) moves no median."""
    run = Run()
    run.warm()
    latencies = iter([5.0] + [0.05] * 9)
    run.step(lambda _: next(latencies), shed=False)
    assert run.controller.limit == CEILING


def test_endpoints_keep_their_own_usual_latency() -> None:
    """A 2 s export and a 5 ms payment: neither is slow against its own usual latency."""
    mixed = Mixed()
    limits = []
    for _ in range(20):
        mixed.window(charge=0.005, export=2.0)
        limits.append(mixed.controller.limit)
    assert limits == sorted(limits) and limits[-1] > SETTINGS.floor  # healthy: it only grew
    assert mixed.controller.baselines == {"export": pytest.approx(2.0), "charge": pytest.approx(0.005)}


def test_an_endpoint_is_judged_on_enough_responses_and_not_on_old_ones() -> None:
    """Four slow exports a window are judged two windows on, as eight; four once, then nothing for
    longer than STALE_WINDOWS, are too few and too old to judge."""
    mixed = Mixed()
    controller = mixed.controller

    def window(exports: int, latency: float) -> None:
        mixed.window(charge=0.005, export=latency, exports=exports)

    window(5, 0.05)  # the usual latencies
    window(1, 5.0)
    for _ in range(STALE_WINDOWS + 1):
        window(0, 0.0)
    grown = controller.limit
    window(SETTINGS.min_samples - 1, 5.0)
    assert controller.limit >= grown  # not judged: the charges alone were
    grown = controller.limit
    window(SETTINGS.min_samples - 1, 5.0)
    assert controller.limit < grown


def test_a_bad_floor_is_refused() -> None:
    with pytest.raises(ValueError, match="floor"):
        CapacityController(4, SETTINGS._replace(floor=5), now=0.0)


def test_the_shedders_thresholds_stay_shares_of_the_current_capacity() -> None:
    shedder = WorkerShedder(20, THRESHOLDS, SETTINGS._replace(min_samples=1, window=0.0))
    # It starts at its floor (2): every class may have one request in flight.
    assert (shedder.capacity, shedder._limits[Priority.LOW]) == (2, 1)
    assert shedder.admit(Priority.LOW)
    assert not shedder.admit(Priority.LOW)  # shed: the capacity is what turns it away
    shedder.finish("export", 0.01)  # learns the usual latency (every window closes at once here)
    for _ in range(100):
        if shedder.capacity == 20:
            break
        while shedder.admit(Priority.LOW):  # fill the low class until one is shed: it may grow
            pass
        for _ in range(shedder.in_flight):
            shedder.finish("export", 0.01)
    assert shedder.capacity == 20
    assert shedder._limits == {Priority.LOW: 12, Priority.NORMAL: 15, Priority.HIGH: 18}
    for _ in range(3):
        assert shedder.admit(Priority.LOW)
        shedder.finish("export", 1.0)  # 100x slower: halved each time (to 10, then 5, then the floor)
    assert shedder.capacity == SETTINGS.floor
    assert shedder._limits == {Priority.LOW: 1, Priority.NORMAL: 1, Priority.HIGH: 1}
    assert shedder.admit(Priority.CRITICAL)  # never shed, whatever the capacity
    state = shedder.state()
    assert state["capacity"] == SETTINGS.floor and state["adaptive"] is True
    assert "slower than usual" in state["reason"]


def test_every_move_of_the_capacity_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("ratelimits")
    logger.addHandler(caplog.handler)  # the test settings keep ratelimits' logs from propagating
    caplog.set_level(logging.INFO, logger="ratelimits")
    try:
        shedder = WorkerShedder(8, THRESHOLDS, SETTINGS._replace(min_samples=1, window=0.0))
        shedder.finish("export", 0.01)  # the usual latency
        while shedder.admit(Priority.LOW):
            pass
        for _ in range(shedder.in_flight):
            shedder.finish("export", 0.01)  # healthy, one shed: 2 -> 3
        assert shedder.admit(Priority.LOW)
        shedder.finish("export", 1.0)  # 100x slower: halved, to the floor
    finally:
        logger.removeHandler(caplog.handler)
    moves = [r for r in caplog.records if r.getMessage().startswith("ratelimits: worker capacity")]
    assert [m.getMessage() for m in moves] == [
        "ratelimits: worker capacity 2 -> 3: healthy, and requests were shed",
        "ratelimits: worker capacity 3 -> 2: export answered 100.0x slower than usual (tolerance 1.5x)",
    ]
    assert [m.levelno for m in moves] == [logging.INFO, logging.WARNING]
    assert (moves[1].ratelimit_capacity, moves[1].ratelimit_capacity_before) == (2, 3)  # type: ignore[attr-defined]


def test_responses_admitted_before_a_cut_are_not_judged_after_it() -> None:
    """The slow responses of requests admitted at the old capacity keep coming after a cut: they
    are left out, so they neither cut again nor, at the floor, become the new usual."""
    run = Run()
    run.warm()
    run.step(1.0)  # 20x slower: halved
    cut_at, limit = run.now, run.controller.limit
    assert limit == CEILING / 2
    for _ in range(20):
        run.controller.shed()
        for _ in range(10):
            run.now += WINDOW / 10
            run.controller.record("export", 1.0, error=False, now=run.now, admitted_at=cut_at - 0.1)
    assert run.controller.limit == limit
    assert run.controller.baselines["export"] == pytest.approx(0.05)
    # Admitted after the cut, and as slow: judged (a window on), and cut again.
    for _ in range(20):
        run.now += WINDOW / 10
        run.controller.record("export", 1.0, error=False, now=run.now, admitted_at=run.now - 0.01)
    assert run.controller.limit < limit


def test_after_a_cut_the_shedder_grows_back_to_where_every_class_is_admitted_less() -> None:
    """60/75/90 %: at 8 the low class has 4 in flight, and at 7 still 4, so a cut caused at 8 by
    low-priority load grows back to 6 (3, 4 and 5 in), not 7."""
    shedder = WorkerShedder(16, THRESHOLDS, SETTINGS)
    assert shedder.controller is not None
    below = shedder.controller.below
    assert [below(knee) for knee in (8, 7, 16, 3)] == [6, 6, 14, 2]
    assert CapacityController(16, SETTINGS, now=0.0).below(8) == 7  # without a shedder: one less


def test_a_knee_another_endpoint_caused_outlives_a_false_alarm() -> None:
    """Payments queue behind exports at 16 or so: cut there. Then the exports' downstream becomes
    5x slower, which no cut mends: at the floor that is the new usual, and the capacity grows back
    to one below the payments' knee, not to the ceiling."""
    mixed = Mixed()
    controller, window = mixed.controller, mixed.window
    window(0.005, 0.05)  # the usual latencies
    while controller.limit < 16:
        window(0.005, 0.05)
    knee = controller.limit
    window(0.02, 0.05)  # payments 4x slower: cut
    assert controller.knee == knee and controller.limit < knee
    while controller.limit > SETTINGS.floor:
        window(0.005, 0.25)
    window(0.005, 0.25)
    assert controller.last is not None and controller.last.reason.endswith("taken as the new usual")
    assert controller.knee == knee
    for _ in range(60):
        window(0.005, 0.25)
    assert controller.limit == int(knee) - 1
