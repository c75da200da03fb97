"""A policy source's background reload stops with its source: a retired source starts no other load."""

from __future__ import annotations

import threading
import time
from typing import Any

from ratelimits import engine
from ratelimits.policies.settings import SettingsPolicySource
from ratelimits.policies.snapshot import PolicySnapshot
from ratelimits.policies.source import SnapshotPolicySource

from .support.settings import merged

#: Generous against RETIRED_CHECK_S (50 ms) on a loaded machine, and far below the backoff below.
ENDS_WITHIN_S = 2.0


class UnreadableSource(SnapshotPolicySource):
    """A source whose tables never answer: it decides on the settings' policies, retrying slowly."""

    retry_backoff = (30.0, 30.0)
    #: The attempts of every instance (a reset makes a new one), for the test to read.
    loads: list[float] = []

    def load(self) -> PolicySnapshot:
        UnreadableSource.loads.append(time.monotonic())
        raise RuntimeError("the tables cannot be read")

    def fallback(self, error: Exception) -> PolicySnapshot | None:
        return SettingsPolicySource().snapshot()


def reloads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ratelimits-policy-reload"]


def test_a_retired_sources_reload_ends_at_once_and_never_loads_again(settings: Any) -> None:
    """Its first load failed, so it retries in the background, waiting out a 30 s backoff. The
    settings change (another source serves now): its thread ends within RETIRED_CHECK_S (bounded
    here by ENDS_WITHIN_S), without the load it was waiting to make, which would read the tables
    for a source nobody asks."""
    UnreadableSource.loads.clear()
    settings.RATELIMITS = merged(settings.RATELIMITS, {"POLICIES": {"SOURCE": f"{__name__}.UnreadableSource"}})
    engine.reset()
    source = engine.get_policy_source()
    assert isinstance(source, UnreadableSource)
    assert source.snapshot().tiers  # the settings' policies, while the tables do not answer
    assert len(UnreadableSource.loads) == 1
    (thread,) = reloads()
    engine.reset()  # retired, as a change of the settings does
    started = time.monotonic()
    thread.join(ENDS_WITHIN_S)
    assert not thread.is_alive(), f"the reload still waits {time.monotonic() - started:.1f} s after retiring"
    assert len(UnreadableSource.loads) == 1  # the thread is gone: nothing more can load
